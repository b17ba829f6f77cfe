"""NoisyHead's audit canaries (``fedpers audit noisyhead``): prompts whose two versions move the released
statistics by the full sensitivity."""

from __future__ import annotations

import torch

from fedpers.configs.noisyhead import (
    Mode,
    NoisyHeadConfig,
)
from fedpers.experiments.hooks import LABEL_OVERSHOOT, Canaries, CanaryDesign
from fedpers.experiments.noisyhead.protocol import make_protocol
from fedpers.privacy import (
    Calibrations,
)
from fedpers.protocols.noisyhead import NoisyHeadProtocol


def audit_protocol(cfg: NoisyHeadConfig, k: int, calibrations: Calibrations | None = None) -> NoisyHeadProtocol:
    """The configured protocol (its N, C, G, R and noise) in rounds mode: each step's gradient is a
    release the auditor sees, and statistics mode releases the same Γ̂ for the same noise."""
    if cfg.cohorts != "all" or cfg.noise != "independent":
        raise ValueError("cohorts/noise: the noisyhead audit's canaries take part in every step with independent noise")
    if cfg.clip_rule != "fixed":
        raise ValueError(
            "clip_rule: the noisyhead audit's canaries sit at the analytic bound; audit without --clip-rule adaptive"
        )
    if cfg.unit.value != "prompt" or cfg.sampling_rate != 1.0:
        raise ValueError(
            "unit/sampling_rate: the noisyhead audit has prompt-level, unsampled canaries; use --unit prompt without --sampling-rate"
        )
    return make_protocol(cfg, mode=Mode.ROUNDS, calibrations=calibrations)


def audit_canaries(protocol: NoisyHeadProtocol, generator: torch.Generator, k: int) -> Canaries:
    """Canary i on the coordinate (a, b) = divmod(i, D) of Γ: context tokens e_b with labels 1.5C,
    query e_a, so Z̃_i = G·e_a e_bᵀ (projection binds); the query label is ±1.5C (ỹ = ±C). Each
    step's gradient (<Γ, Z̃> − ỹ) Z̃ then differs by 2CG between the versions, of the bound's
    2G(C + RG): the <Γ, Z̃> part is the same in both (the data cannot know Γ in advance)."""
    p = protocol
    D, L = p.dim, p.context
    x = torch.zeros(k, 1, L + 1, D, dtype=torch.float64)
    y = torch.full((k, 1, L + 1), LABEL_OVERSHOOT * p.clip_c, dtype=torch.float64)
    idx = torch.arange(k)
    a, b = idx // D, idx % D
    eye = torch.eye(D, dtype=torch.float64)
    x[:, 0, :L] = eye[b][:, None, :]
    x[:, 0, L] = eye[a]
    y_minus = y.clone()
    y_minus[:, 0, L] = -LABEL_OVERSHOOT * p.clip_c
    dtype = p.dtype
    return Canaries(
        {"ids": idx, "x": x.to(dtype), "y": y.to(dtype)},
        {"ids": idx, "x": x.to(dtype), "y": y_minus.to(dtype)},
        "coordinate (a, b) of Γ per canary; Z̃ at its projection radius G, query label ±C",
    )


CANARY_DESIGN = CanaryDesign(
    audit_protocol,
    lambda p: p.dim**2,
    audit_canaries,
    "every step's noisy gradient (rounds mode; statistics mode releases the same Γ̂ law)",
    "replace-one prompt (a canary's two versions are the same prompt with a different query label)",
)
