"""DPALS's audit canaries (``fedpers audit dpals``): users whose two versions move the released item
statistics (block upper triangles) by the full sensitivity."""

from __future__ import annotations

from dataclasses import replace

import torch

from fedpers.configs.dpals import DpAlsConfig
from fedpers.experiments.dpals.protocol import make_protocol
from fedpers.experiments.hooks import BIG, Canaries, CanaryDesign
from fedpers.privacy import Calibrations
from fedpers.protocols.dpals import DpAlsProtocol, triu_pack

Tensor = torch.Tensor


def audit_protocol(cfg: DpAlsConfig, k: int, calibrations: Calibrations | None = None) -> DpAlsProtocol:
    """The configured protocol for ``k`` canary users on synthetic items (with round 0 when
    ``private_center``/``head_items`` ask for it: :func:`round0_canaries`)."""
    if cfg.ratings is not None or cfg.dataset:
        raise ValueError(
            "ratings/dataset: the audit's population is its canaries (synthetic items); drop --ratings/--dataset"
        )
    return make_protocol(replace(cfg, n_users=k, chunk_size=max(k, 1)), calibrations)


def round0_canaries(protocol: DpAlsProtocol, generator: torch.Generator, count: int) -> Canaries:
    """With round 0 (item sums s and counts c): canary i rates B = items_per_user items, the block
    P_i = [2iB, (2i+1)B) at +BIG ("+") or the next block Q_i at −BIG ("−"). Its rating vector
    clips to ±c_r on each item, so s moves by c_r on 2B items and its total entry by 2√B·c_r:
    6Bc_r² of the (2Γ_s)² = 8Bc_r² sensitivity; c by 1 on 2B items, totals equal: 2B of 8B. Round
    0 together: exactly 1/√2 of its proven μ (s and c share z). The ALS rounds see the B ratings
    on different items (G, b ∝ r², sign-blind), as the one-rating design does."""
    p = protocol
    b = p.items_per_user
    if 2 * b * count > p.n_items:
        raise ValueError(f"canaries must be <= n_items/(2·items_per_user) = {p.n_items // (2 * b)}; got {count}")
    ids = torch.arange(count)
    block = torch.arange(b)
    ones = torch.ones(count, b, dtype=torch.float64)
    mask = torch.ones(count, b, dtype=torch.bool)
    test = torch.zeros(count, b, dtype=torch.bool)
    plus = {"ids": ids, "items": 2 * b * ids[:, None] + block, "ratings": (BIG * ones).to(p.dtype), "mask": mask}
    minus = {
        "ids": ids,
        "items": (2 * ids[:, None] + 1) * b + block,
        "ratings": (-BIG * ones).to(p.dtype),
        "mask": mask,
    }
    plus["test"], minus["test"] = test, test.clone()
    return Canaries(
        plus,
        minus,
        'B = items_per_user ratings per canary user: block 2i at +BIG ("+") or block 2i + 1 at −BIG ("−"); '
        "round 0's s at √(3/4) and c at 1/2 of their sensitivities; G and b on different items",
        released_statistic,
    )


def _canaries(protocol: DpAlsProtocol, generator: torch.Generator, count: int) -> Canaries:
    return (round0_canaries if protocol.prelude else audit_canaries)(protocol, generator, count)


def audit_canaries(protocol: DpAlsProtocol, generator: torch.Generator, count: int) -> Canaries:
    """Canary i rates one item: item 2i ("+") or item 2i + 1 ("−"), rating BIG. With one rating
    v̂ = ±Û_item, so G_item = Γ_G v̂v̂ᵀ and b_item = Γ_b Û_item (both clips bind; the sign of the
    rating cancels in r·v): the versions' contributions sit on different items, √2·Γ apart, the
    most two one-rating users can be (G is PSD, b ∝ r²·U_item, so no rating flips them).
    G is released as block upper triangles: a block's share (1 + Σ v̂⁴)/2 of Γ_G² shows."""
    p = protocol
    if 2 * count > p.n_items:
        raise ValueError(f"canaries must be <= n_items/2 = {p.n_items // 2}; got {count}")
    ids = torch.arange(count)
    ratings = torch.full((count, 1), BIG, dtype=torch.float64).to(p.dtype)
    mask = torch.ones(count, 1, dtype=torch.bool)
    plus = {"ids": ids, "items": (2 * ids)[:, None], "ratings": ratings, "mask": mask}
    minus = {"ids": ids, "items": (2 * ids + 1)[:, None], "ratings": ratings, "mask": mask}
    return Canaries(
        plus,
        minus,
        'one rating per canary user, on item 2i ("+") or 2i + 1 ("−"): G and b at their clips, √2·Γ apart',
        released_statistic,
    )


def released_statistic(name: str, stat: Tensor) -> Tensor:
    """A client's statistic in the form the server releases it: G's full blocks as their upper
    triangles (what messages carry already passes unchanged)."""
    if name == "G" and stat.dim() == 3:
        return triu_pack(stat)
    return stat


CANARY_DESIGN = CanaryDesign(
    audit_protocol,
    lambda p: p.n_items // (2 * p.items_per_user if p.prelude else 2),
    _canaries,
    "round 0's item sums and counts (with private_center/head_items), every round's G (block upper triangles) and b",
    "replace-one user (a canary's two versions are the same user rating a different item)",
)
