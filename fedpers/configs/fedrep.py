"""FedRep's config (``fedpers run fedrep``, docs/fedrep.md): its fields, their ranges and the rules across them."""

from __future__ import annotations

import enum

from fedpers.config import DEFAULT_DELTA, MAX_EPSILON, DeviceRunConfig, Neighbours, field, inherited, run_config
from fedpers.configs.gradient_rounds import GradientRoundFields, check_decay, check_settings
from fedpers.configs.privacy import Accountant, accountant_field, check_accountant, check_poisson_accountant
from fedpers.configs.shared import parse_baselines


class VStar(str, enum.Enum):
    SPHERE = "sphere"
    NORMAL = "normal"


@run_config
class FedRepConfig(DeviceRunConfig):
    n_users: int = field(10000, "number of users n (synthetic data)", ge=1)
    dim: int = field(50, "feature dimension d", ge=2)
    rank: int = field(2, "subspace rank k (< d)", ge=1)
    samples_per_user: int = field(5, "training samples per user m", ge=2)
    refit_samples: int = field(5, "samples per user to refit v_j on at the end (local, never sent)", ge=1)
    test_samples: int = field(50, "test samples per user for population_mse", ge=1)
    noise_std: float = field(0.01, "label noise σ_F", ge=0.0)
    v_star: VStar = field(
        VStar.SPHERE,
        "distribution of v*_j: sphere (uniform on the unit sphere, the paper's) or normal (N(0, I_k), AltMin's)",
    )
    epsilon: float = field(
        4.0,
        "user-level ε over init + all rounds (inf: non-private FedRep, no clipping, no noise)",
        gt=0.0,
        le=MAX_EPSILON,
        inf_ok=True,
    )
    delta: float = field(DEFAULT_DELTA, "user-level δ", gt=0.0, lt=1.0)
    rounds: int = field(5, "gradient rounds T after the private initialisation", ge=1)
    learning_rate: float = field(2.5, "server step size η on the mean clipped gradient", gt=0.0)
    clip: float = field(10.0, "C: Frobenius clip of each user's gradient of U", gt=0.0)
    clip_label: float = field(2.0, "c_ζ: label clip of the initialisation, ζ = c_ζ √(k + σ_F²)", gt=0.0)
    cohorts: str = field(
        "all",
        "all: every user every round; poisson: each round samples users independently with probability "
        "--sampling-rate; cyclic: K fixed cohorts by id blocks, round r uses cohort (r − 1) mod K (--cycle)",
    )
    cycle: int = inherited(GradientRoundFields)
    noise: str = inherited(GradientRoundFields)
    bands: int = inherited(GradientRoundFields)
    noise_decay: float = inherited(GradientRoundFields)
    clip_rule: str = field(
        "fixed",
        "fixed: every round clips at --clip; adaptive: --clip is the first bound, moved each round toward the "
        "--clip-quantile of users' gradient norms through a noisy count (accounted)",
    )
    clip_quantile: float = inherited(GradientRoundFields)
    clip_lr: float = inherited(GradientRoundFields)
    clip_budget: float = inherited(GradientRoundFields)
    sampling_rate: float = inherited(GradientRoundFields)
    accountant: str = accountant_field(Accountant.PLD, "privacy accountant (pld is exact for Gaussians; rdp is looser)")
    seed: int = inherited()
    neighbours: Neighbours = inherited()
    device: str = inherited()
    kernels: str = inherited()
    dtype: str = inherited()
    chunk_size: int = field(4096, "users per batch on the local runtime", ge=1)
    baselines: str = field(
        "all", "baselines on the same users: all, none, or a comma list of priv_altmin, nonprivate_altmin"
    )

    def check(self) -> None:
        check_accountant(self.accountant, self.neighbours)
        baseline_names(self.baselines)
        if self.cohorts not in ("all", "poisson", "cyclic"):
            raise ValueError(f"cohorts must be all, poisson or cyclic; got {self.cohorts!r}")
        check_settings(self.cohorts, self.cycle, self.noise, self.bands, self.rounds, self.n_users, self.sampling_rate)
        check_decay(self.noise, self.noise_decay)
        if self.cohorts == "poisson" and not self.sampling_rate < 1.0:
            raise ValueError(f"sampling_rate must be in (0, 1) with cohorts poisson; got {self.sampling_rate}")
        if self.cohorts == "all" and self.sampling_rate != 1.0:
            raise ValueError(f"sampling_rate needs cohorts poisson; got {self.sampling_rate} with cohorts all")
        if self.cohorts == "poisson":
            check_poisson_accountant(self.accountant, "cohorts poisson", self.neighbours)
        if self.clip_rule not in ("fixed", "adaptive"):
            raise ValueError(f"clip_rule must be fixed or adaptive; got {self.clip_rule!r}")
        if self.clip_rule == "adaptive" and self.cohorts == "poisson" and self.noise != "independent":
            raise ValueError(
                "clip_rule adaptive with cohorts poisson and correlated noise is not implemented (the count "
                "releases are not in the amplified analysis); use clip_rule fixed or noise independent"
            )
        if self.rank >= self.dim:
            raise ValueError(f"rank must be < dim={self.dim}; got {self.rank}")
        self.check_device()


BASELINES = ("priv_altmin", "nonprivate_altmin")


def baseline_names(text: str) -> tuple[str, ...]:
    """``all`` | ``none`` | a comma list of :data:`BASELINES` → the names (refused otherwise)."""
    return parse_baselines(text, BASELINES)
