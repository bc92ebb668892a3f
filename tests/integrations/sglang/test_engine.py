"""KVzap inside the real SGLang 0.5.23 engine on the CPU, against kvpress's tokens: one launch per
``kvzap-export validate --engine sglang`` (request streams through the driver: ``test_engine_streams.py``).

Each test launches a real ``sglang.Engine`` (in the engine environment, $KVZAP_SGLANG_PYTHON) with the kvzap
plugin loaded through its entry point, through ``kvzap-export validate --engine sglang``: the engine's greedy
tokens are compared with kvpress's ``DMSPress(KVzapPress)`` tokens computed here with transformers (the model
level stores them in the bundle), and the KV held is read from SGLang's allocator (or the per-head pool). The two
models and their references: ``conftest.py`` and ``engine_runs.py``. To fit CI, SmolLM2 runs the ragged mode only,
the tiny Qwen3 every mode; docs/integrations.md has the full runs (5 prompts x 64 tokens, every mode on both models).
"""

from __future__ import annotations

import json

import pytest

from kvzap_export.cli.main import main
from tests.integrations.sglang.engine_runs import NEW_TOKENS, PROMPTS, reference_prompts, run_driver

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SHORT_TOKENS = 12  # the two slowest decode paths (Triton's interpreter, eager flex attention) compare fewer tokens
ENTRIES_PER_TOKEN = {"smollm2": 30 * 3, "qwen3": 4 * 2}  # layers x KV heads
CHUNK = 64  # SmolLM2's ragged run prefills in chunks this long (its prompts hold several)


def engine_level(capsys, model, bundle, mode, *extra) -> tuple[int, dict]:
    from tests.conftest import sglang_python

    code = main(["validate", str(bundle), "--engine", "sglang", "--engine-mode", mode, "--model", str(model),
                 "--engine-python", sglang_python(), "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def why(result: dict) -> str:
    return json.dumps({k: result.get(k) for k in ("status", "summary", "error", "problems", "log_tail")}, indent=1)


def check_against_kvpress(result: dict, reference_ids: list[list[int]], new_tokens: int = NEW_TOKENS) -> None:
    assert result["status"] == "passed", why(result)
    rows = result["prompts"]
    assert len(rows) == 2 * PROMPTS and {r["decoding"] for r in rows} == {False, True}
    assert all(r["matches_reference"] is True and len(r["output_ids"]) == new_tokens for r in rows)
    assert sorted({tuple(r["prompt_ids"]) for r in rows}) == sorted(tuple(ids) for ids in reference_ids)
    # The comparison can fail: kvpress's pruned tokens differ from the dense ones the engine gives with KVzap off.
    assert any(r["reference_differs_from_dense"] for r in rows)


@pytest.mark.parametrize("which", ["qwen3"])
def test_mask_mode_gives_kvpress_tokens_and_frees_nothing(request, capsys, which):
    model, bundle = request.getfixturevalue(which)
    code, result = engine_level(capsys, model, bundle, "mask")
    assert code == 0, why(result)
    check_against_kvpress(result, reference_prompts(bundle))
    assert result["engine_info"]["resolved"]["disable_overlap_schedule"] is False  # SGLang's overlap scheduler ran
    for row in result["prompts"]:  # every token of every head, read from SGLang's allocator
        assert row["kv_held"] == row["kv_dense"] == (len(row["prompt_ids"]) + NEW_TOKENS - 1) * ENTRIES_PER_TOKEN[which]
    assert (bundle / "report" / "engine-sglang-mask.md").read_text().startswith("# Engine level: sglang (mask mode) ✓ passed")


@pytest.mark.parametrize("which", ["qwen3"])
def test_evict_mode_gives_kvpress_tokens_and_frees_what_decisions_imply(request, capsys, which):
    model, bundle = request.getfixturevalue(which)
    code, result = engine_level(capsys, model, bundle, "evict")
    assert code == 0, why(result)
    check_against_kvpress(result, reference_prompts(bundle))
    assert result["engine_info"]["resolved"]["disable_overlap_schedule"] is False  # SGLang's overlap scheduler ran
    for row in result["prompts"]:  # the allocator's count is the decisions' count (one request at a time)
        assert row["kv_held"] == row["decided_entries"] <= row["kv_dense"]
    assert result["freed_fraction"] > 0.0  # τ = 0 on the tiny Qwen3: every head of every layer drops something


@pytest.mark.parametrize("which", ["smollm2", "qwen3"])
def test_ragged_mode_gives_kvpress_tokens_and_frees_each_heads_evicted_entries(request, capsys, which):
    """SGLang's defaults on the tiny Qwen3 (radix cache, overlap scheduler, its chunk size); on SmolLM2 the same with
    64-token chunks, so each of its ~400-token prompts is prefilled in several: each chunk after the first attends over
    the entries its request holds (nothing decided yet: every head holds every earlier token), and the prompt is
    decided at its last chunk, as kvpress decides after the whole prefill. Same tokens as kvpress, same entries freed
    as the decisions imply."""
    model, bundle = request.getfixturevalue(which)
    chunked = which == "smollm2"
    if chunked:
        assert min(len(p) for p in reference_prompts(bundle)) > 3 * CHUNK  # several chunks per prompt
    code, result = engine_level(capsys, model, bundle, "ragged", *(["--chunk-size", str(CHUNK)] if chunked else []))
    assert code == 0, why(result)
    check_against_kvpress(result, reference_prompts(bundle))
    resolved = result["engine_info"]["resolved"]  # SGLang's defaults: radix cache, chunked prefill, overlap scheduler
    assert resolved["disable_overlap_schedule"] is False and resolved["disable_radix_cache"] is False
    assert (resolved["chunked_prefill_size"] == CHUNK) is chunked, resolved
    for row in result["prompts"]:  # read from the per-head pool's free list, one request at a time
        dense = (len(row["prompt_ids"]) + NEW_TOKENS - 1) * ENTRIES_PER_TOKEN[which]
        assert row["kv_held"] == row["decided_entries"] < row["kv_dense"] == dense
    if which == "smollm2":  # τ = -4, where one count per request frees 0%: per-head storage frees a third or more
        assert result["freed_fraction"] > 0.3
    # SGLang sized the pool from its memory profile (--mem-fraction-static 0.5 on the CPU) with the budget less the
    # store's bookkeeping: what the store allocated (K/V, scores, free list) and the tables' reservation fit in it
    budget = result["kv_budget"]
    assert 0 < sum(size for part, size in budget.items() if part != "budget") <= budget["budget"]


def test_ragged_mode_through_sglangs_decode_kernel_and_the_step_buffers(qwen3, capsys, monkeypatch):
    """The GPU's decode path on the CPU engine (``KVZAP_RAGGED_DECODE_KERNEL=sglang``): each step laid out in the
    buffers a CUDA graph would replay (``ragged_decode.DecodeBuffers``), attention through SGLang's own decode kernel
    (its installed module, in Triton's interpreter here). Same tokens as kvpress, same entries freed as the torch path.
    The reference's first ``SHORT_TOKENS`` tokens (the interpreter runs each kernel program in Python: CI time)."""
    model, bundle = qwen3
    monkeypatch.setenv("KVZAP_RAGGED_DECODE_KERNEL", "sglang")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    code, result = engine_level(capsys, model, bundle, "ragged", "--max-new-tokens", str(SHORT_TOKENS))
    assert code == 0, why(result)
    check_against_kvpress(result, reference_prompts(bundle), SHORT_TOKENS)
    for row in result["prompts"]:
        assert row["kv_held"] == row["decided_entries"] < row["kv_dense"]


def test_flex_backend_and_chunked_prefill_in_the_cpu_engine(qwen3):
    """The other mask backend (flex attention, eager on the CPU), with prompts prefilled in 64-token chunks
    (decisions wait for the last chunk, so the tokens are still kvpress's). The reference's first ``SHORT_TOKENS``
    tokens: flex attention runs eagerly on the CPU (CI time)."""
    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.validate.engine_level import run_engine_level
    from tests.conftest import sglang_python

    model, bundle = qwen3
    result = run_engine_level(bundle, read_manifest(bundle), "sglang", "mask", str(model), python=sglang_python(),
                              new_tokens=SHORT_TOKENS,
                              engine_args={"attention_backend": "kvzap_flex", "chunked_prefill_size": 64})
    assert result["engine_info"]["args"]["attention_backend"] == "kvzap_flex"
    assert result["engine_info"]["args"]["chunked_prefill_size"] == 64
    check_against_kvpress(result, reference_prompts(bundle), SHORT_TOKENS)


@pytest.mark.parametrize("mode, args, named", [
    # settings checked once the scheduler exists: every problem named in one line, from one launch
    ("evict", {"page_size": 4, "disable_radix_cache": False, "attention_backend": "torch_native",
               "enable_mixed_chunk": True, "chunked_prefill_size": 64},
     ["the radix cache is on (add --disable-radix-cache)", "the page size is 4 (use --page-size 1",
      "(drop --enable-mixed-chunk)", "the decode attention backend is torch_native (use --attention-backend kvzap_"]),
    # graphs a mode cannot run: refused by the BEFORE hook on ModelRunner.init_cuda_graphs, before any capture
    ("ragged", {"cuda_graph_backend_prefill": "breakable"},
     ["prefill graphs are captured (add --cuda-graph-backend-prefill disabled", "(stopped before the capture)"]),
    ("mask", {"cuda_graph_backend_decode": "full"},
     ["graphs are captured (add --cuda-graph-backend-decode disabled", "(stopped before the capture)"]),
])
def test_wrong_server_settings_stop_the_launch_with_one_line(qwen3, mode, args, named):
    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.validate.engine_level import run_engine_level
    from tests.conftest import sglang_python

    model, bundle = qwen3
    result = run_engine_level(bundle, read_manifest(bundle), "sglang", mode, str(model), python=sglang_python(),
                              engine_args=args)
    assert result["status"] == "failed", result
    line = result["error"]
    assert line.startswith(f"kvzap-export: KVzap ({mode} mode) cannot run on this SGLang server: ") and "\n" not in line
    assert all(text in line for text in named), line


@pytest.mark.parametrize("mode, prefill, expected", [
    ("ragged", None, "disabled"),  # SGLang's default on CUDA (breakable): ragged mode turns it off itself, one line
    ("ragged", "breakable", "breakable"),  # asked for: left alone (the launch check above refuses it in one line)
    ("evict", None, "breakable"),  # the masking modes leave SGLang's resolution alone (their launch check refuses)
])
def test_ragged_mode_turns_sglangs_default_prefill_graphs_off_in_its_argument_resolution(qwen3, mode, prefill, expected):
    """SGLang's own argument resolution, with CUDA's default graph settings on this CPU machine and the plugin loaded
    through its entry point: a default ragged launch resolves to prefill graphs off (with one log line) and decode
    graphs as SGLang sets them; without KVzap's hook (the test's other cases) SGLang's breakable default stays."""
    import subprocess
    from pathlib import Path

    from tests.conftest import sglang_python

    model, bundle = qwen3
    script = Path(__file__).with_name("graph_defaults_script.py")
    done = subprocess.run([sglang_python(), str(script), str(bundle), str(model), mode] + ([prefill] if prefill else []),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["prefill"] == expected and out["decode"] == "full", out
    assert out["autotune_hooked"] == (mode == "ragged"), out  # server_setup.autotune_hook, in base_runner's binding
    turned_off = [line for line in out["log"] if "prefill CUDA graphs off" in line]
    assert len(turned_off) == (1 if expected == "disabled" else 0), out["log"]
    # at warning: the driver launches SGLang with log_level="warning", and a user should see why graphs are off
    assert all(line.startswith("WARNING:") for line in turned_off), turned_off


def test_a_wrong_plugin_setting_stops_the_engine_before_it_serves(qwen3, tmp_path):
    model, bundle = qwen3
    spec = {"model": str(model), "bundle": str(bundle), "mode": "drop", "prompts": [{"text": "hi"}], "runs": ["off"],
            "max_new_tokens": 1}
    done = run_driver(tmp_path, spec, timeout=600)
    assert done.returncode != 0 and not (tmp_path / "out.json").exists()
    ours = [line for line in done.stderr.splitlines() if line.startswith("kvzap-export:")]
    assert ours == ["kvzap-export: KVZAP_MODE='drop' is not supported; use one of ['evict', 'mask', 'ragged']"], done.stderr[-2000:]
