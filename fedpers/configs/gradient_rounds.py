"""The flags the gradient-round algorithms (FedRep, NoisyGD, NoisyHead in rounds mode) declare alike:
cyclic cohorts, correlated noise across rounds and the adaptive clip.

Each field is declared once here (default, help text, range); a config lists it with
``name: type = inherited(GradientRoundFields)``, so the three ``--help`` texts cannot drift apart.
A flag whose meaning differs between the algorithms (NoisyHead's cycle needs ``--mode rounds``, its
noise decay defaults to GD's own contraction, its bound is B) stays declared by that algorithm.
The checks across these fields (:func:`check_settings`, :func:`check_decay`) live here too: pure
Python, so every bad value is refused before torch is imported."""

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


NOISE_KINDS = ("independent", "banded", "optimised", "blt")
"""The strategies of correlated noise across rounds (fedpers.privacy.correlated)."""


def check_settings(
    cohorts: str, cycle: int, noise: str, bands: int, rounds: int, units: int, sampling_rate: float = 1.0
) -> None:
    """Refuse (before any release) a cycle or noise setting the run cannot account."""
    if cohorts != "cyclic" and cycle != 1:
        raise ValueError(f"cycle needs cohorts cyclic; got cycle {cycle} with cohorts {cohorts}")
    if cohorts == "cyclic" and not 1 <= cycle <= units:
        raise ValueError(f"cycle must be in [1, {units}] (the number of units); got {cycle}")
    if noise not in NOISE_KINDS:
        raise ValueError(f"noise must be one of {', '.join(NOISE_KINDS)}; got {noise!r}")
    if noise == "blt" and cohorts == "poisson":
        raise ValueError(
            "noise: blt with cohorts poisson: the amplified analysis (Choquette-Choo et al. 2023) covers banded C "
            "only, and a BLT's C is not banded; use noise banded or optimised (amplified), or cohorts cyclic"
        )
    if noise != "independent" and cohorts == "poisson" and bands and sampling_rate * bands > 1.0 + 1e-9:
        raise ValueError(
            f"bands must be <= 1/sampling_rate = {1.0 / sampling_rate:.6g} with cohorts poisson (each of the b "
            f"groups is sampled at sampling_rate × b); got {bands}"
        )
    if noise == "independent" and bands not in (0, 1):
        raise ValueError(f"bands needs noise banded, optimised or blt; got bands {bands} with noise independent")
    if bands > rounds:
        raise ValueError(f"bands must be in [0, rounds={rounds}]; got {bands}")


def check_decay(noise: str, decay: float) -> None:
    """Refuse a workload decay outside (0, 1], or one given with independent noise (it would choose nothing)."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"noise_decay must be in (0, 1]; got {decay}")
    if decay != 1.0 and noise == "independent":
        raise ValueError(
            f"noise_decay needs noise banded, optimised or blt; got noise_decay {decay} with noise independent"
        )
