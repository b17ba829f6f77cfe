"""Secure noise (deployment): OS entropy, floating-point-safe samplers, nothing that recomputes it."""

from __future__ import annotations

import math

import pytest
import torch

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.base import derived_seed
from fedpers.privacy import Privatizer
from fedpers.runner import RuntimeOptions, execute


def test_secure_gaussian_has_the_declared_std_and_no_seed():
    a = Privatizer(5, secure=True).gaussian_sum(
        torch.zeros(4000), per_unit_bound=2.0, noise_multiplier=1.5, name="x", round=0
    )
    b = Privatizer(5, secure=True).gaussian_sum(
        torch.zeros(4000), per_unit_bound=2.0, noise_multiplier=1.5, name="x", round=0
    )
    # OS entropy, so no seed: 4,000 draws put the sample std at s.e. 1.1 % of σ = 3 and the mean at s.e. 0.047;
    # ±7 % and ±0.3 are 6.3 sd each (false failure 4e-10 + 3e-10 a run), while σ off by √2 either way (−29 %,
    # +41 %) or by the bound (−50 %) stays over 25 sd out, and a one-sided sampler's mean (2.4) 50 sd out
    assert a.std().item() == pytest.approx(3.0, rel=0.07) and abs(a.mean().item()) < 0.3
    assert not torch.equal(a, b)  # same seed, different noise: the seed is not used


def test_secure_symmetric_noise_is_symmetric_with_the_declared_std():
    p = Privatizer(0, secure=True)
    m = p.symmetric_gaussian_sum(
        torch.eye(60), per_unit_bound=1.0, noise_multiplier=2.0, name="A", round=0, psd_units=True
    )
    assert torch.equal(m, m.T)
    rows, cols = torch.triu_indices(60, 60)
    noise = (m - torch.eye(60))[rows, cols]
    # σ = z·√2·B/2; 1,830 draws (OS entropy), s.e. 1.65 %: ±10 % is 6 sd (false failure 2e-9 a run), while
    # σ = z·B (+41 %) or z·B/2 (−29 %) stays over 17 sd out
    assert noise.std().item() == pytest.approx(2.0 / math.sqrt(2), rel=0.1)


def test_secure_exponential_mechanism_follows_its_law():
    p = Privatizer(0, secure=True)
    scores = torch.tensor([0.0, 1.0, 2.0])
    draws = torch.bincount(
        torch.tensor([p.exponential(scores, sensitivity=1.0, epsilon=2.0, name="s", round=0) for _ in range(3000)]),
        minlength=3,
    )
    expected = torch.softmax(-2.0 * scores / 2.0, 0) * 3000
    # each cell's bound is over 5.2 binomial sd: false failure 2.5e-7 a run (exact binomial tails, OS entropy)
    assert ((draws - expected).abs() < 5 * expected.sqrt()).all(), (draws, expected)


def test_secure_runs_differ_and_write_nothing_that_recomputes_the_noise(tmp_path):
    exp = EXPERIMENTS["altmin"]
    cfg = config.build(exp.config_type, dict(n_users=400, dim=5, rank=2, samples_per_user=8, rounds=1, seed=7))
    options = RuntimeOptions(secure_noise=True)
    first = execute(exp, cfg, options, out=tmp_path / "a", progress=False)
    second = execute(exp, cfg, options, out=tmp_path / "b", progress=False)
    assert not torch.equal(first["_state"]["U"], second["_state"]["U"])
    assert first["epsilon"] == second["epsilon"] <= cfg.epsilon
    noise_seed = str(derived_seed(cfg.seed, "dp-noise"))
    for path in (tmp_path / "a").rglob("*"):
        if path.is_file():
            assert noise_seed.encode() not in path.read_bytes(), path
    assert '"secure_noise": true' in (tmp_path / "a" / "config.json").read_text()
