"""FedRep's audit canaries (``fedpers audit fedrep``): users whose gradients of U move each round's
release by the full clip, placed orthogonally, or steered from each round's broadcast."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import torch

from fedpers import linalg
from fedpers.configs.fedrep import FedRepConfig
from fedpers.experiments.base import derived_seed
from fedpers.experiments.fedrep.plan import make_protocol
from fedpers.experiments.hooks import Canaries, CanaryDesign
from fedpers.privacy import (
    Calibrations,
)
from fedpers.protocols.fedrep import FedRepProtocol

Tensor = torch.Tensor


FEDREP_LABEL = 1e3
"""FedRep canaries' labels are this many times ζ: G_j grows as the labels squared, so the clip C binds in
every round whatever U is (at 1.5ζ it did not always). The init's label clip is then checked by the server's
norm check (a missing clip aborts the run) rather than by the audit."""


def audit_protocol(cfg: FedRepConfig, k: int, calibrations: Calibrations | None = None) -> FedRepProtocol:
    """The configured protocol for a population of ``k`` canary users (with cyclic cohorts a canary
    takes part in its cohort's rounds; with correlated noise the scorer decorrelates the stream)."""
    if cfg.clip_rule != "fixed":
        raise ValueError(
            "clip_rule: the fedrep audit's canaries sit at a fixed clip; audit without --clip-rule adaptive"
        )
    return make_protocol(replace(cfg, n_users=k, chunk_size=max(k, 1)), calibrations)


def _canary_layout(p: FedRepProtocol) -> tuple[int, int]:
    """(j, width): j init pairs on their own extra coordinates, width = k + 1 coordinates per canary."""
    odd = p.samples_per_user % 2
    j = p.rank - odd
    if p.pairs - j < 1:
        raise ValueError(
            f"samples_per_user: the fedrep audit needs m >= {2 * p.rank + 1} for rank {p.rank} (k + 1 feature directions per canary); got {p.samples_per_user}"
        )
    return j, p.rank + 1


def fedrep_init_fraction(p: FedRepProtocol) -> float:
    """||W⁺ − W⁻||/(2·bound) of a FedRep canary: sqrt((p − j)² + j)/p (p pairs, j of them off e_c0)."""
    j, _ = _canary_layout(p)
    return math.sqrt((p.pairs - j) ** 2 + j) / p.pairs


def audit_canaries(protocol: FedRepProtocol, generator: torch.Generator, count: int) -> Canaries:
    """Canary i owns the k + 1 coordinates c_0..c_k of block i of R^d (fewer would make every G_j = 0:
    the least-squares residual is orthogonal to U, so g_j needs k + 1 feature directions). Pairs: the
    first p − j on e_c0, then one pair on each of e_c1..e_cj (j = k, or k − 1 when m is odd and the last,
    unpaired sample sits on e_ck). "+": every label Lζ; "−": each pair's labels (Lζ, −Lζ), the
    unpaired one 0. Init: W = ±ζ²(Σ_pairs e e ᵀ), a fraction sqrt((p − j)² + j)/p of the 2·bound
    sensitivity. Rounds: "−" has Σ_c-group labels 0, so v_j = 0 and G_j = 0; "+" has G_j at the clip C
    (C of the 2C sensitivity): the sign-symmetric worst case needs U, which fixed data cannot know."""
    p = protocol
    j, width = _canary_layout(p)
    m, d = p.samples_per_user, p.dim
    coord = torch.zeros(m, dtype=torch.long)
    for pair in range(p.pairs):
        coord[2 * pair : 2 * pair + 2] = max(0, pair - (p.pairs - j) + 1)
    if m % 2:
        coord[-1] = p.rank
    eye = torch.eye(d, dtype=torch.float64)
    blocks = 2 if _two_blocks(p) else 1
    base = torch.arange(count)[:, None] * width * blocks
    x = eye[base + coord[None, :]]  # (count, m, d)
    label = FEDREP_LABEL * p.zeta
    y = torch.full((count, m), label, dtype=torch.float64)
    ids = torch.arange(count)
    dtype = p.dtype
    if blocks == 2:
        x_minus = eye[base + width + coord[None, :]]  # the "+" data moved to the canary's second block
        return Canaries(
            {"ids": ids, "x": x.to(dtype), "y": y.to(dtype)},
            {"ids": ids, "x": x_minus.to(dtype), "y": y.to(dtype)},
            f'2(k + 1) coordinates per canary, the same data on its first block ("+") or its second ("−"): '
            f"init W at {fedrep_init_fraction(p) / math.sqrt(2):.3f} of its sensitivity, every round's G at the clip C "
            "on orthogonal rows (√2·C of the 2C sensitivity)",
        )
    y_minus = y.clone()
    y_minus[:, 1 : 2 * p.pairs : 2] = -label
    if m % 2:
        y_minus[:, -1] = 0.0
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y.to(dtype)},
        {"ids": ids, "x": x.to(dtype), "y": y_minus.to(dtype)},
        f'k + 1 coordinates per canary; init W at {fedrep_init_fraction(p):.3f} of its sensitivity, G at the clip C in "+", 0 in "−"',
    )


def _two_blocks(p: FedRepProtocol) -> bool:
    """With T ≥ 2 rounds a canary whose versions sit on two orthogonal blocks separates more: its G
    differs by √2·C every round (T/2 against T/4 of μ²) at the cost of W (f²/2 against f²)."""
    return p.rounds >= 2


def _capacity(p: FedRepProtocol) -> int:
    return p.dim // ((p.rank + 1) * (2 if _two_blocks(p) else 1))


def steer_canaries(p: FedRepProtocol, round: int, broadcast: Mapping[str, Tensor], cans: Canaries) -> Canaries:
    """White-box canaries for round ≥ 1, rebuilt from its broadcast U: both versions keep the "+"
    samples x (first block); labels y± = y⊥ ± XUv₀ with y⊥ ∈ col(X) orthogonal to col(XU) (public,
    fixed per canary and round) and v₀ a fixed direction of R^k at Lζ. Then v = ±v₀, the residual is
    −y⊥ in both and g = −(2/m)Xᵀy⊥ ≠ 0, so G⁻ = −G⁺ at the clip C: the round's full 2C sensitivity,
    which fixed data cannot reach (G is sign-blind in the labels). Round 0 (W) keeps ``cans``."""
    if round == 0:
        return cans
    U = broadcast["U"].to(torch.float64)
    x = cans.plus["x"].to(torch.float64)
    n, m, _ = x.shape
    label = FEDREP_LABEL * p.zeta
    y_plus, y_minus = torch.empty(n, m, dtype=torch.float64), torch.empty(n, m, dtype=torch.float64)
    for i in range(n):
        public = torch.Generator().manual_seed(derived_seed(round, f"fedrep-steer-{i}"))
        X = x[i]
        XU = X @ U
        t = X @ torch.randn(X.shape[1], generator=public, dtype=torch.float64)
        perp = t - XU @ linalg.lstsq(XU, t.unsqueeze(-1)).squeeze(-1)
        perp = perp * (label * math.sqrt(m) / torch.linalg.vector_norm(perp).clamp_min(1e-300))
        v0 = torch.randn(U.shape[1], generator=public, dtype=torch.float64)
        v0 = v0 * (label / torch.linalg.vector_norm(v0))
        y_plus[i], y_minus[i] = perp + XU @ v0, perp - XU @ v0
    dtype = p.dtype
    ids = cans.plus["ids"]
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y_plus.to(dtype)},
        {"ids": ids, "x": x.to(dtype), "y": y_minus.to(dtype)},
        cans.design + "; rounds ≥ 1 steered from U: G at ±C (2C apart)",
        cans.as_released,
    )


CANARY_DESIGN = CanaryDesign(
    audit_protocol,
    _capacity,
    audit_canaries,
    "init W, and every round's G",
    "replace-one user (a canary's two versions are the same user with different labels)",
    steer=steer_canaries,
)
