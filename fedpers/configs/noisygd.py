"""NoisyGD's config (``fedpers run noisygd``, docs/algorithms.md §3): its fields, their ranges and the
rules across them, and the enums its protocol and data model share."""

from __future__ import annotations

import enum

from fedpers.config import DEFAULT_DELTA, MAX_EPSILON, DeviceRunConfig, Neighbours, field, inherited, run_config
from fedpers.configs.gradient_rounds import GradientRoundFields, check_decay, check_settings
from fedpers.configs.privacy import Accountant, accountant_field, check_accountant, check_poisson_accountant
from fedpers.configs.shared import BASELINES_HELP, parse_baselines


class Remedy(str, enum.Enum):
    NONE = "none"
    CENTER = "center"
    PCA = "pca"


class Loss(str, enum.Enum):
    CE = "ce"
    SQUARED = "squared"


class Collapse(str, enum.Enum):
    PERFECT = "perfect"
    OFFSET = "offset"
    RANDOM = "random"


BASELINES = ("chance", "nonprivate_gd")
"""NoisyGD's baselines: the most frequent class, and GD on the same data without clipping or noise."""


def baseline_names(text: str) -> tuple[str, ...]:
    """``all`` | ``none`` | a comma list of :data:`BASELINES` → the names (refused otherwise)."""
    return parse_baselines(text, BASELINES)


@run_config
class NoisyGDConfig(DeviceRunConfig):
    classes: int = field(10, "number of classes K", ge=2)
    feature_dim: int = field(100, "feature dimension p (>= K)", ge=2)
    examples: int = field(10000, "training examples n (the privacy units)", ge=1)
    epsilon: float = field(
        1.0, "example-level ε over the whole run (inf: clipped, no noise)", gt=0.0, le=MAX_EPSILON, inf_ok=True
    )
    delta: float = field(DEFAULT_DELTA, "example-level δ", gt=0.0, lt=1.0)
    steps: int = field(30, "NoisyGD steps T (full batch)", ge=1)
    lr: float = field(0.01, "step size η: W ← W − η(Σ_i clip(∇ℓ_i) + noise)", gt=0.0)
    grad_clip: float = field(1.0, "per-example gradient clip G_c", gt=0.0)
    loss: Loss = field(Loss.CE, "ce: cross-entropy; squared: ½||Wx − e_y||²")
    collapse: Collapse = field(
        Collapse.PERFECT, "training features: perfect ETF, a fixed offset ±β, or random ±β per example"
    )
    beta: float = field(0.1, "β = ||v||_∞ of the offset / random perturbation (collapse offset|random)", ge=0.0)
    imbalance: float = field(
        1.0, "α: class sizes ∝ α^{k/(K−1)} (1: balanced; smallest/largest class = α)", gt=0.0, le=1.0
    )
    test_perturbation: float = field(0.0, "β₂: random ±β₂ per coordinate added to every test feature", ge=0.0)
    remedy: Remedy = field(
        Remedy.NONE, "none; center: subtract a DP mean; pca: project on the top K−1 DP-PCA directions"
    )
    remedy_budget: float = field(
        0.2, "share of the privacy budget (of ρ, i.e. of μ²) spent on the remedy's release", gt=0.0, lt=1.0
    )
    feature_bound: float = field(
        0.0, "R: feature clip for the remedy's release (0: 1 + √p·β, the bound the data model implies)", ge=0.0
    )
    cohorts: str = field(
        "all",
        "all: every example every step; poisson: each step samples examples independently with probability "
        "--sampling-rate; cyclic: K fixed cohorts by id blocks, step s uses cohort s mod K",
    )
    cycle: int = inherited(GradientRoundFields)
    sampling_rate: float = inherited(GradientRoundFields)
    noise: str = inherited(GradientRoundFields)
    bands: int = inherited(GradientRoundFields)
    noise_decay: float = inherited(GradientRoundFields)
    clip_rule: str = field(
        "fixed",
        "fixed: every step clips at --grad-clip; adaptive: --grad-clip is the first bound, moved each step toward "
        "the --clip-quantile of per-example gradient norms through a noisy count (accounted)",
    )
    clip_quantile: float = inherited(GradientRoundFields)
    clip_lr: float = inherited(GradientRoundFields)
    clip_budget: float = inherited(GradientRoundFields)
    accountant: str = accountant_field(
        Accountant.PLD, "pld: tight; zcdp: T steps are Tρ-zCDP, ε = ρ + 2√(ρ log 1/δ) (the paper's)"
    )
    test_examples: int = field(2000, "test examples (same class proportions as training)", ge=1)
    baselines: str = field("all", BASELINES_HELP + ", ".join(BASELINES) + " (non-private GD: no clip, no noise)")
    seed: int = inherited()
    neighbours: Neighbours = inherited()
    device: str = inherited()
    kernels: str = inherited()
    dtype: str = field("float32", "float32 or float64 for features and W")
    chunk_size: int = field(4096, "examples per batch on the local runtime (bounds memory)", ge=1)

    def check(self) -> None:
        check_accountant(self.accountant, self.neighbours)
        baseline_names(self.baselines)
        if self.feature_dim < self.classes:
            raise ValueError(
                f"feature_dim must be >= classes={self.classes} (a K-simplex ETF needs p ≥ K); got {self.feature_dim}"
            )
        if self.examples < self.classes:
            raise ValueError(f"examples must be >= classes={self.classes}; got {self.examples}")
        if self.cohorts not in ("all", "cyclic", "poisson"):
            raise ValueError(f"cohorts must be all, cyclic or poisson; got {self.cohorts!r}")
        check_settings(self.cohorts, self.cycle, self.noise, self.bands, self.steps, self.examples, self.sampling_rate)
        check_decay(self.noise, self.noise_decay)
        if self.clip_rule not in ("fixed", "adaptive"):
            raise ValueError(f"clip_rule must be fixed or adaptive; got {self.clip_rule!r}")
        if self.cohorts == "poisson":
            if not self.sampling_rate < 1.0:
                raise ValueError(f"sampling_rate must be in (0, 1) with cohorts poisson; got {self.sampling_rate}")
            check_poisson_accountant(self.accountant, "cohorts poisson", self.neighbours)
            if self.clip_rule == "adaptive":
                raise ValueError(
                    "clip_rule adaptive with cohorts poisson is not implemented for noisygd (its count releases "
                    "are not accounted on the sample); use clip_rule fixed"
                )
        elif self.sampling_rate != 1.0:
            raise ValueError(
                f"sampling_rate needs cohorts poisson; got {self.sampling_rate} with cohorts {self.cohorts}"
            )
        self.check_device()
