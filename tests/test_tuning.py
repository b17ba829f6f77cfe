"""Private selection: its ε is the RepeatAndSelect composition computed independently, and the
chosen candidate follows the mechanism's law."""

from __future__ import annotations

import json
import math
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

from fedpers.privacy import selection
from fedpers.sweeps import tuning
from fedpers.sweeps.run import load_spec

ORDERS = np.array(rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=np.float64)


def independent_epsilon(trial_z: list[float], final_z: list[float], mean: float, shape: float, delta: float) -> float:
    """Papernot & Steinke 2022, Theorem 2, by hand: replace-one Gaussians have RDP
    ε(λ) = λ·Σ(2/z)²/2; the search has ε(λ) + (1+η)·min_λ̂[(1−1/λ̂)ε(λ̂) + log(1/γ)/λ̂] + log(mean)/(λ−1)
    (then made monotone in λ); the final run's RDP adds; dp-accounting converts RDP to (ε, δ)."""
    rho_trial = sum(2.0 / z**2 for z in trial_z)
    rho_final = sum(2.0 / z**2 for z in final_z)
    rdp = ORDERS * rho_trial
    gamma = selection.tnb_gamma(mean, shape)
    c = (1 + shape) * np.min((1 - 1 / ORDERS) * rdp + math.log(1 / gamma) / ORDERS)
    out = np.where(ORDERS > 1, rdp + math.log(mean) / (ORDERS - 1) + c, np.inf)
    out = np.array([out[ORDERS >= a].min() for a in ORDERS])
    return float(rdp_privacy_accountant.compute_epsilon(ORDERS, out + ORDERS * rho_final, delta)[0])


@pytest.mark.parametrize("shape, mean", [(1.0, 8.0), (0.5, 4.0), (0.0, 6.0), (2.0, 10.0)])
def test_tuning_epsilon_equals_an_independent_composition(shape, mean):
    trial = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z) for z in (3.0, 3.0, 3.0, 5.0)])
    final = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(3.0)] * 3)
    got = tuning.rdp_epsilon(tuning.tuning_event([trial, trial], final, mean, shape), 1e-5)
    want = independent_epsilon([3.0, 3.0, 3.0, 5.0], [3.0] * 3, mean, shape, 1e-5)
    assert got == pytest.approx(want, rel=1e-6)
    alone = tuning.rdp_epsilon(final, 1e-5)
    assert got > alone  # the search costs something


@pytest.mark.slow
def test_private_select_reports_the_composition_of_its_own_ledgers(tmp_path: Path):
    """End to end on a 2-point grid: every trial is the candidate's 3 releases per user plus its
    score (4 Gaussians of the candidate's z), the final run 3; epsilon_total must equal the
    independent formula for those z, and exceed the naive (final run only) ε."""
    spec_file = tmp_path / "grid.toml"
    spec_file.write_text(
        'algorithm = "altmin"\nx = "clip_model"\nseries = "rank"\nmetrics = ["excess_risk"]\n'
        '[base]\nn_users = 300\nepsilon = 4.0\nbaselines = "none"\n[grid]\nclip_model = [0.5, 1.0]\n'
    )
    spec = load_spec(spec_file)
    result = tuning.private_select(
        spec, "validation_mse", tuning.Goal.MIN, mean=3.0, validation_users=50, seed=2, out=tmp_path / "t"
    )
    from fedpers import config as config_lib
    from fedpers.experiments import experiment

    exp = experiment("altmin")
    z = exp.protocol(config_lib.build(exp.config_type, {**spec.base, "clip_model": 0.5})).noise_multiplier
    want = independent_epsilon([z] * 4, [z] * 3, 3.0, 1.0, 1e-5)
    assert result["epsilon_total"] == pytest.approx(want, rel=1e-6)
    assert result["epsilon_naive"] == pytest.approx(4.0, rel=1e-3) and result["epsilon_total"] > result["epsilon_naive"]
    assert len(result["trials"]) == result["repetitions"] >= 1
    assert "NOT for deployment" in result["noise_source"]  # seeded by default, and said so
    assert result["selected"] in [{"clip_model": 0.5}, {"clip_model": 1.0}]
    with pytest.raises(ValueError, match="private score of altmin: validation_mse"):
        tuning.private_select(spec, "excess_risk", tuning.Goal.MIN, out=tmp_path / "u")


@pytest.mark.parametrize("shape", [1.0, 0.5])
def test_selected_candidate_follows_the_mechanisms_law(shape):
    """Fixed scores s_0..s_4 (distinct): the best of K ~ TNB uniform draws has rank r with
    probability E[((m−r+1)/m)^K] − E[((m−r)/m)^K]; a chi-square test over 6000 selections
    (p > 1e-3 fails a correct sampler one time in a thousand), and K's mean within 5 s.e."""
    scores = [0.3, 0.1, 0.5, 0.2, 0.4]  # rank 1 (best, min) is candidate 1
    m, mean, n = len(scores), 4.0, 6000
    gen = torch.Generator().manual_seed(11)
    picks, ks = np.zeros(m, dtype=int), []
    for _ in range(n):
        trials, best = tuning.repeat_and_select(
            gen, m, mean, shape, tuning.Goal.MIN, lambda t, j: {"score": scores[j], "point": j}
        )
        picks[best["point"]] += 1
        ks.append(len(trials))
    rank_of = {j: r for r, j in enumerate(np.argsort(scores), start=1)}
    law = np.array(
        [
            selection.tnb_pgf((m - rank_of[j] + 1) / m, mean, shape)
            - selection.tnb_pgf((m - rank_of[j]) / m, mean, shape)
            for j in range(m)
        ]
    )
    assert law.sum() == pytest.approx(1.0)
    assert stats.chisquare(picks, law * n).pvalue > 1e-3
    assert abs(np.mean(ks) - mean) < 5 * np.std(ks) / math.sqrt(n)


def test_tnb_pmf_sums_to_one_with_the_requested_mean():
    k = np.arange(1, 20000)
    for shape in (0.0, 0.5, 1.0, 3.0):
        p = selection.tnb_pmf(k, 7.0, shape)
        assert p.sum() == pytest.approx(1.0, abs=1e-9) and (k * p).sum() == pytest.approx(7.0, rel=1e-6)


def test_nonprivate_select_says_it_is_not_accounted(tmp_path: Path):
    import json

    (tmp_path / "points").mkdir()
    for i, (v, c) in enumerate([(0.3, 0.5), (0.1, 1.0)]):
        (tmp_path / "points" / f"{i:05d}.json").write_text(
            json.dumps({"overrides": {"clip_model": c}, "rows": [{"excess_risk": v}]})
        )
    out = tuning.select_nonprivate(tmp_path, "excess_risk", tuning.Goal.MIN)
    assert out["selected"] == {"clip_model": 1.0} and not out["private"] and "NOT accounted" in out["note"]
    assert tuning.select_nonprivate(tmp_path, "excess_risk", tuning.Goal.MAX)["selected"] == {"clip_model": 0.5}
    # a reference line (e.g. the non-private run) is never a candidate, however good its metric
    (tmp_path / "points" / "00002.json").write_text(
        json.dumps({"label": "np", "overrides": {"epsilon": "inf"}, "rows": [{"excess_risk": 0.0}]})
    )
    (tmp_path / "spec.json").write_text(json.dumps({"references": {"np": {"epsilon": "inf"}}}))
    assert tuning.select_nonprivate(tmp_path, "excess_risk", tuning.Goal.MIN)["selected"] == {"clip_model": 1.0}
    spec = tmp_path / "s.toml"
    spec.write_text(
        'algorithm = "altmin"\nx = "epsilon"\nseries = "dim"\nmetrics = ["subspace_error"]\n[grid]\nepsilon = [1.0, 2.0]\n[references]\nnp = { epsilon = inf }\n'
    )
    loaded = load_spec(spec)
    assert [o for _, o in loaded.grid_points()] == [{"epsilon": 1.0}, {"epsilon": 2.0}]
    assert loaded.points()[-1] == ("np", {"epsilon": math.inf})


def test_cli_private_needs_a_metric(tmp_path: Path, capsys):
    from fedpers.commands.cli import main

    spec_file = tmp_path / "grid.toml"
    spec_file.write_text(
        'algorithm = "altmin"\nx = "clip_model"\nseries = "rank"\nmetrics = ["excess_risk"]\n[grid]\nclip_model = [0.5]\n'
    )
    assert main(["sweep", str(spec_file), "--private", "--out", str(tmp_path / "o")]) == 2
    assert "--private needs --select METRIC" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything ran or was written


def test_private_select_with_secure_noise_draws_everything_from_os_entropy(tmp_path: Path, monkeypatch):
    """``secure_noise``: the tuner (number of trials, candidates), every trial's privatizer and the
    final run draw from OS entropy, and the result says so (the seeded default says it is seeded:
    the test above)."""
    from fedpers.privacy import Privatizer

    made: list[bool] = []

    class Recording(Privatizer):
        def __init__(self, seed, ledger=None, *, secure=False):
            made.append(secure)
            super().__init__(seed, ledger, secure=secure)

    monkeypatch.setattr(tuning, "Privatizer", Recording)
    # the trials' accounting is tested above; here only where the draws come from
    monkeypatch.setattr(
        tuning, "worst_event", lambda ledger, delta: dp_accounting.ComposedDpEvent([r.event for r in ledger])
    )
    spec_file = tmp_path / "grid.toml"
    spec_file.write_text(
        'algorithm = "altmin"\nx = "clip_model"\nseries = "rank"\nmetrics = ["excess_risk"]\n'
        '[base]\nn_users = 100\nepsilon = 4.0\nbaselines = "none"\n[grid]\nclip_model = [1.0]\n'
    )
    spec = load_spec(spec_file)
    result = tuning.private_select(
        spec,
        "validation_mse",
        tuning.Goal.MIN,
        mean=1.5,
        validation_users=20,
        seed=2,
        out=tmp_path / "s",
        secure_noise=True,
    )
    assert made == [True] * (1 + result["repetitions"]) and "OS entropy" in result["noise_source"]
    final = json.loads((tmp_path / "s" / "final" / "config.json").read_text())
    assert final["runtime"]["secure_noise"] is True
    assert "OS entropy" in tuning.format_selection(result, "validation_mse")
