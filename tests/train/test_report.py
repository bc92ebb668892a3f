"""The training report: R² per layer and head for every domain, with its roles, corpus and plot."""

import json

import torch

from kvzap_export.train.report import write_report


def test_report_has_every_domain_role_and_plot(tmp_path):
    layers, heads = 4, 3
    results = {v: {d: torch.full((layers, heads), r) for d, r in (("in-domain", 0.7), ("code", 0.72), ("legal", 0.61))}
               for v in ("linear", "mlp")}
    results["mlp"]["legal"][2] = 0.3
    meta = {"model": "m", "held_out_domains": ["legal"], "train_pairs": 10, "evaluation_pairs": {"legal": 5},
            "prompts_per_domain": {"code": {"train": 7, "evaluation": 1}, "legal": {"train": 0, "evaluation": 2}},
            "sources": [{"name": "s", "domain": "code", "title": "t", "licence": "PSF-2.0", "provider": "CPython"}],
            "command": "kvzap-export train", "fit_s": {"mlp": 1.0}}
    summary = write_report(tmp_path, results, meta)
    assert abs(summary["mlp"]["legal"] - (0.61 * 3 + 0.3) / 4) < 1e-6
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["variants"]["mlp"]["legal"]["worst_layer"] == 2
    assert len(data["variants"]["linear"]["code"]["per_layer_head"]) == layers
    md = (tmp_path / "report.md").read_text()
    assert "| legal | held out | 5 |" in md and "0.300 (layer 2)" in md and "| code | in-domain |" in md
    assert "legal h2" in md and "PSF-2.0" in md
    assert (tmp_path / "r2.png").stat().st_size > 1000
