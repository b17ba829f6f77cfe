"""Every view of a run names its trust model, bits, the accountant that gave its ε and the composition
(the CLI summary, result.json / ``--json``, the HTML report's lines, ``fedpers privacy`` and its JSON):
a distributed run's ε is RDP's (its Skellam releases have no PLD bound), never printed "by pld"; the
paper-calibration comparison is absent under local DP (each unit's own noise is not the paper's central
sum); a warning names the local trust model as its cause."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedpers import config
from fedpers.commands.privacy_report import privacy_report, privacy_summary
from fedpers.commands.summary import privacy_lines, summary_text
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments.altmin import AltMinConfig, AltMinExperiment
from fedpers.results.run_result import RunResult
from fedpers.runner import execute

SMALL = {"n_users": 400, "dim": 5, "rank": 2, "samples_per_user": 16, "rounds": 2, "epsilon": 2.0}


def _run(tmp_path: Path, model: str, baselines: str = "none") -> tuple[dict[str, Any], Path]:
    cfg = config.build(AltMinConfig, {**SMALL, "baselines": baselines})
    out = tmp_path / model
    opts = config.build(RuntimeOptions, {"dp_model": model, "nodes": 4} if model != "central" else {})
    return execute(AltMinExperiment(), cfg, opts, out=out, progress=False), out


@pytest.mark.parametrize("model", ["central", "distributed", "local"])
def test_every_view_names_trust_model_bits_accountant_and_composition(tmp_path, model):
    result, out = _run(tmp_path, model)
    priv = result["privacy"]
    assert priv["dp_model"] == model and priv["composition"]
    assert (priv.get("bits") is not None) == (model == "distributed")
    assert priv["accountant"] == ("rdp" if model == "distributed" else "pld")
    text = summary_text(RunResult.from_dict(result))
    assert f"trust model: {model}" in text and priv["composition"] in text
    assert ("by pld" in text) == (model != "distributed")
    if model == "distributed":
        assert f"{priv['bits']}-bit sums" in text and "by rdp" in text
    assert ("paper's calibration" in text) == (model != "local")
    lines = privacy_lines(RunResult.from_dict(result).privacy)  # the HTML report's lines
    assert any(f"trust model: {model}" in line for line in lines)
    js = privacy_summary(out)  # `fedpers privacy --json`
    assert (js["dp_model"], js["accountant"], js["composition"]) == (model, priv["accountant"], priv["composition"])
    assert js["bits"] == priv.get("bits")
    report = privacy_report(out)
    assert f"by the {priv['accountant']} accountant" in report and f"trust model: {model}" in report


def test_a_warning_names_the_local_trust_model_as_its_cause(tmp_path):
    result, _ = _run(tmp_path, "local", baselines="local_only,private_init_only")
    texts = [w["text"] for w in result.get("warnings", []) if w.get("metric")]
    assert texts and all("trust model local" in t for t in texts)
