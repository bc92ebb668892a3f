"""Counting the reads of tensor values into Python that KVzap's serving code makes per step (a test probe).

On a GPU every such read (``.tolist()``, ``.item()``, ``int(t)``, ``bool(t)``, ``.cpu()``, ...) of a device tensor
waits for the stream: one per layer or per request would dominate a decode step. The engine code here is meant
to make a constant number per step, whatever the batch size and layer count. This module counts them, on any
device: a ``TorchFunctionMode`` sees every such call. Value reads are counted on device and host tensors alike (on
the CPU engine every tensor is a host tensor, so the count is an upper bound of what a GPU would synchronize on);
copies to the host (``.cpu()``, ``.to("cpu")``) are counted when the tensor is not on the CPU already.

Off unless ``KVZAP_COUNT_HOST_READS=1`` in the engine's processes: ``counted`` then wraps the serving hooks, and
the step-end readings (``stats.py``) carry the step's counts, split into ``forward`` (the aux cache's host-side
layout, the backend's metadata, every layer's attention and scoring), ``step_end`` (decisions, the radix cache's
records) and ``release`` (what SGLang's frees of rows and slots ask of the store since the step before).
"""

from __future__ import annotations

import functools
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

ENV = "KVZAP_COUNT_HOST_READS"
_READS = frozenset({torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
                    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy})
# Calls whose result's size depends on the values: the host waits for the device to learn it (a read on a GPU).
_SIZED_BY_VALUES = frozenset({torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere, torch.unique,
                              torch.Tensor.unique, torch.unique_consecutive, torch.Tensor.unique_consecutive,
                              torch.masked_select, torch.Tensor.masked_select, torch.bincount, torch.Tensor.bincount})
# Indexing calls that sync when an index is a boolean mask (it is turned into the positions it selects).
_INDEXING = frozenset({torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
                       torch.Tensor.index_put, torch.index_put})


def _bool_index(index) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, (tuple, list)):
        return any(_bool_index(i) for i in index)
    return False


def syncs(func, args, kwargs) -> bool:
    """Whether the call makes the host wait for tensor values: a read into Python (``_READS``), a result sized by the
    values (``nonzero``, ``unique``, ``masked_select``, ...), indexing with a boolean mask, ``torch.where`` with the
    condition alone, ``repeat_interleave`` with tensor repeats and no ``output_size``."""
    if func in _READS or func in _SIZED_BY_VALUES:
        return True
    if func in _INDEXING:
        return len(args) > 1 and _bool_index(args[1])
    if func is torch.where:
        return len(args) + len(kwargs) == 1
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None
    return False


class HostReads(TorchFunctionMode):
    """Counts value reads (see the module docstring), and the other calls that wait for values (``syncs``), made while
    it is active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if syncs(func, args, kwargs) or (func in (torch.Tensor.to, torch.Tensor.cpu) and _device_to_host(func, args, kwargs)):
            self.count += 1
        return func(*args, **kwargs)


def _device_to_host(func, args, kwargs) -> bool:
    """``.cpu()`` / ``.to(cpu)`` of a tensor that is not on the CPU already (a copy to the CPU is a no-op)."""
    source = args[0]
    if not isinstance(source, torch.Tensor) or source.device.type == "cpu":
        return False
    if func is torch.Tensor.cpu:
        return True
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


class Transfers(TorchFunctionMode):
    """Counts the host<->device transfers OUR code asks for while active, both directions (a test probe):

    - ``reads``: value reads into Python and the calls that wait for values (``syncs``: boolean-mask indexing,
      ``nonzero``, ``unique``, ...: a device -> host copy and a wait on a GPU);
    - ``moves``: every ``.to(...)`` naming a device, ``.cpu()``, ``.cuda()``, every non-blocking ``copy_`` and every
      ``copy_`` between devices (dtype-only ``.to`` is no move).

    A call counts when the Python frame that makes it is under ``kvzap_export/`` (SGLang's kernels, Triton's
    interpreter and torch make their own). On the CPU engine the "device" is the CPU too, so a move is recognised by
    naming its target: this counts the calls that would be transfers on a GPU (a blocking ``copy_`` between two CPU
    tensors is not seen, which is why our uploads go through ``ragged_store.upload``, a ``.to(device)``); on CUDA
    tensors the device check sees every copy."""

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.moves = 0

    @property
    def count(self) -> int:
        return self.reads + self.moves

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _PACKAGE in sys._getframe(1).f_code.co_filename:
            if syncs(func, args, kwargs):
                self.reads += 1
            elif func in (torch.Tensor.cpu, torch.Tensor.cuda) or (func is torch.Tensor.to and _names_device(args, kwargs)):
                self.moves += 1
            elif func is torch.Tensor.copy_ and (kwargs.get("non_blocking") or (len(args) > 2 and args[2])
                                                 or args[0].device != args[1].device):
                self.moves += 1
        return func(*args, **kwargs)


_PACKAGE = os.sep + "kvzap_export" + os.sep


def _names_device(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device, torch.Tensor))


class StepCounts:
    """This process's tallies since the last step end: ``add(kind, n)``, ``take()``."""

    KINDS = ("forward", "step_end", "release")

    def __init__(self):
        self.counts = dict.fromkeys(self.KINDS, 0)

    def add(self, kind: str, n: int) -> None:
        self.counts[kind] += n

    def take(self) -> dict:
        out, self.counts = self.counts, dict.fromkeys(self.KINDS, 0)
        return out


@functools.cache
def tallies() -> StepCounts | None:
    """The process's tallies when ``KVZAP_COUNT_HOST_READS=1``, else None (read once). A process-wide singleton, forced
    by the engines' hook contract: ``counted`` wraps methods the engine reaches through plain-function hooks, with no
    object of ours in between; the step-end hook takes the tally."""
    return StepCounts() if os.environ.get(ENV) == "1" else None


def counted(kind: str):
    """Decorator: when counting is on, the call's reads are added to ``kind`` (``StepCounts.KINDS``)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            counts = tallies()
            if counts is None:
                return fn(*args, **kwargs)
            with HostReads() as mode:
                result = fn(*args, **kwargs)
            counts.add(kind, mode.count)
            return result

        return inner

    return wrap
