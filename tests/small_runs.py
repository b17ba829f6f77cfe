"""Small FedRep and NoisyGD configurations and their set-up, shared by the cohort and correlated-noise
tests (tests/test_poisson.py, tests/test_correlated.py, tests/test_amplified.py, tests/test_mmcc.py):
each test adds what it varies (rounds, cohorts, noise) to one of these."""

from __future__ import annotations

from typing import Any

import torch

from fedpers import config
from fedpers.experiments import EXPERIMENTS

FEDREP = EXPERIMENTS["fedrep"]
NOISYGD = EXPERIMENTS["noisygd"]
FEDREP_SMALL: dict[str, Any] = dict(
    n_users=40,
    dim=6,
    rank=2,
    samples_per_user=5,
    refit_samples=3,
    test_samples=10,
    epsilon=2.0,
    clip=1.0,
    baselines="none",
)
NOISYGD_SMALL: dict[str, Any] = dict(
    classes=3,
    feature_dim=5,
    epsilon=2.0,
    test_examples=20,
    baselines="none",
    dtype="float64",
    collapse="random",
    beta=0.3,
)


def built(exp: Any, values: dict[str, Any]) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """(config, protocol, every unit's tensors, cloned so a test may edit them) of ``exp`` at ``values``."""
    cfg = config.build(exp.config_type, values)
    protocol = exp.protocol(cfg)
    count = cfg.n_users if exp is FEDREP else cfg.examples
    return cfg, protocol, {k: v.clone() for k, v in exp.units(cfg, torch.arange(count)).items()}
