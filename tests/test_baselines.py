"""The non-private baseline is a competent non-private AltMin: never worse than the private run."""

from __future__ import annotations

import math

import pytest
import torch

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.runner import execute

EXP = EXPERIMENTS["altmin"]


def run(values: dict) -> dict:
    return execute(EXP, config.build(EXP.config_type, values), write=False, progress=False)


@pytest.mark.parametrize(
    "values",
    [
        dict(
            n_users=4000, dim=10, rank=2, samples_per_user=4, epsilon=8.0, seed=1
        ),  # |Q1| = 1: the old baseline's worst case
        dict(n_users=4000, dim=20, rank=2, samples_per_user=12, epsilon=8.0, delta=1e-6, seed=11),
        dict(n_users=3000, dim=8, rank=3, samples_per_user=8, epsilon=2.0, cohorts="all", seed=2),
    ],
)
def test_nonprivate_altmin_is_never_worse_than_the_private_run(values):
    result = run({**values, "baselines": "nonprivate_altmin,clipped_no_noise,oracle"})
    nonprivate, clipped, oracle = (result["baselines"][k] for k in ("nonprivate_altmin", "clipped_no_noise", "oracle"))
    # With m = 4 every row's final solve has 2 samples in k = 2 dimensions: its variance swamps
    # the excess risk, so there only the subspace is compared.
    metrics = ("subspace_error", "excess_risk") if values["samples_per_user"] >= 8 else ("subspace_error",)
    for metric in metrics:
        assert nonprivate[metric] <= result[metric], (metric, nonprivate[metric], result[metric])
    # Clipping without noise is not private either: only its subspace is compared (near U*, the
    # excess risks of two good subspaces differ by the final solves' noise).
    assert nonprivate["subspace_error"] <= clipped["subspace_error"]
    assert oracle["subspace_error"] <= nonprivate["subspace_error"]
    assert result["baselines_skipped"] == ["local_only", "private_init_only"]


def test_baselines_none_runs_none_and_says_so():
    result = run(dict(n_users=500, dim=5, rank=2, samples_per_user=8, baselines="none"))
    assert result["baselines"] == {} and len(result["baselines_skipped"]) == 5
    with pytest.raises(ValueError, match="baselines: unknown"):
        config.build(EXP.config_type, {"baselines": "nonprivate"})


@pytest.mark.slow
def test_the_reported_defect_is_gone():
    """The issue's command: the old baseline's subspace error was 0.221 against the private 0.038."""
    result = run(
        dict(
            n_users=64000,
            epsilon=8.0,
            dim=20,
            rank=2,
            samples_per_user=12,
            noise_std=0.1,
            delta=1e-6,
            rounds=2,
            seed=11,
            baselines="nonprivate_altmin",
        )
    )
    assert result["baselines"]["nonprivate_altmin"]["subspace_error"] < 0.5 * result["subspace_error"]


def _reference(values: dict, float64: bool = False, **kw):
    """The non-private AltMin on ``values``' users (``float64``: the same users cast to float64):
    (U, rounds, U*) from altmin_baselines directly."""
    from fedpers.data.units import UnitSource
    from fedpers.experiments import altmin as am
    from fedpers.experiments.common.lowrank_baselines import nonprivate_altmin

    cfg = am.resolve(config.build(EXP.config_type, values))
    source = am.unit_source(cfg)
    if float64:
        load = source.load
        source = UnitSource(
            source.num_units,
            lambda a, b: {k: v.double() if v.is_floating_point() else v for k, v in load(a, b).items()},
        )
    U, rounds = nonprivate_altmin(source, cfg.rank, cfg.chunk_size, **kw)
    return U, rounds, am.truth(cfg).double()


STOP = dict(n_users=6000, dim=20, rank=3, samples_per_user=12, seed=4)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_statistical_stopping_rule_keeps_the_30_round_reference(monkeypatch, statistical_errors, dtype):
    """Stopped at half of its statistical error (PRECISION), with products in the users' dtype, the
    reference is the 30-round one computed in float64 on the same users within that: ‖P − P₃₀‖_F ≤
    PRECISION × its last standard error, its subspace error within 1%, in fewer rounds than the old
    10⁻⁶ rule."""
    import fedpers.experiments.common.lowrank_baselines as baselines
    from fedpers.metrics import subspace_error

    U, rounds, u_star = _reference({**STOP, "dtype": dtype})
    se, precision = statistical_errors[-1], baselines.PRECISION
    monkeypatch.setattr(baselines, "TOLERANCE", 1e-6)
    monkeypatch.setattr(baselines, "PRECISION", 0.0)
    U_old, rounds_old, _ = _reference({**STOP, "dtype": dtype}, float64=True)
    monkeypatch.setattr(baselines, "TOLERANCE", 0.0)
    U_30, rounds_30, _ = _reference({**STOP, "dtype": dtype}, float64=True)
    assert rounds_30 == 30 and rounds < rounds_old
    err, err_30 = subspace_error(U, u_star), subspace_error(U_30, u_star)
    assert abs(err - err_30) <= 0.01 * err_30, (err, err_30)
    assert float((U @ U.T - U_30 @ U_30.T).norm()) <= precision * se


def test_the_statistical_error_estimate_matches_the_actual_error(statistical_errors):
    """The stopping rule's yardstick: the U step's standard error is within a factor 2 of the fixed
    point's actual distance to U* (a lower bound by construction, so not far below it)."""
    from fedpers.metrics import subspace_error

    U, _, u_star = _reference(STOP)
    seen = statistical_errors
    assert seen and 0.5 <= seen[-1] / subspace_error(U, u_star) <= 2.0, (seen, subspace_error(U, u_star))


def test_the_local_only_dual_ridge_equals_the_primal():
    """m < d: θ = Xᵀ(XXᵀ + λI)⁻¹y is the d-dimensional ridge's θ (float64, same λ); a user with a NaN gets NaN."""
    from fedpers import linalg
    from fedpers.experiments.common.lowrank_baselines import local_ridge

    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 12, 30, generator=g, dtype=torch.float64)
    x[1, 6:] = x[1, :6]  # repeated samples: X Xᵀ singular, λ keeps it solvable
    x[2] = 0.0
    x[3] *= 1e3
    y = torch.randn(50, 12, generator=g, dtype=torch.float64)
    y[4, 0] = math.nan
    for ridge in (1e-6, 1e-2):
        dual, primal = local_ridge(x, y, ridge), linalg.batched_ridge_solve(x, y, ridge)
        ok = torch.ones(50, dtype=torch.bool)
        ok[4] = False
        torch.testing.assert_close(dual[ok], primal[ok], rtol=1e-7, atol=1e-9)
        assert dual[4].isnan().all() and dual[2].abs().max() == 0
    x_tall, y_tall = (
        torch.randn(20, 40, 30, generator=g),
        torch.randn(20, 40, generator=g),
    )  # m ≥ d: the primal, in float64
    torch.testing.assert_close(
        local_ridge(x_tall, y_tall, 1e-6), linalg.batched_ridge_solve(x_tall.double(), y_tall.double(), 1e-6)
    )


def test_the_scores_sums_are_the_plain_float64_formulas_bit_for_bit():
    """Scores' excess-risk and test sums equal Σ((θ.double() − θ*)²) and Σ((x_test θ − y_test)²) in
    float64, chunk by chunk, to the bit, for float32 and float64 fits and a fit returning (n, d, 1)."""
    from types import SimpleNamespace
    from typing import cast

    from fedpers.experiments.altmin import AltMinEvaluator, Scores

    g = torch.Generator().manual_seed(5)
    d, k, t = 30, 3, 4
    u_star = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0]
    w32 = torch.randn(d, generator=g)
    w64 = torch.randn(d, generator=g, dtype=torch.float64)
    fits = {
        "f32": (lambda u: u["v_star"].float() @ u_star.float().T + w32, None),
        "f64": (lambda u: (u["v_star"] @ u_star.T + w64).unsqueeze(-1), None),
    }
    evaluator = SimpleNamespace(u_star=u_star, cfg=SimpleNamespace(noise_std=0.5))
    scores = Scores(cast(AltMinEvaluator, evaluator), fits)  # only u_star and cfg.noise_std are read
    plain = {name: [0.0, 0.0] for name in fits}
    for n in (700, 300):
        units = {
            "ids": torch.arange(n),
            "v_star": torch.randn(n, k, generator=g, dtype=torch.float64),
            "x_test": torch.randn(n, t, d, generator=g),
            "y_test": torch.randn(n, t, generator=g),
        }
        scores.add(units)
        theta_star = units["v_star"] @ u_star.T
        for name, (fit, _) in fits.items():
            theta = fit(units).double().reshape(n, d)
            plain[name][0] += float(((theta - theta_star) ** 2).sum())
            pred = (units["x_test"].double() @ theta.unsqueeze(-1)).squeeze(-1)
            plain[name][1] += float(((pred - units["y_test"].double()) ** 2).sum())
    result = scores.result()
    for name, (excess, test) in plain.items():
        assert scores.sums[name] == {"excess": excess, "test": test}, name
        assert result[name]["excess_risk"] == excess / 1000 and result[name]["test_mse"] == test / (1000 * t)


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_every_algorithm_takes_baselines_as_all_none_or_a_list(name):
    """One convention: ``--baselines`` is a string (all | none | names), default all, naming each
    baseline the algorithm can run in its help; an unknown name is refused with the field named."""
    import dataclasses
    import sys

    exp = EXPERIMENTS[name]
    selectable = sys.modules[exp.config_type.__module__].BASELINES
    f = {f.name: f for f in dataclasses.fields(exp.config_type)}["baselines"]
    assert f.default == "all" and f.type in (str, "str")
    assert f.metadata["help"].startswith("baselines") and all(b in f.metadata["help"] for b in selectable)
    config.build(exp.config_type, {"baselines": "none"})
    with pytest.raises(ValueError, match="baselines"):
        config.build(exp.config_type, {"baselines": "no_such_baseline"})


@pytest.mark.parametrize(
    ("name", "values"),
    [
        ("noisygd", dict(examples=60, classes=3, feature_dim=5, steps=3, test_examples=20)),
        ("noisyhead", dict(prompts=240, dim=3, steps=3, chunk_size=50)),
        ("dpattention", dict()),
    ],
)
def test_baselines_none_runs_none_and_names_each_skipped(name, values):
    exp = EXPERIMENTS[name]
    result = execute(exp, config.build(exp.config_type, {**values, "baselines": "none"}), write=False, progress=False)
    assert result["baselines"] == {} and result["baselines_skipped"] == list(exp.baseline_names)
    full = execute(exp, config.build(exp.config_type, values), write=False, progress=False)
    assert set(full["baselines"]) == set(exp.baseline_names) and full["baselines_skipped"] == []
    assert full["epsilon"] == result["epsilon"]  # the baselines spend nothing
