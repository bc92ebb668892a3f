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
