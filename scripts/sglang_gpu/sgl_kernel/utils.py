"""``sgl_kernel.utils`` of kvzap-export's CUDA stand-in (see the package docstring): the one name SGLang 0.5.23 imports
from it on the dense CUDA path, ``is_arch_support_pdl`` (``srt/layers/attention/triton_backend.py:71``)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def is_arch_support_pdl() -> bool:
    """True on GPUs of compute capability 9.0 and above (Hopper on), which support programmatic dependent launch.

    SGLang's Triton attention backend passes the answer to its kernels' launches (``use_pdl``), as it does with
    sgl-kernel installed.
    """
    major, _ = torch.cuda.get_device_capability(torch.cuda.current_device())
    return major >= 9
