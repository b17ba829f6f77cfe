"""A toy algorithm added through the documented extension points only: docs/contributing.md's worked example.

A private mean of per-user vectors: every round each user sends its vector clipped to norm C,
the server releases the sum through one Gaussian release of the Privatizer, and the published
estimate is the average of the rounds' noisy means. It is registered by
``fedpers.experiments.register`` (tests/test_contributing.py), never by an edit of fedpers, with its
config in a module of its own (tests/toy_config.py: no torch, so a bad flag is refused at once), and
runs locally, on Flower, through ``fedpers audit`` and a private sweep. The code blocks of
docs/contributing.md are copied from this file; the test suite checks that they still match.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import dp_accounting
import torch

from fedpers.experiments.base import Evaluator, Experiment, Trivial, derived_seed
from fedpers.experiments.hooks import BIG, Canaries, CanaryDesign, PrivateScore
from fedpers.privacy import Calibrations, Ledger, Privatizer, calibrate_noise_multiplier, ledger_epsilon
from fedpers.protocols.base import Message, NodeSide, Protocol, StatSpec, Units
from tests.toy_config import ToyMeanConfig

Tensor = torch.Tensor


# ----- the protocol (protocols/X.py): public data plus two pure functions ---------------------------
@dataclass(frozen=True)
class ToyMeanProtocol(Protocol):
    """Each round: users send their vectors clipped to ``clip``; the server releases the noisy sum."""

    n_users: int
    dim: int
    rounds: int
    clip: float
    noise_multiplier: float
    name = "toymean"

    @property
    def num_rounds(self) -> int:
        return self.rounds

    def initial_state(self) -> dict[str, Tensor]:
        return {"mean": torch.zeros(self.dim, dtype=torch.float64)}

    def broadcast(self, state: dict[str, Tensor], round: int) -> dict[str, Tensor]:
        return {"mean": state["mean"]}

    def stat_specs(self, round: int) -> tuple[StatSpec, ...]:
        return (StatSpec("sum", (self.dim,), per_unit_bound=self.clip),)

    def unit_keys(self) -> tuple[str, ...]:
        return ("x",)

    def client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        x = units["x"].double()
        norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        clipped = x * torch.clamp(self.clip / norms.clamp_min(1e-300), max=1.0)  # a zero vector stays zero
        return Message({"sum": clipped.sum(0)}, int(x.shape[0]))

    def server_update(
        self, round: int, state: dict[str, Tensor], summed: Message, privatizer: Privatizer
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        noisy = privatizer.gaussian_sum(
            summed.stats["sum"],
            per_unit_bound=self.clip,
            noise_multiplier=self.noise_multiplier,
            name=f"round{round}.sum",
            round=round,
        )
        mean = (state["mean"] * round + noisy / self.n_users) / (round + 1)  # average of the rounds' estimates
        return {"mean": mean}, {}

    def node_side(self) -> NodeSide | str:
        """Its one release a round is a Gaussian sum of clipped units at z: the nodes can add that noise."""
        return NodeSide(self.noise_multiplier)


def user_event(noise_multiplier: float, rounds: int) -> dp_accounting.DpEvent:
    """What one user is touched by: one Gaussian release per round."""
    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier), rounds)


# ----- the experiment (experiments/X.py): protocol calibrated, data, evaluation ---------------------
TRUE_MEAN = 0.5
"""Every coordinate of the population mean (public: the simulator's truth)."""


def make_protocol(cfg: ToyMeanConfig, calibrations: Calibrations | None = None) -> ToyMeanProtocol:
    z = calibrate_noise_multiplier(
        lambda z: user_event(z, cfg.rounds), cfg.epsilon, cfg.delta, cfg.accountant, calibrations, cfg.neighbours
    )
    return ToyMeanProtocol(cfg.n_users, cfg.dim, cfg.rounds, cfg.clip, z)


def load_units(cfg: ToyMeanConfig, ids: Tensor) -> dict[str, Tensor]:
    """User j's vector, drawn from its own seed: any subset of users (a Flower node's) is the same data."""
    rows = [
        torch.randn(cfg.dim, generator=torch.Generator().manual_seed(derived_seed(cfg.seed, f"toy-{j}")))
        for j in ids.tolist()
    ]
    x = TRUE_MEAN + torch.stack(rows).double() if rows else torch.zeros(0, cfg.dim, dtype=torch.float64)
    return {"ids": ids, "x": x}


class ToyMeanEvaluator(Evaluator):
    def __init__(self, cfg: ToyMeanConfig) -> None:
        self.truth = torch.full((cfg.dim,), TRUE_MEAN, dtype=torch.float64)

    def final(self, state: Any) -> dict[str, Any]:
        error = float(torch.linalg.vector_norm(state["mean"] - self.truth))
        return {"mean_error": error, "baselines": {"zero": {"mean_error": float(torch.linalg.vector_norm(self.truth))}}}


class ToyMeanExperiment(Experiment[ToyMeanConfig, ToyMeanProtocol]):
    """A private mean of per-user vectors (docs/contributing.md's worked example)."""

    name = "toymean"
    config_type = ToyMeanConfig
    primary_metric = "mean_error"
    result_keys = ("mean_error",)
    baseline_names = ("zero",)

    def protocol(self, cfg: ToyMeanConfig, calibrations: Calibrations | None = None) -> ToyMeanProtocol:
        return make_protocol(cfg, calibrations)

    def num_units(self, cfg: ToyMeanConfig) -> int:
        return cfg.n_users

    def units(self, cfg: ToyMeanConfig, ids: Tensor) -> dict[str, Tensor]:
        return load_units(cfg, ids)

    def evaluator(self, cfg: ToyMeanConfig, protocol: ToyMeanProtocol) -> ToyMeanEvaluator:
        return ToyMeanEvaluator(cfg)

    def privacy_summary(self, cfg: ToyMeanConfig, protocol: ToyMeanProtocol, ledger: Ledger) -> dict[str, Any]:
        return {
            "epsilon": ledger_epsilon(ledger, cfg.delta, cfg.accountant) if math.isfinite(cfg.epsilon) else math.inf,
            "delta": cfg.delta,
            "target_epsilon": cfg.epsilon,
            "accountant": cfg.accountant,
            "neighbouring": "replace-one user",
            "noise_multiplier": protocol.noise_multiplier,
        }

    def trivial_baselines(self, cfg: ToyMeanConfig) -> list[Trivial]:
        return [Trivial("mean_error", "zero", why="the noise swamps the sum: raise --n-users or --epsilon")]

    # ----- the optional hooks -----
    def canary_design(self) -> CanaryDesign | None:
        return CANARY_DESIGN

    def private_scores(self) -> dict[str, PrivateScore]:
        return {"validation_mse": VALIDATION_MSE}

    def reduced_config(self) -> dict[str, Any]:
        return {"n_users": 100}


# ----- the audit's canaries (the canary_design hook) -------------------------------------------------
def audit_canaries(protocol: ToyMeanProtocol, generator: torch.Generator, count: int) -> Canaries:
    """Canary i holds ±BIG·e_i: clipped to ±C·e_i, its two versions are 2C apart (the full sensitivity)."""
    x = BIG * torch.eye(protocol.dim, dtype=torch.float64)[:count]
    ids = torch.arange(count)
    return Canaries({"ids": ids, "x": x}, {"ids": ids, "x": -x}, "±BIG·e_i per canary (clipped to ±C·e_i)")


CANARY_DESIGN = CanaryDesign(
    protocol=lambda cfg, k, calibrations=None: make_protocol(replace(cfg, n_users=k), calibrations),
    capacity=lambda protocol: protocol.dim,
    canaries=audit_canaries,
    releases="every round's sum",
    neighbouring="replace-one user (a canary's two versions are the same user with its vector negated)",
)


# ----- the private tuning score (the private_scores hook) -----------------------------------------------
VALIDATION_MSE = PrivateScore(
    metric="validation_mse",
    clip=lambda cfg: 4.0 * cfg.dim,
    per_user=lambda cfg, protocol, state, units: ((units["x"] - state["mean"]) ** 2).sum(1),
    units=load_units,
)
"""A held-out user's squared distance to the released mean, clipped to [0, 4d] (public)."""
