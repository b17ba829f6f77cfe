"""population_mse (refit v_j on fresh samples with the released U, test on more) for run altmin."""

from __future__ import annotations

import pytest

from fedpers import config as config_lib
from fedpers.experiments import experiment
from fedpers.runner import execute

EXP = experiment("altmin")
BASE = {
    "n_users": 8000,
    "dim": 20,
    "rank": 2,
    "samples_per_user": 8,
    "noise_std": 0.1,
    "refit_samples": 6,
    "test_samples": 50,
    "rounds": 2,
    "baselines": "oracle",
}


def run(**kw):
    return execute(EXP, config_lib.build(EXP.config_type, {**BASE, **kw}), write=False, progress=False)


def test_oracle_population_mse_is_the_least_squares_refit_risk() -> None:
    """With U* the refit is ordinary least squares in k dimensions on R Gaussian samples:
    E[test MSE] = σ²(1 + k/(R − k − 1)) = 0.01·(1 + 2/3)."""
    oracle = run(epsilon=4.0)["baselines"]["oracle"]["population_mse"]
    assert oracle == pytest.approx(0.01 * (1 + 2 / 3), rel=0.06)


def test_population_mse_falls_as_the_released_subspace_improves() -> None:
    worse, better = run(epsilon=0.5), run(epsilon=8.0)
    assert worse["subspace_error"] > better["subspace_error"]
    assert worse["population_mse"] > better["population_mse"] > better["baselines"]["oracle"]["population_mse"]


def test_refit_and_test_samples_go_together_and_need_the_synthetic_model() -> None:
    with pytest.raises(ValueError, match="refit_samples and test_samples go together"):
        config_lib.build(EXP.config_type, {**BASE, "test_samples": 0})
    with pytest.raises(ValueError, match="draw fresh samples from the synthetic model"):
        config_lib.build(EXP.config_type, {**BASE, "data": "x.npz"})


def test_training_data_is_unchanged_by_the_population_samples() -> None:
    import torch

    cfg = config_lib.build(EXP.config_type, BASE)
    plain = config_lib.build(EXP.config_type, {**BASE, "refit_samples": 0, "test_samples": 0})
    a, b = EXP.units(cfg, torch.arange(10)), EXP.units(plain, torch.arange(10))
    assert all(torch.equal(a[k], b[k]) for k in ("x", "y"))
