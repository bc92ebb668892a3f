"""parity.md / parity.json: verdict first, what did not run, and the optional parts not written with their install line."""

import json
import sys

from kvzap_export.validate.run import validate_bundle


def test_optional_parts_not_written_are_named_with_the_install_line(bundle, monkeypatch):
    for name in ("polygraphy", "polygraphy.comparator", "polygraphy.json", "polygraphy.logger"):
        monkeypatch.setitem(sys.modules, name, None)  # as if the polygraphy extra were not installed
    report = validate_bundle(bundle, model_level=False)
    assert report["polygraphy"] == [] and not (bundle / "report" / "polygraphy").exists()
    assert {"part": "report/polygraphy/", "why": "Polygraphy replay files need polygraphy, which is not installed",
            "install": "pip install 'kvzap-export[polygraphy]'"} in report["not_written"]
    md = (bundle / "report" / "parity.md").read_text()
    head = md.split("## ")[0]
    assert "Optional parts not written:" in head and "`report/polygraphy/`" in head and "kvzap-export[polygraphy]" in head
    assert json.loads((bundle / "report" / "parity.json").read_text())["not_written"] == report["not_written"]


def test_everything_written_names_nothing(bundle):
    report = validate_bundle(bundle, model_level=False)
    assert report["not_written"] == [] and "Optional parts not written" not in (bundle / "report" / "parity.md").read_text()


def _layer(index: int, status: str, **detail) -> dict:
    return {"name": f"operator:surrogate_layer_{index:03d}", "level": "operator", "status": status, "detail": detail}


def _markdown_of(checks: list[dict]) -> str:
    from kvzap_export.validate.report import _markdown

    return _markdown({"verdict": "incomplete", "checks": checks, "bundle": "b", "backends": ["onnxrt"], "device": "cpu"})


def test_the_surrogate_layers_row_aggregates_every_layer():
    """Layer 0 passed, layer 1 did not run: the row is not a ✓ (it used to show layer 0's status for all layers)."""
    mixed = _markdown_of([_layer(0, "passed", max_abs_error=1e-6, hidden_states="real"),
                          _layer(1, "skipped", reason="no ONNX Runtime session")])
    row = next(line for line in mixed.splitlines() if "surrogate layers (2)" in line)
    assert row.startswith("- – ") and "1 ran" in row and "did not run: operator:surrogate_layer_001" in row
    assert "no ONNX Runtime session" in row
    every = _markdown_of([_layer(i, "passed", max_abs_error=i * 1e-6) for i in range(3)])
    assert "- ✓ surrogate layers (3) vs PyTorch: 3 ran, max abs error 2.00e-06" in every
    broken = _markdown_of([_layer(0, "skipped", reason="r"), _layer(1, "failed", max_abs_error=1.0)])
    assert "- ✗ surrogate layers (2)" in broken and "failed: operator:surrogate_layer_001" in broken
