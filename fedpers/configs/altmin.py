"""AltMin's config (``fedpers run altmin``, docs/algorithms.md §1): its fields, their ranges and the
rules across them, and the enums its protocol shares."""

from __future__ import annotations

import enum
from pathlib import Path

from fedpers.config import DEFAULT_DELTA, MAX_EPSILON, DeviceRunConfig, Neighbours, field, inherited, run_config
from fedpers.configs.privacy import (
    Accountant,
    Calibration,
    accountant_field,
    check_accountant,
    check_poisson_accountant,
)
from fedpers.configs.shared import is_long_format, parse_baselines


class Cohorts(str, enum.Enum):
    DISJOINT = "disjoint"
    ALL = "all"
    POISSON = "poisson"


class PsdMethod(str, enum.Enum):
    """How a noisy (possibly indefinite) A is made positive definite before the solve."""

    EIGEN_FLOOR = "eigen_floor"
    RIDGE = "ridge"


@run_config
class AltMinConfig(DeviceRunConfig):
    n_users: int = field(50000, "number of users n (synthetic data)", ge=1)
    dim: int = field(10, "feature dimension d", ge=2)
    rank: int = field(2, "subspace rank k (< d)", ge=1)
    samples_per_user: int = field(16, "samples per user m (a multiple of 4)", ge=4)
    noise_std: float = field(0.1, "label noise σ_F", ge=0.0)
    epsilon: float = field(
        4.0, "user-level ε over the whole run (inf: clipped, no noise)", gt=0.0, le=MAX_EPSILON, inf_ok=True
    )
    delta: float = field(DEFAULT_DELTA, "user-level δ", gt=0.0, lt=1.0)
    rounds: int = field(2, "AltMin rounds T after the private initialisation", ge=1)
    cohorts: Cohorts = field(
        Cohorts.DISJOINT,
        "disjoint: each user in one round (parallel composition); all: every round; poisson: each round "
        "samples users independently with probability --sampling-rate (amplification)",
    )
    sampling_rate: float = field(
        1.0, "q: Poisson inclusion probability per round (with --cohorts poisson)", gt=0.0, le=1.0
    )
    cohort_block: int = field(
        0,
        "disjoint cohorts permute runs of this many consecutive user ids (1: single users); 0: auto, "
        "1,024 (a generation block) for synthetic users from 65,536 users up, else 1",
        ge=0,
    )
    clip_model: float = field(0.7, "c_η: model clip η = c_η √(dk)", gt=0.0)
    clip_label: float = field(2.0, "c_ζ: label clip ζ = c_ζ √(k + σ_F²)", gt=0.0)
    psd: PsdMethod = field(PsdMethod.EIGEN_FLOOR, "how noisy A is made positive definite")
    clip_rule: str = field(
        "fixed",
        "fixed: every round clips at η and ζ; adaptive: they are round 1's bounds, each moved every round toward "
        "its quantile (--clip-quantile, --label-clip-quantile) through a noisy count (accounted)",
    )
    clip_quantile: float = field(
        0.5, "γ_η: target fraction of Q2 samples with ‖v_j‖‖x_ij‖ within the adaptive η", gt=0.0, lt=1.0
    )
    label_clip_quantile: float = field(0.9, "γ_ζ: target fraction of Q2 labels within the adaptive ζ", gt=0.0, lt=1.0)
    clip_lr: float = field(0.2, "η_C: step of the adaptive bounds, η ← η·exp(−η_C(b̄ − γ_η)) (ζ alike)", gt=0.0)
    clip_budget: float = field(
        0.05, "f_A: share of each round's privacy (of μ²) spent on the adaptive η's count", gt=0.0, lt=1.0
    )
    label_clip_budget: float = field(
        0.05, "f_b: share of each round's privacy (of μ²) spent on the adaptive ζ's count", gt=0.0, lt=1.0
    )
    accountant: str = accountant_field(Accountant.PLD, "privacy accountant (pld is exact for Gaussians; rdp is looser)")
    seed: int = field(0, "run seed (data, cohorts and DP noise use separate generators derived from it)", ge=0)
    neighbours: Neighbours = inherited()
    device: str = inherited()
    dtype: str = inherited()
    kernels: str = inherited()
    data: Path | None = field(
        None,
        "per-user data file instead of synthetic data: .npz (fixed shape) or .parquet/.csv (one row per sample; schema in the README)",
    )
    user_column: str = field("user", "user column of a .parquet/.csv data file")
    label_column: str = field("y", "label column of a .parquet/.csv data file")
    feature_columns: str = field(
        "", "comma list of feature columns of a .parquet/.csv data file (empty: every other numeric column)"
    )
    max_samples_per_user: int = field(
        64,
        "per-user cap on kept samples of a .parquet/.csv file (a multiple of 4; the declared bound: more are subsampled)",
        ge=4,
    )
    min_samples_per_user: int = field(
        4, "users of a .parquet/.csv file with fewer kept samples contribute nothing (counted in the result)", ge=1
    )
    test_fraction: float = field(
        0.2, "per-user fraction of a .parquet/.csv file's rows held out for test_mse (seeded)", ge=0.0, lt=1.0
    )
    chunk_size: int = field(
        4096,
        "users per batch on the local runtime (bounds memory; auto or 0: from the memory available)",
        ge=0,
        words={"auto": 0},
    )
    baselines: str = field(
        "all",
        "baselines to run: all, none, or a comma list of nonprivate_altmin, clipped_no_noise, local_only, private_init_only, oracle",
    )
    calibration: Calibration = field(
        Calibration.ACCOUNTANT,
        "accountant: the smallest noise --accountant certifies for (ε, δ); paper: Theorem 4.2's σ/Δ = √(8(1+T_u) log(1/δ))/ε (T_u: rounds a user is in)",
    )
    refit_samples: int = field(
        0,
        "R fresh samples per user to refit v_j on with the released U (local, never sent); with --test-samples: population_mse",
        ge=0,
    )
    test_samples: int = field(0, "S fresh test samples per user for population_mse (as run fedrep reports it)", ge=0)

    def check(self) -> None:
        check_accountant(self.accountant, self.neighbours)
        if self.calibration is Calibration.PAPER and self.neighbours is not Neighbours.REPLACE_ONE:
            raise ValueError(
                "calibration paper: Theorem 4.2's rule is stated for replace-one neighbours; use calibration "
                f"accountant with neighbours {self.neighbours.value}"
            )
        baseline_names(self.baselines)
        if (self.refit_samples > 0) != (self.test_samples > 0):
            raise ValueError(
                f"refit_samples and test_samples go together (population_mse needs both); got {self.refit_samples} and {self.test_samples}"
            )
        if self.refit_samples and self.data is not None:
            raise ValueError(
                "refit_samples/test_samples draw fresh samples from the synthetic model; with --data hold samples out in x_test/y_test instead"
            )
        if self.samples_per_user % 4:
            raise ValueError(f"samples_per_user must be a multiple of 4; got {self.samples_per_user}")
        if self.max_samples_per_user % 4:
            raise ValueError(f"max_samples_per_user must be a multiple of 4; got {self.max_samples_per_user}")
        if self.min_samples_per_user > self.max_samples_per_user:
            raise ValueError(
                f"min_samples_per_user must be <= max_samples_per_user={self.max_samples_per_user}; got {self.min_samples_per_user}"
            )
        if self.data is not None and is_long_format(self.data) and self.test_fraction == 0:
            raise ValueError(
                "test_fraction must be > 0 with a .parquet/.csv data file (it has no true U*; test_mse is what is measured)"
            )
        if self.data is None or not is_long_format(self.data):
            defaults = AltMinConfig.__dataclass_fields__
            for name in LONG_FORMAT_FIELDS:
                if getattr(self, name) != defaults[name].default:
                    raise ValueError(f"{name} applies to .parquet/.csv data files only (got data={self.data})")
        if self.rank >= self.dim:
            raise ValueError(f"rank must be < dim={self.dim}; got {self.rank}")
        if self.clip_rule not in ("fixed", "adaptive"):
            raise ValueError(f"clip_rule must be fixed or adaptive; got {self.clip_rule!r}")
        if self.clip_rule == "adaptive":
            if not self.clip_budget + self.label_clip_budget < 1.0:
                raise ValueError(
                    "clip_budget + label_clip_budget must be < 1 (A and b keep the rest of each round's privacy); "
                    f"got {self.clip_budget} + {self.label_clip_budget}"
                )
            if self.calibration is Calibration.PAPER:
                raise ValueError(
                    "clip_rule adaptive: calibration paper has no rule for the count releases; use calibration accountant"
                )
        if self.cohorts is Cohorts.DISJOINT and self.n_users < self.rounds:
            raise ValueError(f"n_users must be >= rounds={self.rounds} for disjoint cohorts; got {self.n_users}")
        if self.cohorts is Cohorts.POISSON:
            if not self.sampling_rate < 1.0:
                raise ValueError(f"sampling_rate must be in (0, 1) with cohorts poisson; got {self.sampling_rate}")
            check_poisson_accountant(self.accountant, "cohorts poisson", self.neighbours)
            if self.calibration is Calibration.PAPER:
                raise ValueError(
                    "calibration paper has no rule for Poisson sampling; use calibration accountant with cohorts poisson"
                )
        elif self.sampling_rate != 1.0:
            raise ValueError(
                f"sampling_rate needs cohorts poisson; got {self.sampling_rate} with cohorts {self.cohorts.value}"
            )
        self.check_device()


LONG_FORMAT_FIELDS = (
    "user_column",
    "label_column",
    "feature_columns",
    "max_samples_per_user",
    "min_samples_per_user",
    "test_fraction",
)
BASELINES = ("nonprivate_altmin", "clipped_no_noise", "local_only", "private_init_only", "oracle")


def baseline_names(text: str) -> tuple[str, ...]:
    """``all`` | ``none`` | a comma list of :data:`BASELINES` → the names (refused otherwise)."""
    return parse_baselines(text, BASELINES)
