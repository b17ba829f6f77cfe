"""AltMin's audit canaries (``fedpers audit altmin``): users whose two versions move the released statistics
by the full sensitivity, one orthogonal coordinate each, along random directions, or paired."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from fedpers.configs.altmin import AltMinConfig
from fedpers.experiments.altmin.protocol import make_protocol
from fedpers.experiments.hooks import BIG, LABEL_OVERSHOOT, Canaries, CanaryDesign
from fedpers.privacy import Calibrations
from fedpers.protocols.altmin import AltMinProtocol


def audit_protocol(cfg: AltMinConfig, k: int, calibrations: Calibrations | None = None) -> AltMinProtocol:
    """The configured protocol for a population of ``k`` canary users (the audit's own population)."""
    if cfg.data is not None:
        raise ValueError("data: the audit's population is its canaries; drop --data")
    if cfg.clip_rule != "fixed":
        raise ValueError(
            "clip_rule: the altmin audit's canaries sit at fixed clip bounds; audit without --clip-rule adaptive"
        )
    return make_protocol(replace(cfg, n_users=k, chunk_size=max(k, 1)), calibrations=calibrations)


def audit_canaries(protocol: AltMinProtocol, generator: torch.Generator, count: int) -> Canaries:
    """Canary i lives on coordinate e_i of R^d. Q1: fixed Gaussian samples (so v_i is generic);
    Q2: x = BIG·e_i and y = ±1.5ζ, so every w_ij sits at the model clip η along v̂_i ⊗ e_i and
    every label at ±ζ: b_i = ±|Q2|ηζ (v̂_i ⊗ e_i), the "+"/"−" versions differ by 2·bound (its
    full replace-one sensitivity), while A_i (PSD, sign-blind) is the same in both; second half:
    x = e_i and the pair's labels (+1.5ζ, ±1.5ζ), so W_i = ±(m/4)ζ² e_i e_iᵀ, again 2·bound apart."""
    p = protocol
    d, m, q, k = p.dim, p.samples_per_user, p.quarter, count
    dtype = p.dtype
    x = torch.zeros(k, m, d, dtype=torch.float64)
    y = torch.zeros(k, m, dtype=torch.float64)
    x[:, :q] = torch.randn(k, q, d, generator=generator, dtype=torch.float64)
    y[:, :q] = (x[:, :q] @ torch.randn(k, d, 1, generator=generator, dtype=torch.float64)).squeeze(-1)
    eye = torch.eye(d, dtype=torch.float64)[:k]
    x[:, q : 2 * q] = BIG * eye[:, None, :]
    x[:, 2 * q :] = eye[:, None, :]
    label = LABEL_OVERSHOOT * p.zeta
    y[:, q:] = label
    y_minus = y.clone()
    y_minus[:, q : 2 * q] = -label
    y_minus[:, 2 * q + 1 :: 2] = -label  # the second of each init pair
    ids = torch.arange(k)
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y.to(dtype)},
        {"ids": ids, "x": x.to(dtype), "y": y_minus.to(dtype)},
        "coordinate e_i per canary; b and W at ± their clip bound (2·bound apart), A equal in both versions",
    )


MIX_COSINE = 0.25
"""cos∠(u, w) of a random-placement canary's two Q2 directions: with opposite labels its A moves
by √(1 − c²) and its b by √((1 + c)/2) of their sensitivities; c = 1/4 maximises the sum of squares
(15/16 + 5/8 of 2), the most one user can move both (A is PSD and sign-blind, b is linear in x)."""


def _random_canaries(protocol: AltMinProtocol, generator: torch.Generator, k: int) -> Canaries:
    """More canaries than d: canary i on a random unit direction u_i of R^d (not orthogonal to the
    others). Init pairs x = u_i with labels (1.5ζ, ±1.5ζ): W_i = ±(m/4)ζ² u_iu_iᵀ, 2·bound apart.
    Q2: "+" x = BIG·u_i with labels +1.5ζ, "−" x = BIG·w_i with labels −1.5ζ, w_i at cosine 1/4 to
    u_i (:data:`MIX_COSINE`), so A moves by √(15/16) and b by √(5/8) of their sensitivities."""
    p = protocol
    d, m, q = p.dim, p.samples_per_user, p.quarter
    dtype = p.dtype
    u = torch.randn(k, d, generator=generator, dtype=torch.float64)
    u = u / torch.linalg.vector_norm(u, dim=1, keepdim=True)
    other = torch.randn(k, d, generator=generator, dtype=torch.float64)
    other = other - (other * u).sum(1, keepdim=True) * u
    other = other / torch.linalg.vector_norm(other, dim=1, keepdim=True)
    w = MIX_COSINE * u + math.sqrt(1 - MIX_COSINE**2) * other
    x = torch.zeros(k, m, d, dtype=torch.float64)
    y = torch.zeros(k, m, dtype=torch.float64)
    x[:, :q] = torch.randn(k, q, d, generator=generator, dtype=torch.float64)
    y[:, :q] = (x[:, :q] @ torch.randn(k, d, 1, generator=generator, dtype=torch.float64)).squeeze(-1)
    x[:, q : 2 * q] = BIG * u[:, None, :]
    x[:, 2 * q :] = u[:, None, :]
    label = LABEL_OVERSHOOT * p.zeta
    y[:, q:] = label
    x_minus, y_minus = x.clone(), y.clone()
    x_minus[:, q : 2 * q] = BIG * w[:, None, :]
    y_minus[:, q : 2 * q] = -label
    y_minus[:, 2 * q + 1 :: 2] = -label  # the second of each init pair
    ids = torch.arange(k)
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y.to(dtype)},
        {"ids": ids, "x": x_minus.to(dtype), "y": y_minus.to(dtype)},
        "random unit direction u_i per canary (interference in the scores); W at ± its clip bound along u_iu_iᵀ; "
        "Q2 at u_i with labels +ζ vs at w_i (cos 1/4 to u_i) with labels −ζ: A and b at √(15/16) and √(5/8) of their sensitivities",
    )


def _paired_canaries(base: Canaries) -> Canaries:
    """Canary i from orthogonal canaries 2i and 2i + 1 of :func:`audit_canaries`: the init pairs and
    Q1 are canary 2i's (W still flips sign on e_2i: its full 2·bound); "−" moves the "+" Q2 samples
    to e_2i+1, so A (PSD, sign-blind) moves by its full √2·bound and b by √2 of its 2·bound. Per
    user that is W 1, A 1, b 1/2 of the squared sensitivities (a sign flip alone: 1, 0, 1)."""
    k = base.count // 2
    first, second = slice(0, 2 * k, 2), slice(1, 2 * k, 2)
    ids = torch.arange(k)
    x_minus = base.minus["x"][first].clone()
    rows = (x_minus[0].abs().amax(-1) >= BIG / 2).nonzero().squeeze(-1)  # the Q2 samples: x = BIG·e
    x_minus[:, rows] = base.plus["x"][second][:, rows]
    y_minus = base.minus["y"][first].clone()
    y_minus[:, rows] = base.plus["y"][first][:, rows]
    return Canaries(
        {"ids": ids, "x": base.plus["x"][first], "y": base.plus["y"][first]},
        {"ids": ids, "x": x_minus, "y": y_minus},
        "pairs of coordinates (e_a, e_b) per canary; W at ± its clip bound on e_a (2·bound apart); "
        'Q2 on e_a ("+") or e_b ("−"): A at its full √2·bound, b √2·bound of its 2·bound',
        base.as_released,
    )


CANARY_DESIGN = CanaryDesign(
    audit_protocol,
    lambda p: p.dim,
    audit_canaries,
    "init W, and every round's A and b",
    "replace-one user (a canary's two versions are the same user with different data)",
    random_canaries=_random_canaries,
    paired_canaries=_paired_canaries,
)
