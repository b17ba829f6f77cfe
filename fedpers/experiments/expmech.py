"""`fedpers run expmech`: user-level ε-DP selection of U by the exponential mechanism (docs/algorithms.md §1, Algorithm 4).

The data, metrics and baselines are AltMin's (:mod:`fedpers.experiments.altmin`), on the
same users for the same seed, so ``run expmech`` and ``run altmin`` compare on one problem.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from fedpers import memory, metrics
from fedpers.configs.expmech import BASELINES, CandidateKind, ExpMechConfig, altmin_config, baseline_names
from fedpers.data.units import UnitSource
from fedpers.experiments import altmin
from fedpers.experiments.base import Experiment, Trivial, derived_seed
from fedpers.privacy import Calibrations, Ledger, PureDpEvent, ledger_epsilon
from fedpers.protocols.base import State
from fedpers.protocols.expmech import ExpMechProtocol, estimate_net_size, net_grid_size
from fedpers.runtime.local import Companion

Tensor = torch.Tensor
MAX_NET_GRID = 50_000_000
WORKING_ELEMENTS = 1 << 22


def resolve(cfg: ExpMechConfig) -> ExpMechConfig:
    """With ``data`` set, n, m and d come from the file (AltMin's plan of the same problem)."""
    if cfg.data is None:
        return cfg
    a = altmin.resolve_plan(altmin_config(cfg)).cfg
    return replace(cfg, n_users=a.n_users, samples_per_user=a.samples_per_user, dim=a.dim)


def clip_bounds(cfg: ExpMechConfig) -> tuple[float, float, float]:
    """(L_f, C, ζ) = (c_f √k, c_C √k, c_ζ √(k + σ_F²)): data-independent (public k, σ_F)."""
    _, zeta = altmin.clip_bounds(altmin_config(cfg))
    return cfg.clip_feature * math.sqrt(cfg.rank), cfg.model_bound * math.sqrt(cfg.rank), zeta


def candidate_count(cfg: ExpMechConfig) -> tuple[int, bool]:
    """(number of candidates, exact?) without building a net that would not fit."""
    if cfg.candidates is CandidateKind.RANDOM:
        return cfg.num_candidates, True
    return estimate_net_size(cfg.dim, cfg.rank, cfg.net_width), False


def memory_needed(cfg: ExpMechConfig, candidates: int) -> dict[str, int]:
    """Bytes the run holds at its peak, by part (float64 throughout)."""
    cfg = resolve(cfg)
    per_user = cfg.samples_per_user * (cfg.dim + 1) + cfg.rank
    return {
        "candidates": 3 * candidates * cfg.dim * cfg.rank * 8,  # protocol cache, server state, client copy
        "scores": 4 * candidates * 8,
        "users": 2 * cfg.n_users * per_user * 8,  # the runtime's units and the evaluator's
        "working": 8 * WORKING_ELEMENTS * 8,  # one candidate block of projected features and Gram matrices
    }


def check_fits(cfg: ExpMechConfig) -> tuple[int, bool, dict[str, int]]:
    """Refuse (ValueError) a run whose net cannot be enumerated or that needs more memory than allowed."""
    count, exact = candidate_count(cfg)
    if cfg.candidates is CandidateKind.NET:
        per_axis, grid = net_grid_size(cfg.dim, cfg.rank, cfg.net_width)
        if grid > MAX_NET_GRID:
            raise ValueError(
                f"candidates=net: a φ-net with net_width={cfg.net_width} for d={cfg.dim}, k={cfg.rank} has about "
                f"{count:.3g} candidates from {per_axis}^{cfg.dim * cfg.rank} = {grid:.3g} grid points to enumerate "
                f"(limit {MAX_NET_GRID:.0e}); use a larger --net-width or --candidates random --num-candidates Q"
            )
    need = memory_needed(cfg, count)
    limit = int(cfg.memory_limit_gb * 2**30) if cfg.memory_limit_gb > 0 else memory.available_bytes()
    total = sum(need.values())
    if limit > 0 and total > limit:
        parts = ", ".join(f"{k} {memory.human(v)}" for k, v in need.items())
        raise ValueError(
            f"expmech needs about {memory.human(total)} of memory for {count} candidates ({parts}) "
            f"but {memory.human(limit)} is available; use fewer candidates (a larger --net-width or a smaller --num-candidates)"
        )
    return count, exact, need


def make_protocol(cfg: ExpMechConfig) -> ExpMechProtocol:
    cfg = resolve(cfg)
    check_fits(cfg)
    L_f, C, zeta = clip_bounds(cfg)
    return ExpMechProtocol(
        n_users=cfg.n_users,
        dim=cfg.dim,
        rank=cfg.rank,
        samples_per_user=cfg.samples_per_user,
        epsilon=cfg.epsilon,
        feature_clip=L_f,
        model_bound=C,
        label_clip=zeta,
        candidate_kind=cfg.candidates,
        net_width=cfg.net_width,
        num_candidates=cfg.num_candidates,
        candidate_seed=derived_seed(cfg.seed, "candidates"),
        dtype_name=cfg.dtype,
        block_elements=WORKING_ELEMENTS,
    )


ALTMIN = altmin.AltMinExperiment()
"""The users of an expmech run are AltMin's for the same problem (:func:`altmin_config`)."""


class ExpMechEvaluator(altmin.AltMinEvaluator):
    """AltMin's metrics and baselines; the private run's users fit v with ||v|| ≤ C (Algorithm 4, step 4)."""

    def __init__(self, cfg: ExpMechConfig, protocol: ExpMechProtocol) -> None:
        a = altmin.resolve_plan(altmin_config(cfg))
        super().__init__(a, a.protocol(private=False))
        self.expmech, self.exp_cfg = protocol, cfg

    def round_metrics(self, round: int, state: State) -> dict[str, float]:
        if self.u_star is None:
            return {}
        U = state["U"].to(self.u_star.device)  # the candidates live on the host, U* and the users on the run's device
        return {
            "subspace_error": metrics.subspace_error(U, self.u_star),
            "subspace_error_spectral": metrics.subspace_error_spectral(U, self.u_star),
        }

    def companions(self) -> list[Companion]:
        """None: the private run's passes are the exponential mechanism's, not AltMin's."""
        return []

    @property
    def eval_source(self) -> UnitSource:
        """Every sample of every user: the candidates' fits index the second half of all m samples."""
        return self.source

    def candidate_fit(self, U: Tensor) -> altmin.Fit:
        """Users fit v with ||v|| ≤ C on their second half (Algorithm 4, step 4)."""
        return lambda units: U.to(self.expmech.dtype) @ self.expmech.personalize(U, units).unsqueeze(-1)

    def final(self, state: State) -> dict[str, Any]:
        extra = {}
        device = self.cfg.device  # where the users are scored (the candidates live on the host)
        if self.u_star is not None and "nearest_candidate" in baseline_names(self.exp_cfg.baselines):
            cands = state["candidates"].to(device, torch.float64)
            proj = cands - self.u_star.double() @ (self.u_star.double().T @ cands)
            nearest = state["candidates"][int(torch.linalg.matrix_norm(proj).argmin())].to(device)
            extra["nearest_candidate"] = (self.candidate_fit(nearest), nearest)
        U = state["U"].to(device)
        out = self.with_baselines({"private": (self.candidate_fit(U), U)}, extra)
        out["baselines_skipped"] = [n for n in BASELINES if n not in out["baselines"]]
        out["candidates"] = int(state["candidates"].shape[0])
        return out


class ExpMechExperiment(Experiment[ExpMechConfig, ExpMechProtocol]):
    """User-level ε-DP selection of U by the exponential mechanism (Algorithm 4): AltMin's users,
    data hooks and round axis (:data:`ALTMIN`), its own protocol, evaluation and privacy."""

    name = "expmech"
    privacy_fields = ("epsilon", "neighbours")

    def shared_baselines(self, cfg: ExpMechConfig) -> tuple[str, ...]:
        """AltMin's shared baselines of the same users (the candidates' nearest is this run's own)."""
        return altmin.shared_baselines(altmin_config(cfg))

    round_axis = altmin.AltMinExperiment.round_axis
    result_keys = (*altmin.AltMinExperiment.result_keys, "candidates")
    baseline_names = BASELINES
    config_type = ExpMechConfig

    def trivial_baselines(self, cfg: ExpMechConfig) -> list[Trivial]:
        why = (
            "the selected U is too far from the truth: either the candidate set is too coarse (compare nearest_candidate; "
            "use a smaller --net-width or more --num-candidates) or there are too few users for this ε to single out "
            + (
                "a good candidate (raise --n-users or --epsilon)"
                if cfg.data is None
                else "a good candidate (raise --epsilon)"
            )
        )
        return [Trivial("excess_risk", "local_only", why=why)]

    def protocol(self, cfg: ExpMechConfig, calibrations: Calibrations | None = None) -> ExpMechProtocol:
        return make_protocol(cfg)

    def num_units(self, cfg: ExpMechConfig) -> int:
        return resolve(cfg).n_users

    def units(self, cfg: ExpMechConfig, ids: Tensor) -> dict[str, Tensor]:
        return ALTMIN.units(altmin_config(cfg), ids)

    def unit_source(self, cfg: ExpMechConfig) -> UnitSource:
        return ALTMIN.unit_source(altmin_config(cfg))

    def chunk_size(self, cfg: ExpMechConfig) -> int:
        return ALTMIN.chunk_size(altmin_config(cfg))

    def evaluator(self, cfg: ExpMechConfig, protocol: ExpMechProtocol) -> ExpMechEvaluator:
        return ExpMechEvaluator(cfg, protocol)

    def privacy_summary(self, cfg: ExpMechConfig, protocol: ExpMechProtocol, ledger: Ledger) -> dict[str, Any]:
        pure = all(isinstance(r.event, PureDpEvent) for r in ledger)
        eps = sum(r.event.epsilon for r in ledger) if pure else ledger_epsilon(ledger, 1e-10)
        return {
            "epsilon": eps,
            "delta": 0.0,
            "target_epsilon": cfg.epsilon,
            "accountant": "pure ε-DP composition" if pure else "pld",
            "neighbouring": f"{cfg.neighbours.value} user",
            "neighbours": cfg.neighbours.value,
            "mechanism": "exponential (Gumbel-max)",
            "sensitivity": protocol.sensitivity,
            "sensitivity_formula": "ζ² (each user's score lies in [0, ζ²]: the change of replacing, adding or removing one)",
            "paper_sensitivity": protocol.paper_sensitivity,
        }

    def plot_keys(self) -> tuple[str, ...]:
        return ()

    def describe(self, cfg: ExpMechConfig, protocol: ExpMechProtocol) -> dict[str, Any]:
        return {
            "candidates": protocol.candidate_count,
            "candidate_kind": protocol.candidate_kind.value,
            "net_width": protocol.net_width if protocol.candidate_kind is CandidateKind.NET else None,
            "L_f": protocol.feature_clip,
            "C": protocol.model_bound,
            "zeta": protocol.label_clip,
            "xi": protocol.xi,
            "sensitivity": protocol.sensitivity,
            "paper_sensitivity": protocol.paper_sensitivity,
            "selection": "P(U) ∝ exp(−ε·score(U)/(2Δ)), Δ = ζ² (the paper's 4ξL_fC is looser and misses label changes)",
        }

    def plan(self, cfg: ExpMechConfig) -> list[str]:
        cfg = resolve(cfg)
        count, _exact, need = check_fits(cfg)
        if cfg.candidates is CandidateKind.NET:
            count = int(make_protocol(cfg).candidate_count)  # cached: the run reuses this net
            what = f"φ-net of width {cfg.net_width} over {cfg.dim}×{cfg.rank} orthonormal matrices"
        else:
            what = f"Haar-random {cfg.dim}×{cfg.rank} orthonormal matrices"
        limit = int(cfg.memory_limit_gb * 2**30) if cfg.memory_limit_gb > 0 else memory.available_bytes()
        return [
            f"expmech: {count} candidates ({what}); {cfg.n_users} users × {count} constrained least-squares scores",
            f"expmech: memory needed about {memory.human(sum(need.values()))} "
            f"({', '.join(f'{k} {memory.human(v)}' for k, v in need.items())}); available {memory.human(limit)}",
        ]

    def reduced_config(self) -> dict[str, Any]:
        return {"n_users": 2000}
