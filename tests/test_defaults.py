"""Every algorithm's defaults, at reduced size, beat their trivial baselines or say so loudly
(result["warnings"], one per baseline not beaten, naming it and the flags to change)."""

from __future__ import annotations

import io
import json
import math

import pytest

from fedpers import config as config_lib
from fedpers.commands.cli import main, print_summary
from fedpers.experiments import ALGORITHMS, experiment
from fedpers.experiments.base import Trivial, check_trivial, trivial_value
from fedpers.runner import execute


def reduced(name: str) -> dict:
    """The experiment's own small config for quick runs (its ``reduced_config`` hook)."""
    return experiment(name).reduced_config()


def test_every_algorithm_has_a_reduced_default_and_a_trivial_baseline():
    for name in ALGORITHMS:
        exp = experiment(name)
        assert exp.reduced_config(), name
        assert exp.trivial_baselines(config_lib.build(exp.config_type, {})), name


MARGIN = 0.05
"""A default must beat each trivial baseline by at least 5% of the baseline's value."""


def _beats_every_trivial_baseline(name: str, values: dict) -> None:
    exp = experiment(name)
    cfg = config_lib.build(exp.config_type, values)
    result = execute(exp, cfg, write=False, progress=False)
    trivial = exp.trivial_baselines(cfg)
    measured = [
        t for t in trivial if trivial_value(result, t) is not None and isinstance(result.get(t.metric), (int, float))
    ]
    assert len(measured) == len(trivial), f"{name}: a declared trivial baseline was not measured"
    for t in measured:
        value, base = float(result[t.metric]), trivial_value(result, t)
        assert base is not None
        beats = value > base * (1 + MARGIN) if t.higher_is_better else value < base * (1 - MARGIN)
        assert beats, (name, t.metric, value, t.baseline, base)
    assert "warnings" not in result, result["warnings"]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_reduced_defaults_beat_every_trivial_baseline(name):
    """The defaults at the experiment's reduced size already show the method working."""
    _beats_every_trivial_baseline(name, reduced(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_full_defaults_beat_every_trivial_baseline(name):
    """``fedpers run NAME`` with no flags beats every trivial baseline it declares."""
    _beats_every_trivial_baseline(name, {})


def test_every_delta_and_accountant_default_is_the_one_convention():
    """One δ rule (config.DEFAULT_DELTA) and PLD for every (ε, δ) algorithm; the pure-DP
    exponential mechanism has no δ field (its runs report δ = 0)."""
    import dataclasses

    for name in ALGORITHMS:
        fields = {f.name: f for f in dataclasses.fields(experiment(name).config_type)}
        if name == "expmech":
            assert "delta" not in fields
            continue
        assert fields["delta"].default == config_lib.DEFAULT_DELTA, name
        if "accountant" in fields:
            assert (
                str(getattr(fields["accountant"].default, "value", fields["accountant"].default))
                == config_lib.DEFAULT_ACCOUNTANT
            ), name
        if "calibration" in fields:
            assert fields["calibration"].default.value == "accountant", name


def test_check_trivial_warns_on_worse_and_ties_only():
    t = [Trivial("rmse", "global_mean", why="raise --epsilon"), Trivial("acc", "chance", higher_is_better=True)]
    good = {"rmse": 0.5, "acc": 0.9, "baselines": {"chance": {"acc": 0.1}, "global_mean": {"rmse": 1.0}}}
    assert check_trivial(t, good) == []
    bad = {"rmse": 2.0, "acc": 0.1, "baselines": {"chance": {"acc": 0.1}, "global_mean": {"rmse": 1.0}}}
    w = check_trivial(t, bad)
    assert [(x["metric"], x["baseline"]) for x in w] == [("rmse", "global_mean"), ("acc", "chance")]
    assert "worse than" in w[0]["text"] and "--epsilon" in w[0]["text"] and "no better than" in w[1]["text"]
    assert check_trivial(t, {"rmse": math.nan}) == []  # a baseline not measured is not a verdict


def test_summary_prints_the_warning_loudly():
    out = io.StringIO()
    print_summary(
        {
            "algorithm": "dpals",
            "runtime": "local",
            "status": "completed",
            "seconds": 1.0,
            "test_rmse": 5.9,
            "warnings": [
                {
                    "text": "the private test_rmse (5.9) is worse than the trivial baseline global_mean (0.98): raise --epsilon"
                }
            ],
        },
        out,
    )
    assert "!! WARNING: the private test_rmse (5.9) is worse" in out.getvalue()
    assert "spread over seeds" not in out.getvalue()  # not a comparison with a baseline
    lost = {
        "text": "the private test_rmse (5.9) is worse than the trivial baseline global_mean (0.98)",
        "metric": "test_rmse",
        "private": 5.9,
        "baseline": "global_mean",
        "baseline_value": 0.98,
    }
    out = io.StringIO()
    print_summary(
        {
            "algorithm": "dpals",
            "runtime": "local",
            "status": "completed",
            "seconds": 1.0,
            "test_rmse": 5.9,
            "warnings": [lost],
        },
        out,
    )
    assert "`fedpers sweep` with `repetitions = 5`" in out.getvalue()  # one seed cannot decide a loss


def test_dpals_reduced_default_warns_in_result_json(tmp_path, capsys):
    """Few users at ε = 1: DPALS loses to the global mean, and result.json and the output say so."""
    rc = main(["run", "dpals", "--n-users", "300", "--n-items", "30", "--out", str(tmp_path / "r"), "--quiet"])
    assert rc == 0
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    if result["test_rmse"] >= result["baselines"]["global_mean"]["test_rmse"]:
        assert result["warnings"][0]["baseline"] == "global_mean"
        assert "!! WARNING" in capsys.readouterr().out
    else:
        assert "warnings" not in result


@pytest.mark.slow
def test_dpals_full_defaults_beat_the_global_mean():
    """The default synthetic run (20,000 users, ε = 1) beats the global mean (measured 0.68 against 0.99)."""
    exp = experiment("dpals")
    result = execute(exp, config_lib.build(exp.config_type, {}), write=False, progress=False)
    assert result["test_rmse"] < 0.9 * result["baselines"]["global_mean"]["test_rmse"] and "warnings" not in result


def test_a_long_run_prints_its_estimate_from_the_first_chunk(monkeypatch, capsys):
    """Time before cost: with the threshold at 0 s any multi-chunk run states its estimate, once."""
    from fedpers.runtime import local

    monkeypatch.setattr(local, "ESTIMATE_AFTER_S", 0.0)
    exp = experiment("altmin")
    cfg = config_lib.build(exp.config_type, {"n_users": 800, "dim": 4, "chunk_size": 100, "baselines": "none"})
    execute(exp, cfg, write=False, progress=True)
    err = capsys.readouterr().err
    assert err.count("of client work") == 1
    assert "3 round(s), 16 chunk(s) of up to 100 units" in err  # 8 for the init, 4 per disjoint cohort round
    execute(exp, cfg, write=False, progress=False)  # --quiet: nothing
    assert "of client work" not in capsys.readouterr().err


def test_a_nan_metric_warns_naming_its_cause():
    exp = experiment("dpals")
    cfg = config_lib.build(exp.config_type, {})
    w = exp.result_warnings(
        cfg,
        {
            "test_rmse": math.nan,
            "baselines": {"global_mean": {"test_rmse": 1.0}},
            "test_ratings": 0,
            "train_ratings": 9,
        },
    )
    assert [x["metric"] for x in w] == ["test_rmse"]  # the NaN is named once, not also as "worse than"
    assert (
        "test_rmse is nan" in w[0]["text"] and "test_ratings = 0" in w[0]["text"] and "--test-fraction" in w[0]["text"]
    )


@pytest.mark.parametrize(
    "name,metric,baseline,higher",
    [
        ("altmin", "test_mse", "local_only", False),  # real data: no excess_risk, still compared
        ("expmech", "test_mse", "local_only", False),
        ("noisyhead", "test_mse", "zero_head", False),
        ("fedrep", "population_mse", "private_init_only", False),
        ("noisygd", "balanced_accuracy", "chance", True),
        ("dpals", "test_rmse", "global_mean", False),
        ("dpattention", "attention_error", "uniform_attention", False),
    ],
)
def test_every_metric_worse_than_a_trivial_baseline_of_the_same_metric_warns(name, metric, baseline, higher):
    exp = experiment(name)
    cfg = config_lib.build(exp.config_type, exp.reduced_config())
    good, bad = (0.9, 0.1) if higher else (0.1, 0.9)
    row = {"baselines": {baseline: {metric: 0.5}}}
    assert exp.result_warnings(cfg, {metric: good, **row}) == []
    w = exp.result_warnings(cfg, {metric: bad, **row})
    assert [(x["metric"], x["baseline"]) for x in w] == [(metric, baseline)] and "worse than" in w[0]["text"]
