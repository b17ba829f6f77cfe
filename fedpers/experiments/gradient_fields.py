"""The flags the gradient-round algorithms (FedRep, NoisyGD, NoisyHead in rounds mode) declare alike:
cyclic cohorts, correlated noise across rounds and the adaptive clip.

Each field is declared once here (default, help text, range); a config lists it with
``name: type = inherited(GradientRoundFields)``, so the three ``--help`` texts cannot drift apart,
and the flag snapshot follows this file (:func:`fedpers.commands.flags._sources`). A flag whose
meaning differs between the algorithms (NoisyHead's cycle needs ``--mode rounds``, its noise decay
defaults to GD's own contraction, its bound is B) stays declared by that algorithm."""

from __future__ import annotations

from dataclasses import dataclass

from fedpers.config import field


@dataclass(frozen=True)
class GradientRoundFields:
    """Declarations only: no run config is one (see :func:`fedpers.config.inherited`)."""

    cycle: int = field(1, "K: number of cyclic cohorts (with --cohorts cyclic)", ge=1)
    sampling_rate: float = field(
        1.0,
        "q: Poisson inclusion probability per round (with --cohorts poisson): the expected share of units in a "
        "round; with banded or optimised noise the units form b id blocks taken in turn, each sampled at q·b",
        gt=0.0,
        le=1.0,
    )
    noise: str = field(
        "independent",
        "noise across gradient rounds (steps): independent, banded (square-root factorization, --bands), "
        "optimised (banded, optimised for the horizon and cycle), or blt (buffered linear Toeplitz, optimised)",
    )
    bands: int = field(
        0,
        "b: bands of the correlated noise's C (0: K, the cycle; with cohorts poisson the b groups, 0: chosen for "
        "the run's ε); with blt its buffers (0: the fewest of 1..4 the optimiser needs)",
        ge=0,
    )
    noise_decay: float = field(
        1.0,
        "λ: the correlated noise is chosen for the iterates of x_t = λ·x_{t−1} + g_t (1: prefix sums; < 1: a "
        "declared per-round contraction, only the last ~1/(1 − λ) rounds' noise matters)",
        gt=0.0,
        le=1.0,
    )
    clip_quantile: float = field(
        0.5, "γ: target fraction of privacy units (users, examples or prompts) under the adaptive bound", gt=0.0, lt=1.0
    )
    clip_lr: float = field(0.2, "η_C: step of the adaptive bound, C ← C·exp(−η_C(b̄ − γ))", gt=0.0)
    clip_budget: float = field(
        0.1, "f: share of each round's (step's) privacy (of μ²) spent on the adaptive clip's count", gt=0.0, lt=1.0
    )
