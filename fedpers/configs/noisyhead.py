"""NoisyHead's config (``fedpers run noisyhead``, docs/noisyhead.md): its fields, their ranges and the
rules across them, the §6 regimes and the default demo task, and the enums its protocol shares."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from fedpers.config import (
    DEFAULT_DELTA,
    MAX_EPSILON,
    ApproxDpRunConfig,
    DeviceRunConfig,
    Neighbours,
    check_device_and_dtype,
    check_kernels,
    field,
    inherited,
    run_config,
)
from fedpers.configs.gradient_rounds import GradientRoundFields, check_decay, check_settings
from fedpers.configs.privacy import (
    Accountant,
    Calibration,
    accountant_field,
    check_accountant,
    sampling_accountants,
)
from fedpers.configs.shared import BASELINES_HELP, parse_baselines


class Mode(str, enum.Enum):
    STATISTICS = "statistics"
    ROUNDS = "rounds"


class RidgeScaling(str, enum.Enum):
    """Γ*'s ridge: ``matched`` = 2λN (the minimiser of what GD descends), ``paper`` = λN (eq. 2.7)."""

    MATCHED = "matched"
    PAPER = "paper"

    @property
    def factor(self) -> float:
        return 2.0 if self is RidgeScaling.MATCHED else 1.0


class Regime(str, enum.Enum):
    """The §6 setting that supplies λ, η₀ and T when the config leaves them at 0."""

    LOW_DIM = "low-dim"
    HIGH_DIM = "high-dim"
    EARLY_STOPPING = "early-stopping"
    ROBUSTNESS = "robustness"
    DEMO = "demo"


@dataclass(frozen=True)
class DemoTask:
    """The default task (``--regime demo``, not a setting of the paper): D = 2, L = 20, N = 10,000,
    a ridge λ small enough that Γ* learns (the §6 regimes' λ shrink it to about 0 at these sizes,
    so the zero head is as good) and declared clip/projection bounds near the data's own scale
    (Theorem 4.1's are for its proof and 4-2000× wider), so ε = 1 beats the zero head in seconds."""

    context: int = 20
    ridge_lambda: float = 1e-3
    step_size: float = 2.0
    steps: int = 10
    clip_c: float = 3.0
    proj_g: float = 1.5
    proj_r: float = 5.0


DEMO = DemoTask()


class Unit(str, enum.Enum):
    PROMPT = "prompt"
    USER = "user"


class Init(str, enum.Enum):
    ZERO = "zero"
    GAUSSIAN = "gaussian"


class DataSource(str, enum.Enum):
    SYNTHETIC = "synthetic"
    NEWSGROUPS = "newsgroups"


class AttackNoise(str, enum.Enum):
    """Robustness: the attacked run reuses the clean run's DP noise (shared) or draws its own."""

    SHARED = "shared"
    INDEPENDENT = "independent"


class Engine(str, enum.Enum):
    """Monte-Carlo engine of sweeps: direct (D²×D² matrices, D ≤ 16) or spectral (eigenbasis of A)."""

    AUTO = "auto"
    DIRECT = "direct"
    SPECTRAL = "spectral"


BASELINES = ("ridge", "nonprivate_gd", "zero_head")
"""NoisyHead's baselines: the ridge Γ* of the descended objective, GD without clipping or noise, and Γ = 0."""


def baseline_names(text: str) -> tuple[str, ...]:
    """``all`` | ``none`` | a comma list of :data:`BASELINES` → the names (refused otherwise)."""
    return parse_baselines(text, BASELINES)


@run_config
class NoisyHeadConfig(ApproxDpRunConfig):
    prompts: int = field(10000, "number of training prompts N", ge=1)
    dim: int = field(2, "token dimension D (0: ⌊√N⌋)", ge=0)
    context: int = field(0, f"context length L (0: ⌊√N⌋; {DEMO.context} in the demo regime)", ge=0)
    epsilon: float = field(
        1.0,
        "ε of the whole run for one privacy unit (inf: clipped and projected, no noise)",
        gt=0.0,
        le=MAX_EPSILON,
        inf_ok=True,
    )
    delta: float = field(DEFAULT_DELTA, "δ of the whole run", gt=0.0, lt=1.0)
    steps: int = field(0, "gradient steps T (0: the regime's rule)", ge=0)
    regime: Regime = field(
        Regime.DEMO,
        "the §6 setting that supplies λ, η₀ and T when they are 0 (demo: the default task, not the paper's: "
        "λ, η₀, T, L, C, G and R chosen so that the method visibly learns at ε = 1; the figures use the §6 regimes)",
    )
    mode: Mode = field(
        Mode.STATISTICS, "statistics: clients send Σ vec Z̃ vec Z̃ᵀ, Σ ỹ vec Z̃ once; rounds: T rounds of gradients"
    )
    unit: Unit = field(Unit.PROMPT, "privacy unit: one prompt, or one user's prompts (replace-one)")
    prompts_per_user: int = field(1, "P, prompts per user with --unit user (N must be a multiple of P)", ge=1)
    user_clip: float = field(1.0, "ρ: a user's statistics are clipped to ρ·P times one prompt's bounds", gt=0.0, le=1.0)
    calibration: Calibration = field(
        Calibration.ACCOUNTANT,
        "accountant: smallest noise --accountant certifies for (ε, δ); paper: per-step (ε/T, δ/T) classical Gaussian",
    )
    accountant: str = accountant_field(Accountant.PLD, "accountant for the reported ε (pld is exact for Gaussians)")
    sampling_rate: float = field(
        1.0,
        "q < 1: each step includes every unit (prompt or user) independently with probability q (Poisson; "
        "amplification); needs --mode rounds and --calibration accountant",
        gt=0.0,
        le=1.0,
    )
    cohorts: str = field(
        "all", "all: every unit every step; cyclic: K fixed cohorts of units by id blocks, step t uses cohort t mod K"
    )
    cycle: int = field(1, "K: number of cyclic cohorts (with --cohorts cyclic; needs --mode rounds)", ge=1)
    noise: str = inherited(GradientRoundFields)
    bands: int = inherited(GradientRoundFields)
    noise_decay: float = field(
        0.0,
        "λ_w: the correlated noise is chosen for the iterates of x_t = λ_w·x_{t−1} + g_t; auto (0): GD's own "
        "contraction 1 − 2λη₀ with correlated noise (1 with independent noise); 1: prefix sums",
        ge=0.0,
        le=1.0,
        words={"auto": 0.0},
    )
    clip_rule: str = field(
        "fixed",
        "fixed: every step clips a unit's gradient at ρP·G(C + RG); adaptive (--mode rounds): that is the first "
        "bound, moved each step toward the --clip-quantile of units' gradient norms through a noisy count (accounted)",
    )
    clip_quantile: float = inherited(GradientRoundFields)
    clip_lr: float = field(0.2, "η_C: step of the adaptive bound, B ← B·exp(−η_C(b̄ − γ))", gt=0.0)
    clip_budget: float = inherited(GradientRoundFields)
    label_noise: float = field(0.0, "τ, the label noise std (ν = 1 + τ²)", ge=0.0)
    kappa: float = field(1.0, "κ of Theorem 4.1", gt=0.0, le=1.0)
    clip_c: float = field(0.0, f"label clip C (0: Theorem 4.1; {DEMO.clip_c:g} in the demo regime)", ge=0.0)
    proj_g: float = field(
        0.0, f"feature projection radius G (0: Theorem 4.1; {DEMO.proj_g:g} in the demo regime)", ge=0.0
    )
    proj_r: float = field(
        0.0, f"parameter projection radius R (0: Theorem 4.1; {DEMO.proj_r:g} in the demo regime)", ge=0.0
    )
    ridge_lambda: float = field(0.0, "ridge λ (0: the regime's)", ge=0.0)
    step_size: float = field(0.0, "step size η₀ (0: the regime's rule)", ge=0.0)
    ridge_scaling: RidgeScaling = field(
        RidgeScaling.MATCHED, "Γ*: matched = (2λN I + ΣZZᵀ)⁻¹Σ yZ, the minimiser GD descends; paper = eq. (2.7) with λN"
    )
    init: Init = field(Init.ZERO, "Γ⁰: zero, or 0.1·N(0, I) projected on the R-ball (public randomness)")
    test_prompts: int = field(500, "test prompts for the excess risk and MSE", ge=1)
    baselines: str = field("all", BASELINES_HELP + ", ".join(BASELINES))
    data: DataSource = field(
        DataSource.SYNTHETIC, "synthetic (docs/algorithms.md §2) or newsgroups (§7; needs the 'text' extra)"
    )
    attack_c: float = field(0.0, "robustness (§6.3): one prompt perturbed with α = c·N^p (0: no attack)", ge=0.0)
    attack_p: float = field(2.0, "robustness: p in α = c·N^p")
    attack_mu: float = field(1.0, "robustness: μ, x' = x + μ·1 on every token of the attacked prompt")
    attack_noise: AttackNoise = field(
        AttackNoise.SHARED, "robustness: the attacked run's DP noise is the clean run's (shared) or fresh"
    )
    engine: Engine = field(Engine.AUTO, "sweeps: Monte-Carlo engine (auto: direct for D ≤ 16, else spectral)")
    seed: int = field(0, "run seed (data, test data, init and DP noise use separate generators derived from it)", ge=0)
    neighbours: Neighbours = inherited()
    chunk_size: int = inherited()
    device: str = field("cpu", "torch device: cpu or cuda[:i] (prompts, statistics and steps live there)")
    kernels: str = inherited(DeviceRunConfig)

    def check(self) -> None:
        check_accountant(self.accountant, self.neighbours)
        baseline_names(self.baselines)
        if self.calibration is Calibration.PAPER and self.neighbours is not Neighbours.REPLACE_ONE:
            raise ValueError(
                "calibration paper: the per-step (ε/T, δ/T) rule is stated for replace-one neighbours; use "
                f"calibration accountant with neighbours {self.neighbours.value}"
            )
        check_device_and_dtype(self.device, "float64")
        check_kernels(self.kernels)
        n = self.prompts
        if self.unit is Unit.USER and n % self.prompts_per_user:
            raise ValueError(f"prompts must be a multiple of prompts_per_user={self.prompts_per_user}; got {n}")
        if self.unit is Unit.PROMPT and (self.prompts_per_user != 1 or self.user_clip != 1.0):
            raise ValueError("prompts_per_user and user_clip apply only with --unit user")
        for name in ("clip_c", "proj_g", "proj_r"):
            if math.isinf(getattr(self, name)) and not math.isinf(self.epsilon):
                raise ValueError(f"{name}=inf makes the sensitivity infinite; it is allowed only with epsilon=inf")
        if self.attack_c > 0 and self.data is DataSource.NEWSGROUPS:
            raise ValueError("the robustness attack (attack_c > 0) is defined for synthetic data only")
        if self.data is DataSource.NEWSGROUPS and self.label_noise > 0:
            raise ValueError("label_noise applies to synthetic data only")
        if self.cohorts not in ("all", "cyclic"):
            raise ValueError(f"cohorts must be all or cyclic; got {self.cohorts!r}")
        check_settings(
            "poisson" if self.sampling_rate < 1 else self.cohorts,
            self.cycle,
            self.noise,
            self.bands,
            self.steps or 10**9,  # T from the regime's rule: bands are checked against it when it is resolved
            n // self.prompts_per_user if self.unit is Unit.USER else n,
            self.sampling_rate,
        )
        if self.sampling_rate < 1 and self.noise != "independent" and self.clip_rule == "adaptive":
            raise ValueError(
                "clip_rule adaptive with sampling_rate < 1 and correlated noise is not implemented (the count "
                "releases are not in the amplified analysis); use clip_rule fixed or noise independent"
            )
        if self.noise_decay:  # given (not auto)
            check_decay(self.noise, self.noise_decay)
        if self.clip_rule not in ("fixed", "adaptive"):
            raise ValueError(f"clip_rule must be fixed or adaptive; got {self.clip_rule!r}")
        if self.clip_rule == "adaptive":
            if self.mode is not Mode.ROUNDS:
                raise ValueError(
                    "clip_rule adaptive needs --mode rounds (the statistics mode keeps the analytic bounds, "
                    "which never act there; that is what makes both modes release the same Γ̂)"
                )
            if self.calibration is not Calibration.ACCOUNTANT:
                raise ValueError(
                    "clip_rule adaptive needs calibration accountant (the paper's per-step rule has no count release)"
                )
            if self.attack_c > 0:
                raise ValueError("clip_rule adaptive: the robustness attack replays statistics mode; use a fixed clip")
        if self.cohorts == "cyclic" and (self.mode is not Mode.ROUNDS or self.sampling_rate < 1):
            raise ValueError("cohorts cyclic needs --mode rounds and no --sampling-rate (each step reads its cohort)")
        if self.sampling_rate < 1:
            if self.mode is not Mode.ROUNDS:
                raise ValueError(
                    "sampling_rate < 1 needs mode rounds (each step samples its units; the statistics mode sends them once)"
                )
            if self.calibration is not Calibration.ACCOUNTANT or self.accountant not in sampling_accountants(
                self.neighbours
            ):
                raise ValueError(
                    "sampling_rate < 1 needs calibration accountant and accountant "
                    f"{' or '.join(sampling_accountants(self.neighbours))} "
                    "(the paper's per-step rule has no sampling)"
                )
            if self.attack_c > 0:
                raise ValueError("the robustness attack is defined without sampling (sampling_rate = 1)")
