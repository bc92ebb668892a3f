"""``validate`` on good and deliberately broken bundles: failures are caught and named; the verdict has three
states and a check that did not run is never a pass."""

import json

import numpy as np
import onnx
import pytest

from kvzap_export.cli.main import main
from kvzap_export.validate.run import validate_bundle


def _failed(report):
    return set(report["failed"])


def test_bundle_without_model_is_incomplete_never_passed(bundle, capsys):
    assert main(["validate", str(bundle), "--quiet"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("incomplete: ") and err.count("\n") == 1 and "model:compacted_vs_kvpress" in err
    report = json.loads((bundle / "report" / "parity.json").read_text())
    assert report["verdict"] == "incomplete" and report["passed"] is False and report["failed"] == []
    assert [n["check"] for n in report["not_run"]] == ["model:compacted_vs_kvpress"]
    md = (bundle / "report" / "parity.md").read_text()
    assert md.startswith("# Parity report: INCOMPLETE") and "PASSED" not in md
    assert "Did not run:" in md.split("## ")[0] and "no local model" in md.split("## ")[0]
    assert "polygraphy run onnx/surrogate_layer_000.onnx --trt" in md
    assert (bundle / "report" / "polygraphy" / "layer_000_inputs.json").is_file()
    layer_checks = [c for c in report["checks"] if c["name"].startswith("operator:surrogate_layer_")]
    assert len(layer_checks) == 3 and all(c["detail"]["backends"] == ["onnxrt"] for c in layer_checks)
    assert all(1 in c["detail"]["token_counts"] for c in layer_checks)  # includes a shape unlike the export's


def test_operator_checks_name_the_providers_that_ran(bundle):
    report = validate_bundle(bundle, model_level=False)
    layer = next(c for c in report["checks"] if c["name"] == "operator:surrogate_layer_000")
    assert layer["detail"]["onnxruntime_providers"] == {"onnxrt": ["CPUExecutionProvider"]}
    move = next(c for c in report["checks"] if c["name"] == "operator:kv_compaction")
    assert move["detail"]["onnxruntime_providers"] == ["CPUExecutionProvider"]


def test_decisions_run_on_synthetic_states_without_a_model(bundle):
    report = validate_bundle(bundle, model_level=False)
    decision = next(c for c in report["checks"] if c["name"] == "decision:keep_masks")
    detail = decision["detail"]
    assert decision["status"] == "passed" and detail["hidden_states"] == "synthetic" and "RMS" in detail["hidden_states_how"]
    assert detail["sequences"] >= 2 and detail["tokens"] >= 2000
    # 3 layers x 2 heads; only positions before the window (128) can be evicted, so only they can flip
    assert detail["decisions"] == 3 * 2 * detail["tokens"]
    assert detail["decisions_outside_window"] == 3 * 2 * (detail["tokens"] - detail["sequences"] * 128)
    assert 0 < detail["pruned_fraction"] < 1 and detail["unexplained_flips"] == 0
    assert detail["explained_flip_budget"] == int(0.01 * detail["decisions_outside_window"])
    assert report["verdict"] == "incomplete"  # --no-model-level: that level did not run


def test_the_plugin_node_in_ort_computes_the_rule_itself(bundle):
    """The plugin node's ORT kernel (runners.compaction_spec) is written from the specification with NumPy alone (it
    imports nothing of this package nor torch), agrees with the reference exactly in float32 and float16 (ties at
    τ, a τ float16 cannot hold, NaN, padding, sink), and the report calls the check exact (the kernel used to call
    kvzap_export.ops.threshold_compaction: the reference compared with itself, as a 'contract')."""
    import ast
    import inspect

    import numpy as np
    import torch

    from kvzap_export.ops import threshold_compaction
    from kvzap_export.runners import compaction_spec

    tree = ast.parse(inspect.getsource(compaction_spec))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"numpy", "__future__"}
    for dtype, tau in ((np.float32, 0.1), (np.float16, 0.1), (np.float16, -4.0)):
        scores = np.random.default_rng(0).normal(size=(3, 2, 60)).astype(dtype)
        scores[0, 1, 3] = np.nan
        scores[1, 0, 5:9] = dtype(tau)  # ties: strict < keeps them
        lengths = np.array([60, 17, 0], np.int32)
        for window, sink in ((8, 0), (0, 2), (100, 0)):
            got = compaction_spec.threshold_compaction_by_spec(scores, lengths, tau, window, sink)
            want = threshold_compaction(torch.from_numpy(scores), torch.from_numpy(lengths), tau, window, sink)
            for name, array in zip(("keep", "counts", "indices"), got):
                assert np.array_equal(array, getattr(want, name).numpy()), (dtype, tau, window, sink, name)
    report = validate_bundle(bundle, model_level=False)
    plugin = next(c for c in report["checks"] if c["name"] == "operator:threshold_compaction_plugin")
    assert plugin["status"] == "passed" and plugin["detail"]["comparison"] == "exact"
    md = (bundle / "report" / "parity.md").read_text()
    assert "operator:threshold_compaction_plugin: onnxrt: exact comparison with the reference" in md and "contract" not in md


def test_require_turns_a_level_that_did_not_run_into_a_failure(bundle, capsys):
    assert main(["validate", str(bundle), "--quiet", "--require", "operator,decision"]) == 3
    assert main(["validate", str(bundle), "--quiet", "--require", "model"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: validation failed: required:model")
    report = json.loads((bundle / "report" / "parity.json").read_text())
    assert report["verdict"] == "failed" and report["failed"] == ["required:model"]
    assert main(["validate", str(bundle), "--require", "everything"]) == 2


@pytest.mark.parametrize("state, code", [("passed", 0), ("failed", 1), ("incomplete", 3)])
def test_exit_code_per_verdict(bundle, monkeypatch, capsys, state, code):
    import kvzap_export.validate.run as run

    report = {"verdict": state, "passed": state == "passed", "failed": ["x"] if state == "failed" else [],
              "not_run": [{"check": "y", "level": "model", "reason": "r"}] if state == "incomplete" else []}
    monkeypatch.setattr(run, "validate_bundle", lambda *a, **k: report)
    assert main(["validate", str(bundle), "--quiet"]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == (0 if state == "passed" else 1)


def test_verdict_of_checks():
    from kvzap_export.validate.checks import Check, verdict

    ok, bad, absent = Check("a", "operator", "passed"), Check("b", "decision", "failed"), Check("c", "model", "skipped")
    assert verdict([ok]) == "passed" and not absent.passed
    assert verdict([ok, absent]) == "incomplete" and verdict([]) == "incomplete"
    assert verdict([ok, absent, bad]) == "failed"


def test_edited_weights_fail(bundle, capsys):
    path = bundle / "onnx" / "surrogate_layer_001.onnx"
    model = onnx.load(str(path))
    init = next(i for i in model.graph.initializer if i.name == "2.bias")
    values = np.frombuffer(init.raw_data, dtype=np.float32).copy()
    values[0] += 0.5
    init.raw_data = values.tobytes()
    onnx.save(model, str(path))
    report = validate_bundle(bundle)
    assert "operator:surrogate_layer_001" in _failed(report)
    assert "operator:surrogate_layer_000" not in _failed(report)
    assert main(["validate", str(bundle), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "operator:surrogate_layer_001" in err and err.count("\n") == 1


def test_edited_surrogate_copy_fails(bundle):
    from safetensors.torch import load_file, save_file

    path = bundle / "surrogate" / "model.safetensors"
    state = load_file(str(path))
    state["layers.2.0.weight"] *= 1.01
    save_file(state, str(path))
    assert "operator:surrogate_layer_002" in _failed(validate_bundle(bundle))


def test_wrong_threshold_in_manifest_fails(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["pruning"]["threshold"] = 3.0
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    report = validate_bundle(bundle)
    assert "bundle:manifest_integrity" in _failed(report)
    check = next(c for c in report["checks"] if c["name"] == "bundle:manifest_integrity")
    assert any("'pruning'" in p for p in check["detail"]["problems"])


def test_the_bundle_check_reads_the_files_as_written(bundle):
    """A file no other check reads (rebuild.sh), edited after export: the bundle check re-hashes it from disk and
    fails (it used to compare the manifest's section digests only, and pass). Inside the main command too."""
    written = json.loads((bundle / "report" / "parity.json").read_text())  # the main command's own report
    inside = next(c for c in written["checks"] if c["name"] == "bundle:manifest_integrity")
    assert inside["status"] == "passed" and inside["detail"]["files_rehashed"] >= 8
    report = validate_bundle(bundle, model_level=False)
    check = next(c for c in report["checks"] if c["name"] == "bundle:manifest_integrity")
    listed = json.loads((bundle / "manifest.json").read_text())["files"]
    assert check["status"] == "passed" and check["detail"]["files_rehashed"] == len(listed) and "rebuild.sh" in listed
    with open(bundle / "rebuild.sh", "a") as handle:
        handle.write("echo edited\n")
    report = validate_bundle(bundle, model_level=False)
    assert _failed(report) == {"bundle:manifest_integrity"}
    check = next(c for c in report["checks"] if c["name"] == "bundle:manifest_integrity")
    assert check["detail"]["problems"] == ["rebuild.sh: sha256 mismatch (file changed after export)"]


def test_swapped_layer_files_fail(bundle):
    a, b = bundle / "onnx" / "surrogate_layer_000.onnx", bundle / "onnx" / "surrogate_layer_002.onnx"
    data_a = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data_a)
    assert {"operator:surrogate_layer_000", "operator:surrogate_layer_002"} <= _failed(validate_bundle(bundle))


def test_unknown_backend_is_a_user_error(bundle, capsys):
    assert main(["validate", str(bundle), "--backends", "torch,tensorflow"]) == 2
    assert "tensorflow" in capsys.readouterr().err


def test_json_output_is_the_report(bundle, capsys):
    assert main(["validate", str(bundle), "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "incomplete" and {c["level"] for c in report["checks"]} >= {"bundle", "operator", "decision", "model"}


def test_device_cuda_without_a_gpu_is_one_line(bundle, capsys):
    assert main(["validate", str(bundle), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA GPU" in err
