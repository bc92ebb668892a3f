"""Ragged decode attention through SGLang's own Triton decode kernel (``kernels/flattened_attention.py``'s ``launch``),
run through the benchmark's per-call layout (``bench/flattened_decode.py``: ``FlattenedDecode``, its buffers), and the
loading of SGLang's kernel file (``kernels/sglang_kernels.py``). The engine's own layout is tested in
test_flattened_step.py.

SGLang's kernel runs here in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), in
float32 and float16 (the interpreter has no bfloat16), compared with ``ragged_attention.ragged_decode_attention``, the
float32 formula written independently of every kernel. The kernel file is SGLang's: from the installed sglang, else
the site-packages of $KVZAP_SGLANG_PYTHON (the engine environment CI builds), else $KVZAP_SGLANG_KERNELS (the wheel, or
a directory holding sglang/kernels/ops/attention/); the tests that run it skip otherwise, saying so. On a GPU the same
tests run SGLang's compiled kernel on CUDA tensors (float32 then goes through TF32 in its tl.dot: looser tolerance;
not run yet); the int32 negative control always runs in a subprocess under the interpreter. The buffer-layout
tests (``fill``) need no kernel and always run.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from kvzap_export.errors import ConfigError, InputError, MissingDependencyError
from kvzap_export.bench.flattened_decode import FlattenedDecode, flattened_decode_attention
from kvzap_export.kernels import sglang_kernels
from kvzap_export.kernels.ragged_attention import ragged_decode_attention

# SGLang's stage 2 divides 0 by 0 for an empty head (the interpreter warns; the rows are zeroed after)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def source(sglang_kernel_path):
    return sglang_kernel_path


@pytest.fixture(scope="module")
def kernels(sglang_kernels):
    return sglang_kernels


def case(lengths, group, dim=16, v_dim=None, store=300, width=None, dtype=torch.float32, seed=0, id_dtype=torch.int32):
    """q [B, H * group, D], stores [E, D] / [E, Dv], ids [B, H, W] (each head its own random entries, padding random
    valid ids), lengths [B, H]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    B, H = lengths.shape
    width = width or max(1, int(lengths.max()))
    q = torch.randn(B, H * group, dim, generator=g).to(dtype)
    k = torch.randn(store, dim, generator=g).to(dtype)
    v = torch.randn(store, v_dim or dim, generator=g).to(dtype)
    ids = torch.randint(0, store, (B, H, width), generator=g)
    for b in range(B):
        for h in range(H):
            ids[b, h, : lengths[b, h]] = torch.randperm(store, generator=g)[: lengths[b, h]]
    return q, k, v, ids.to(id_dtype), lengths


def on(device, *tensors):
    return [t.to(device) for t in tensors]


# On a GPU, SGLang's grouped kernel multiplies float32 through tl.dot in TF32 (Triton's default): 10-bit mantissa
F32 = dict(atol=1e-5, rtol=1e-5) if DEVICE == "cpu" else dict(atol=5e-3, rtol=5e-3)
TOL = {torch.float32: F32, torch.float16: dict(atol=2e-3, rtol=2e-3)}
CASES = {  # lengths [B][H], group, head dims, splits (max_kv_splits, policy, target programs, min chunk)
    "gqa4-ragged-empty": ([[5, 0], [70, 33], [1, 128]], 4, (16, 16), (8, "proportional", 64, 1)),
    "mha-group1": ([[40, 0, 3], [100, 9, 64]], 1, (16, 16), (4, "max", 0, 64)),
    "group3-dv8": ([[0, 17], [130, 2]], 3, (16, 8), (6, "proportional", 16, 8)),
    "gqa4-one-split": ([[64, 31, 0, 96]], 4, (32, 32), (1, "max", 0, 64)),
    "group8-all-empty-row": ([[0, 0], [50, 200]], 8, (16, 16), (8, "proportional", 4096, 1)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("name", list(CASES))
def test_flattened_kernel_equals_the_float32_formula(kernels, name, dtype):
    lengths, group, (dim, v_dim), (splits, policy, programs, chunk) = CASES[name]
    q, k, v, ids, lengths = on(DEVICE, *case(lengths, group, dim, v_dim, dtype=dtype))
    flat = FlattenedDecode(4, ids.shape[1], group, dim, 256, v_head_dim=v_dim, dtype=dtype, device=DEVICE,
                           max_kv_splits=splits, split_policy=policy, target_programs=programs or None,
                           min_chunk=chunk, kernels=kernels)
    scale = 1 / math.sqrt(dim)
    got = flat(q, k, v, ids, lengths, scale)
    want = ragged_decode_attention(q, k, v, ids, lengths, scale)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float(), want.float(), **TOL[dtype]), (got.float() - want.float()).abs().max()
    empty = (lengths == 0).repeat_interleave(group, dim=1)
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))  # SGLang's stage 2 writes 0/0 there: we zero it
    if name == "gqa4-ragged-empty":  # the proportional policy gave rows different split counts
        assert len(set(flat.num_kv_splits[: lengths.numel()].tolist())) > 2


def test_split_counts_follow_each_rows_length():
    flat = FlattenedDecode(2, 3, 4, 16, 512, dtype=torch.float32, device="cpu", max_kv_splits=16, target_programs=10,
                           min_chunk=32, kernels=types.SimpleNamespace())
    lengths = torch.tensor([[0, 1, 31], [32, 300, 512]])
    flat.fill(torch.zeros(2, 3, 512, dtype=torch.int32), lengths)
    chunk = max(32, math.ceil(int(lengths.sum()) / 10))  # 876 entries over 10 programs: 88 per split
    want = [min(16, max(1, math.ceil(n / chunk))) for n in lengths.flatten().tolist()]
    assert flat.num_kv_splits[:6].tolist() == want == [1, 1, 1, 1, 4, 6]
    maxed = FlattenedDecode(2, 3, 4, 16, 512, device="cpu", max_kv_splits=16, split_policy="max",
                            kernels=types.SimpleNamespace())
    maxed.fill(torch.zeros(2, 3, 512, dtype=torch.int32), lengths)
    assert maxed.num_kv_splits[:6].tolist() == [16] * 6


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_fills_rewrite_the_same_buffers_in_place(id_dtype):
    """Many steps of different batch sizes and widths: kv_indptr / kv_indices hold exactly each step's heads' ids
    concatenated, then every padding id once, and no buffer moves (what a CUDA graph replays)."""
    flat = FlattenedDecode(5, 3, 2, 8, 40, dtype=torch.float32, device=DEVICE, max_kv_splits=4,
                           kernels=types.SimpleNamespace())
    pointers = {name: t.data_ptr() for name, t in flat.buffers().items()}
    g = torch.Generator().manual_seed(3)
    for step in range(30):
        B, W = int(torch.randint(1, 6, (), generator=g)), int(torch.randint(1, 41, (), generator=g))
        lengths = torch.randint(0, W + 1, (B, 3), generator=g)
        lengths[0, step % 3] = 0
        ids = torch.randint(0, 10**6, (B, 3, W), generator=g, dtype=id_dtype)
        flat.fill(*on(DEVICE, ids, lengths))
        concatenated = torch.cat([ids[b, h, : lengths[b, h]] for b in range(B) for h in range(3)]).long()
        indptr = torch.cat([torch.zeros(1, dtype=torch.long), lengths.flatten().cumsum(0)])
        assert torch.equal(flat.kv_indptr[: 3 * B + 1].cpu().long(), indptr)
        assert torch.equal(flat.kv_indices[: concatenated.numel()].cpu(), concatenated)
        # the padding went to the tail, one slot each: the step's slots are a permutation of its ids
        assert torch.equal(flat.kv_indices[: ids.numel()].cpu().sort().values, ids.flatten().long().sort().values)
        assert torch.equal(flat._empty[: 3 * B].cpu(), lengths.flatten() == 0)
        assert {name: t.data_ptr() for name, t in flat.buffers().items()} == pointers


def test_int32_ids_after_int64_ids_with_negative_padding():
    """int32 ids go into the low words of the int64 kv_indices: a previous int64 fill's -1 padding (high words all
    ones) must not leak into them."""
    flat = FlattenedDecode(2, 2, 1, 8, 6, device="cpu", kernels=types.SimpleNamespace())
    flat.fill(torch.full((2, 2, 6), -1, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64))
    ids = torch.arange(24, dtype=torch.int32).view(2, 2, 6)
    flat.fill(ids, torch.full((2, 2), 6))
    assert torch.equal(flat.kv_indices, torch.arange(24))


def test_steps_of_different_sizes_reuse_the_buffers_and_stay_exact(kernels):
    flat = FlattenedDecode(3, 2, 4, 16, 96, dtype=torch.float32, device=DEVICE, max_kv_splits=4, target_programs=8,
                           min_chunk=1, kernels=kernels)
    pointers = {name: t.data_ptr() for name, t in flat.buffers().items()}
    for seed, lengths in enumerate([[[3, 90]], [[0, 0], [96, 1], [50, 50]], [[7, 0], [33, 12]]]):
        q, k, v, ids, lengths = on(DEVICE, *case(lengths, 4, width=96, seed=seed))
        got = flat(q, k, v, ids, lengths, 0.25)
        assert torch.allclose(got, ragged_decode_attention(q, k, v, ids, lengths, 0.25), **F32)
        assert got.data_ptr() == flat.out.data_ptr()
    assert {name: t.data_ptr() for name, t in flat.buffers().items()} == pointers


def test_queries_viewed_or_copied_and_caller_output(kernels):
    """q sliced out of a fused QKV projection (rows not H * D apart: copied into the q buffer) and q with padded heads
    (viewed in place); an output tensor the caller gives."""
    q, k, v, ids, lengths = on(DEVICE, *case([[20, 3], [0, 64]], 4))
    qkv = torch.cat([q.flatten(1), torch.randn(2, 40, device=DEVICE)], 1)
    sliced = qkv[:, : q[0].numel()].view(q.shape)
    padded = torch.cat([q, torch.zeros(2, 8, 4, device=DEVICE)], -1)[..., :16]
    want = ragged_decode_attention(q, k, v, ids, lengths, 0.3)
    flat = FlattenedDecode(2, 2, 4, 16, 64, dtype=torch.float32, device=DEVICE, max_kv_splits=2, kernels=kernels)
    for query in (sliced, padded):
        assert torch.allclose(flat(query, k, v, ids, lengths, 0.3), want, **F32)
    out = torch.full_like(want, float("nan"))
    assert flat(q, k, v, ids, lengths, 0.3, out=out).data_ptr() == out.data_ptr()
    assert torch.allclose(out, want, **F32)


def test_the_eager_entry_point_grows_its_buffers(kernels, source):
    for seed, lengths in enumerate([[[4, 0]], [[100, 7], [0, 0], [64, 129]]]):
        q, k, v, ids, lengths = on(DEVICE, *case(lengths, 4, seed=seed, id_dtype=torch.int64))
        got = flattened_decode_attention(q, k, v, ids, lengths, 0.2, kernel_path=source)
        assert torch.allclose(got, ragged_decode_attention(q, k, v, ids, lengths, 0.2), **F32)


@pytest.mark.parametrize("layout", ["separate-D128", "interleaved-2D128"])
def test_entry_offsets_past_int32(kernels, layout):
    """Entry ids whose element offset ``id * row_stride`` passes 2**31: separate stores [E, 128] past 16.7M entries,
    and one pool [E, 256] (K and V interleaved, views) past 8.4M. The stores are allocated but never written except
    at the rows used (on the CPU, Linux maps untouched pages lazily: 4.3 GB each, a few pages resident; on a GPU they
    take 4.3 GB each); SGLang's kernel reads them through our int64 kv_indices, and equals the formula.
    (test_int32_indices_would_fault shows the same ids in int32 indices go wrong.)"""
    D, stride = 128, (128 if layout == "separate-D128" else 256)
    rows = 2**31 // stride + 64
    try:
        if layout == "separate-D128":
            k = torch.empty(rows, D, dtype=torch.float16, device=DEVICE)
            v = torch.empty(rows, D, dtype=torch.float16, device=DEVICE)
        else:
            pool = torch.empty(rows, 2 * D, dtype=torch.float16, device=DEVICE)
            k, v = pool[:, :D], pool[:, D:]
    except (RuntimeError, MemoryError) as error:  # pragma: no cover - no overcommit, or a small GPU
        pytest.skip(f"cannot map a {rows} x {stride} float16 store here: {error}")
    high = torch.tensor([rows - 64 + 3, rows - 1, 2**31 // stride + 1, 5, 2**30 // stride, rows - 10])
    g = torch.Generator().manual_seed(0)
    k[high.to(DEVICE)] = torch.randn(len(high), D, generator=g).half().to(DEVICE)
    v[high.to(DEVICE)] = torch.randn(len(high), D, generator=g).half().to(DEVICE)
    ids, lengths = on(DEVICE, torch.stack([high[:3], high[3:]])[None].to(torch.int32), torch.tensor([[3, 3]]))
    q = torch.randn(1, 8, D, generator=g).half().to(DEVICE)
    assert int(high.max()) * stride >= 2**31
    flat = FlattenedDecode(1, 2, 4, D, 3, dtype=torch.float16, device=DEVICE, max_kv_splits=2, kernels=kernels)
    got = flat(q, k, v, ids, lengths, 1 / math.sqrt(D))
    assert flat.kv_indices.dtype == torch.int64
    want = ragged_decode_attention(q, k, v, ids, lengths, 1 / math.sqrt(D))
    assert torch.allclose(got.float(), want.float(), atol=2e-3, rtol=2e-3), (got.float() - want.float()).abs().max()


def test_int32_indices_would_fault(source):
    """The negative control of test_entry_offsets_past_int32: SGLang's kernel given the same ids as int32 kv_indices
    computes the offset in int32 and reads the wrong place (a crash, or a wrong result). In a subprocess: it may
    segfault."""
    script = textwrap.dedent(f"""
        import math, torch
        from kvzap_export.kernels import sglang_kernels
        from kvzap_export.kernels.ragged_attention import ragged_decode_attention
        decode = sglang_kernels.load({source!r}).decode
        D, rows = 128, 2**24 + 64
        k, v = torch.empty(rows, D, dtype=torch.float16), torch.empty(rows, D, dtype=torch.float16)
        ids = torch.tensor([rows - 1, 2**24 + 1], dtype=torch.int64)
        k[ids] = torch.randn(2, D).half(); v[ids] = torch.randn(2, D).half()
        q = torch.randn(1, 4, D).half(); o = torch.empty(1, 4, D, dtype=torch.float16)
        decode.decode_attention_fwd(q, k[:, None], v[:, None], o, torch.tensor([0, 2], dtype=torch.int32),
                                    ids.to(torch.int32), torch.empty(1, 4, 1, D), torch.empty(1, 4, 1),
                                    torch.ones(1, dtype=torch.int32), 1, 0.1, 1.0, 1.0)
        want = ragged_decode_attention(q, k, v, ids.view(1, 1, 2), torch.tensor([[2]]), 0.1)
        print("EQUAL" if torch.allclose(o.float(), want.float(), atol=2e-3) else "DIFFERENT")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "EQUAL" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert done.returncode != 0 or "DIFFERENT" in done.stdout, done.stderr[-2000:]


# ---- loading SGLang's files --------------------------------------------------------------------------------------
def sglang_modules() -> set[str]:
    return {name for name in sys.modules if name == "sglang" or name.startswith("sglang.")}


def has_extend(source) -> bool:
    """Whether the kernel source holds the extend file too (a directory may carry the decode files alone)."""
    try:
        sglang_kernels._Files(Path(source)).read("extend_attention")
    except ConfigError:
        return False
    return True


def test_loading_from_a_path_leaves_sys_modules_as_it_was(source):
    if not source:
        pytest.skip("sglang is installed here: its real modules are loaded, nothing is stood in")
    sentinel = types.ModuleType("sglang.srt.utils")
    before = sglang_modules()
    sys.modules["sglang.srt.utils"] = sentinel  # as if the real SGLang had been imported before
    extend = has_extend(source)
    try:
        loaded = sglang_kernels._load.__wrapped__(source, extend)  # a fresh load (load() is cached)
        assert sys.modules["sglang.srt.utils"] is sentinel
    finally:
        del sys.modules["sglang.srt.utils"]
    assert sglang_modules() == before
    assert (loaded.extend is not None) == extend and hasattr(loaded.decode, "decode_attention_fwd")
    assert loaded.decode._KEEP_SCHEDULER_SPLITS is False
    assert loaded.source.version == "0.5.23", (
        f"{source}: version {loaded.source.version!r}; a zip of SGLang's files must carry sglang-0.5.23.dist-info "
        "(docs/benchmarks.md, 'How to run the GPU check')")
    assert set(loaded.source.stood_in) == set(sglang_kernels.STOOD_IN)
    assert loaded.source.as_dict()["stood_in"] == sglang_kernels.STOOD_IN


def test_stood_in_names_are_exactly_what_the_kernel_files_import(kernels):
    """Every name the decode and extend files import from SGLang's runtime is one we stand in, and every stand-in is
    imported by one of them (checked on SGLang's own files)."""
    imported, files = set(), ["decode_attention"]
    installed = kernels.source.origin == "installed"
    if installed or has_extend(kernels.source.location):
        files.append("extend_attention")
    for name in files:
        if installed:
            text = (Path(kernels.decode.__file__).parent / f"{name}.py").read_text()
        else:
            text = sglang_kernels._Files(Path(kernels.source.location)).read(name)[1]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang.srt"):
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    assert imported <= set(sglang_kernels.STOOD_IN)
    if len(files) == 2:
        assert imported == set(sglang_kernels.STOOD_IN)


def test_missing_kernel_source_is_one_line_naming_what_to_pass(monkeypatch, tmp_path):
    monkeypatch.delenv(sglang_kernels.ENV_VAR, raising=False)
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(MissingDependencyError, match="--sglang-kernels PATH") as error:
            sglang_kernels.load()
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="no such file"):
        sglang_kernels.load(tmp_path / "absent.whl")
    with pytest.raises(ConfigError, match="decode_attention.py"):
        sglang_kernels.load(tmp_path)
    (tmp_path / "empty.zip").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    with pytest.raises(ConfigError, match="inside this zip"):
        sglang_kernels.load(tmp_path / "empty.zip")


def test_buffers_refuse_steps_past_their_size():
    flat = FlattenedDecode(2, 2, 4, 16, 8, device="cpu", kernels=types.SimpleNamespace())
    with pytest.raises(InputError, match="past the buffers"):
        flat.fill(torch.zeros(3, 2, 8, dtype=torch.int32), torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(InputError, match="past the buffers"):
        flat.fill(torch.zeros(2, 2, 9, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(InputError, match="int32 kv_indptr"):
        FlattenedDecode(2**16, 8, 4, 128, 2**16, device="meta", kernels=types.SimpleNamespace())


@pytest.mark.sglang
def test_the_installed_sglang_of_the_engine_environment(tmp_path):
    """In the engine environment SGLang is installed: its real module is imported (nothing stood in) and gives the
    same as the formula."""
    from tests.conftest import sglang_python

    script = textwrap.dedent("""
        import torch
        from kvzap_export.kernels import sglang_kernels
        from kvzap_export.bench.flattened_decode import FlattenedDecode
        from kvzap_export.kernels.ragged_attention import ragged_decode_attention
        kernels = sglang_kernels.load()
        assert kernels.source.origin == "installed" and kernels.source.stood_in == (), kernels.source
        g = torch.Generator().manual_seed(1)
        q, k, v = torch.randn(2, 8, 16, generator=g), torch.randn(90, 16, generator=g), torch.randn(90, 16, generator=g)
        ids = torch.randint(0, 90, (2, 2, 40), generator=g, dtype=torch.int32)
        lengths = torch.tensor([[40, 0], [3, 17]])
        got = FlattenedDecode(2, 2, 4, 16, 40, dtype=torch.float32, device="cpu", max_kv_splits=4,
                              kernels=kernels)(q, k, v, ids, lengths, 0.25)
        print((got - ragged_decode_attention(q, k, v, ids, lengths, 0.25)).abs().max().item())
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop(sglang_kernels.ENV_VAR, None)
    done = subprocess.run([sglang_python(), "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 1e-5
