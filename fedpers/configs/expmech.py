"""The exponential mechanism's config (``fedpers run expmech``, docs/algorithms.md §1, Algorithm 4): its
fields and ranges; its users are AltMin's for the same problem, so AltMin's rules check them."""

from __future__ import annotations

import enum
from pathlib import Path

from fedpers.config import MAX_EPSILON, DeviceRunConfig, Neighbours, RunConfig, field, inherited, run_config
from fedpers.configs.altmin import BASELINES as ALTMIN_BASELINES
from fedpers.configs.altmin import AltMinConfig
from fedpers.configs.shared import BASELINES_HELP, parse_baselines


class CandidateKind(str, enum.Enum):
    NET = "net"
    RANDOM = "random"


BASELINES = ("nonprivate_altmin", "clipped_no_noise", "local_only", "oracle", "nearest_candidate")
"""AltMin's baselines on the same users (but the private initialisation, which the exponential mechanism
has none of) and the candidate nearest the true subspace (what the candidate set allows at best)."""


def baseline_names(text: str) -> tuple[str, ...]:
    """``all`` | ``none`` | a comma list of :data:`BASELINES` → the names (refused otherwise)."""
    return parse_baselines(text, BASELINES)


@run_config
class ExpMechConfig(RunConfig):
    n_users: int = field(5000, "number of users n (synthetic data)", ge=1)
    dim: int = field(3, "feature dimension d", ge=2)
    rank: int = field(1, "subspace rank k (< d)", ge=1)
    samples_per_user: int = field(
        8, "samples per user m (a multiple of 4: first half scores, second half fits v)", ge=4
    )
    noise_std: float = field(
        0.5, "label noise σ_F (the default task: noisy labels and few samples, where a shared U pays off)", ge=0.0
    )
    epsilon: float = field(
        1.0, "user-level ε (pure ε-DP; inf: the best-scoring candidate)", gt=0.0, le=MAX_EPSILON, inf_ok=True
    )
    candidates: CandidateKind = field(
        CandidateKind.NET, "net: explicit φ-net of orthonormal U (tiny d·k); random: Haar-random candidates"
    )
    net_width: float = field(0.2, "φ: Frobenius radius of the net (candidates=net)", gt=0.0, le=2.0)
    num_candidates: int = field(2000, "Q: number of random candidates (candidates=random)", ge=1)
    clip_feature: float = field(2.0, "c_f: projected-feature clip L_f = c_f √k", gt=0.0)
    model_bound: float = field(2.0, "c_C: model norm constraint C = c_C √k", gt=0.0)
    clip_label: float = field(2.0, "c_ζ: label clip ζ = c_ζ √(k + σ_F²)", gt=0.0)
    baselines: str = field("all", BASELINES_HELP + ", ".join(BASELINES))
    memory_limit_gb: float = field(
        0.0, "refuse runs needing more memory than this (0: what the machine has available)", ge=0.0
    )
    seed: int = field(0, "run seed (data, candidates and DP noise use separate generators derived from it)", ge=0)
    neighbours: Neighbours = inherited()
    device: str = inherited(DeviceRunConfig)
    dtype: str = inherited(DeviceRunConfig)
    data: Path | None = field(None, "per-user data file (.npz, the altmin schema) instead of synthetic data")
    chunk_size: int = field(
        4096,
        "users per batch on the local runtime (bounds memory; auto or 0: from the memory available)",
        ge=0,
        words={"auto": 0},
    )

    def check(self) -> None:
        baseline_names(self.baselines)
        altmin_config(self).check()


def altmin_config(cfg: ExpMechConfig) -> AltMinConfig:
    """The AltMin config of the same problem (same users, same seed): its data and baselines."""
    return AltMinConfig(
        n_users=cfg.n_users,
        dim=cfg.dim,
        rank=cfg.rank,
        samples_per_user=cfg.samples_per_user,
        noise_std=cfg.noise_std,
        epsilon=cfg.epsilon,
        clip_label=cfg.clip_label,
        seed=cfg.seed,
        neighbours=cfg.neighbours,
        device=cfg.device,
        dtype=cfg.dtype,
        data=cfg.data,
        chunk_size=cfg.chunk_size,
        baselines=",".join(n for n in baseline_names(cfg.baselines) if n in ALTMIN_BASELINES) or "none",
    )
