"""The CUDA stand-in for sgl-kernel (scripts/sglang_gpu/sgl_kernel) and the bundle's start-up stubs
(scripts/sglang_gpu/startup) where SGLang is not needed: what is provided, what raises and how, the ops against an
independent float64 formula, and the stand-in's dist-info. Their equality with SGLang's own torch code is
test_standin_ops.py (SGLang environment)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from scripts.sglang_gpu.engine_bundle import layout

GPU_DIR = Path(__file__).resolve().parents[2] / "scripts" / "sglang_gpu"


@pytest.fixture
def standin(monkeypatch):
    """The stand-in imported as ``sgl_kernel`` for one test; whatever ``sgl_kernel`` was before is restored after."""
    saved = {name: module for name, module in sys.modules.items() if name.partition(".")[0] == "sgl_kernel"}
    for name in saved:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(GPU_DIR))
    module = importlib.import_module("sgl_kernel")
    assert Path(module.__file__).parent == GPU_DIR / "sgl_kernel"
    yield module
    for name in [n for n in sys.modules if n.partition(".")[0] == "sgl_kernel"]:
        del sys.modules[name]
    sys.modules.update(saved)


def reference_rmsnorm(x, weight, eps):
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
def test_rmsnorm_and_fused_add_rmsnorm_follow_the_formula(standin, dtype, rtol):
    torch.manual_seed(0)
    x = (torch.randn(6, 32) * torch.logspace(-3, 1, 6)[:, None]).to(dtype)
    residual, weight = torch.randn(6, 32).to(dtype), torch.rand(32).to(dtype) + 0.5
    torch.testing.assert_close(standin.rmsnorm(x, weight, 1e-5).double(), reference_rmsnorm(x, weight, 1e-5),
                               rtol=rtol, atol=1e-6)
    got, got_residual = x.clone(), residual.clone()
    assert standin.fused_add_rmsnorm(got, got_residual, weight, 1e-5) is None
    total = x.double() + residual.double()
    torch.testing.assert_close(got_residual.double(), total, rtol=rtol, atol=1e-6)
    torch.testing.assert_close(got.double(), reference_rmsnorm(total, weight, 1e-5), rtol=2 * rtol, atol=1e-6)


def test_silu_and_mul_follows_the_formula_and_refuses_rows_sgl_kernel_refuses(standin):
    torch.manual_seed(0)
    gate_up = torch.randn(4, 2 * 12)
    want = torch.nn.functional.silu(gate_up[:, :12].double()) * gate_up[:, 12:].double()
    torch.testing.assert_close(standin.silu_and_mul(gate_up).double(), want)
    with pytest.raises(ValueError, match="not a multiple of 16 bytes"):
        standin.silu_and_mul(torch.randn(4, 2 * 3, dtype=torch.bfloat16))  # 12 bytes a row
    with pytest.raises(ValueError, match="does not fit"):
        standin.silu_and_mul(gate_up, torch.empty(4, 11))


def test_weak_ref_tensor_aliases_the_same_memory(standin):
    base = torch.arange(12.0).reshape(3, 4)[:, 1:]
    alias = standin.weak_ref_tensor(base)
    assert (alias.data_ptr(), alias.shape, alias.stride()) == (base.data_ptr(), base.shape, base.stride())
    base[0, 0] = -1.0
    assert alias[0, 0].item() == -1.0


@pytest.mark.parametrize("major, expected", [(8, False), (9, True), (10, True)])
def test_pdl_support_is_compute_capability_9_and_up(standin, monkeypatch, major, expected):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    standin.utils.is_arch_support_pdl.cache_clear()
    assert standin.is_arch_support_pdl() is expected
    standin.utils.is_arch_support_pdl.cache_clear()


def test_names_imported_but_not_covered_raise_naming_themselves(standin):
    for name in standin._IMPORTED_NOT_PROVIDED:
        with pytest.raises(NotImplementedError, match=rf"sgl_kernel\.{name} is not provided by kvzap-export's CUDA"):
            getattr(standin, name)()
    kvcacheio = importlib.import_module("sgl_kernel.kvcacheio")
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.kvcacheio\.transfer_kv_direct is not provided"):
        kvcacheio.transfer_kv_direct()
    quantization = importlib.import_module("sgl_kernel.quantization")
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.quantization\.ggml_dequantize is not provided"):
        quantization.ggml_dequantize()


def test_any_other_name_is_absent_as_in_a_build_without_it(standin):
    with pytest.raises(standin.NotProvided, match=r"sgl_kernel\.merge_state_v2 is not provided"):
        standin.merge_state_v2  # noqa: B018
    assert not hasattr(standin, "apply_rope_with_cos_sin_cache_inplace")
    with pytest.raises(ImportError):
        exec("from sgl_kernel import fused_experts")
    for submodule in ("sgl_kernel.allreduce", "sgl_kernel.scalar_type", "sgl_kernel.flash_attn"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(submodule)
    assert not hasattr(torch.ops.sgl_kernel, "rmsnorm")
    assert set(standin.PROVIDED) <= set(dir(standin))


def test_the_stand_in_dist_info_passes_sglangs_version_check_and_says_what_it_is(tmp_path):
    layout.write_standin(GPU_DIR, tmp_path)
    [dist_info] = tmp_path.glob("sglang_kernel-*.dist-info")
    metadata = (dist_info / "METADATA").read_text()
    assert "Name: sglang-kernel\n" in metadata and "stand-in" in metadata.split("Summary:")[1].splitlines()[0]
    assert Version(layout.STANDIN_DIST_VERSION) >= Version("0.4.9")  # engine.py's assert_pkg_version minimum
    assert Version(layout.STANDIN_DIST_VERSION).local == "kvzap.standin"
    import importlib.metadata

    found = [d for d in importlib.metadata.distributions(path=[str(tmp_path)]) if d.metadata["Name"] == "sglang-kernel"]
    assert [d.version for d in found] == [layout.STANDIN_DIST_VERSION]
    assert {p.name for p in tmp_path.iterdir()} == {"sgl_kernel", dist_info.name, "sitecustomize.py", "IPython"}


def load_startup():
    spec = importlib.util.spec_from_file_location("kvzap_startup_under_test", GPU_DIR / "startup" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    spec.loader.exec_module(module)
    sys.meta_path[:] = before  # the test drives its own finders
    return module


def test_startup_stubs_answer_only_for_their_names_and_only_when_nothing_else_does(tmp_path, monkeypatch):
    startup = load_startup()
    finder = startup.StubFinder(["kvzap_absent_pkg", "kvzap_present_pkg"])
    (tmp_path / "kvzap_present_pkg.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, finder])
    try:
        assert importlib.import_module("kvzap_present_pkg").REAL is True  # a real module wins
        stub = importlib.import_module("kvzap_absent_pkg.cute.nvgpu")
        assert isinstance(stub, startup.PlaceholderModule)
        assert importlib.util.find_spec("kvzap_other_absent_pkg") is None
        decorated = stub.experimental.jit(lambda: 1)  # decorator use at import time works ...
        with pytest.raises(NotImplementedError, match="kvzap_absent_pkg.cute.nvgpu.experimental.jit"):
            decorated()  # ... and the decorated function raises when called
        with pytest.raises(NotImplementedError, match="kvzap_absent_pkg.cute.nvgpu.Float32 is a kvzap-export"):
            stub.Float32(3, 4)
    finally:
        for name in [n for n in sys.modules if n.partition(".")[0] in ("kvzap_absent_pkg", "kvzap_present_pkg")]:
            del sys.modules[name]


def test_startup_never_stubs_names_that_torch_or_transformers_probe():
    startup = load_startup()
    probed = {"torchcodec", "av", "decord", "kernels", "dill", "flashinfer", "IPython", "torch_memory_saver",
              "outlines", "llguidance", "mistral_common"}
    assert set(startup.STUBS) == {"cutlass"} and not set(startup.STUBS) & probed
