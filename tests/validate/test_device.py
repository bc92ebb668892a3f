"""The ``--device cuda`` path of validate, exercised on the CPU as far as one allows.

No GPU here: a ``Device`` of kind cuda whose tensors live on the CPU runs the same plumbing, with the Triton
kernels in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py). The kernels themselves are
compared with the reference exactly, so these checks are real comparisons of two computations; what the CPU
cannot show is the compiled kernels and the CUDA library on a GPU (never run here).
"""

import pytest
import torch

from kvzap_export.validate.device import Device, TritonKernels, ort_providers, resolve_device, triton_kernels
from kvzap_export.validate.run import validate_bundle


def _interpreted_cuda_device(**kernels) -> Device:
    return Device("cuda", "cpu", info={"gpu": "stand-in (CPU, Triton interpreter)", "torch": torch.__version__},
                  kernels=kernels)


def _checks(report):
    return {c["name"]: c for c in report["checks"]}


def test_gpu_kernels_are_validation_backends(bundle):
    kernels = triton_kernels("cpu")
    assert isinstance(kernels, TritonKernels), kernels
    device = _interpreted_cuda_device(triton=kernels, cuda="the CUDA library runs on a CUDA GPU only")
    report = validate_bundle(bundle, ("torch", "onnxrt", "triton", "cuda"), device=device, model_level=False)
    checks = _checks(report)
    for kind in ("threshold_compaction", "kv_compaction"):
        triton = checks[f"operator:{kind}:triton"]
        assert triton["status"] == "passed" and triton["detail"]["comparison"] == "exact", triton
        assert triton["detail"]["backend"] == "triton" and triton["detail"]["mismatches"] == 0
        assert checks[f"operator:{kind}:cuda"]["status"] == "skipped"
    assert report["verdict"] == "incomplete"  # the CUDA library and the model level did not run
    assert report["device"]["kind"] == "cuda" and report["device"]["kernels"]["triton"] == "available"
    md = (bundle / "report" / "parity.md").read_text()
    assert "device cuda, gpu stand-in (CPU, Triton interpreter)" in md
    assert "operator:kv_compaction:cuda: did not run: the CUDA library runs on a CUDA GPU only" in md


class _OffByOne(TritonKernels):
    """The Triton kernel with one decision flipped: the exact comparison must catch it."""

    def threshold_compaction(self, scores, lengths, threshold, window, sink=0):
        keep, counts, indices = super().threshold_compaction(scores, lengths, threshold, window, sink)
        keep = keep.clone()
        keep[0, 0, 0] = ~keep[0, 0, 0]
        return keep, counts, indices


def test_a_wrong_kernel_fails(bundle):
    report = validate_bundle(bundle, ("torch", "onnxrt", "triton"), device=_interpreted_cuda_device(triton=_OffByOne()),
                             model_level=False)
    check = _checks(report)["operator:threshold_compaction:triton"]
    assert check["status"] == "failed" and check["detail"]["failed"] == ["keep"] and report["verdict"] == "failed"


def test_kernel_backends_without_a_gpu_say_why():
    device = resolve_device("cpu")
    assert device.kernels == {} and device.ort_providers == ("CPUExecutionProvider",)
    from kvzap_export.validate.device import cuda_kernels

    assert "CUDA GPU" in cuda_kernels("cpu")


def test_ort_without_cuda_provider_says_it_ran_on_the_cpu(monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    providers, note = ort_providers("cuda")
    assert providers == ("CPUExecutionProvider",) and "ran on the CPU" in note and "onnxruntime-gpu" in note
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert ort_providers("cuda") == (("CUDAExecutionProvider", "CPUExecutionProvider"), None)


@pytest.mark.gpu
def test_cuda_device_on_a_gpu(bundle):
    report = validate_bundle(bundle, device="cuda", model_level=False)
    checks = _checks(report)
    assert report["device"]["gpu"] and report["device"]["cuda"] and report["device"]["torch"]
    assert checks["operator:threshold_compaction:triton"]["status"] == "passed"
    assert checks["operator:kv_compaction:triton"]["status"] == "passed"
    assert checks["operator:threshold_compaction:cuda"]["status"] in ("passed", "skipped")
