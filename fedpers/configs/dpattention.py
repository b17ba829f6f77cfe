"""DP attention's config (``fedpers run dpattention``, docs/algorithms.md §4): its fields and ranges."""

from __future__ import annotations

import enum

from fedpers.config import DEFAULT_DELTA, ApproxDpRunConfig, DeviceRunConfig, Neighbours, field, inherited, run_config


class AttentionFn(str, enum.Enum):
    EXP = "exp"
    COSH = "cosh"


@run_config
class DpAttentionConfig(ApproxDpRunConfig):
    rows: int = field(4, "n: rows of X (the attention matrix is n×n)", ge=1)
    columns: int = field(10000, "d: columns of X (the privacy units, d ≫ n)", ge=1)
    k: int = field(0, "Gaussian samples in DPCovariance (0: the smallest k with ρ < 0.1ε)", ge=0)
    epsilon: float = field(0.09, "ε of the (ε, δ) guarantee (Theorem 3.1 needs ε < 0.1)", gt=0.0)
    delta: float = field(DEFAULT_DELTA, "δ (Theorem 3.1 needs δ < 0.1)", gt=0.0, lt=1.0)
    beta: float = field(1e-6, "β: neighbouring X differ in one column, moved by at most β", gt=0.0)
    f: AttentionFn = field(AttentionFn.EXP, "entrywise function of the attention: exp or cosh")
    r: float = field(0.05, "promise ||A||_∞ = max|A_ij| ≤ r (Theorem 3.1 needs r < 0.1)", gt=0.0)
    alpha: float = field(
        0.0, "α: column-norm bound, each column clipped to it (0: the synthetic columns' norm sqrt(s·n/d))", ge=0.0
    )
    eta: float = field(
        0.0, "promise XXᵀ ⪰ ηI (0: half the synthetic data's expected λ_min, s(1 − sqrt(n/d))²/2)", ge=0.0
    )
    data_scale: float = field(0.025, "s: the synthetic columns are uniform on a sphere with E[XXᵀ] = s·I", gt=0.0)
    gamma: float = field(0.1, "γ: the utility bound holds with probability 1 − γ", gt=0.0, lt=1.0)
    seed: int = inherited()
    neighbours: Neighbours = inherited()
    dtype: str = inherited(DeviceRunConfig)
    chunk_size: int = field(65536, "columns per batch on the local runtime", ge=1)

    def check(self) -> None:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64; got {self.dtype!r}")
        if self.neighbours is not Neighbours.REPLACE_ONE:
            raise ValueError(
                f"neighbours must be replace-one for dpattention (DPCovariance's (ε, δ) is stated for one column "
                f"moved by at most β, not for adding or removing a column); got {self.neighbours.value}"
            )
