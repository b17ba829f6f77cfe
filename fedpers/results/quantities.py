"""What each figure a run reports is, in words: its label, its definition, its unit and its kind.

Every view (the CLI summary, ``fedpers compare``, the HTML report, sweep and compare figures) names a
figure by its :class:`Quantity`: the label heads a table column or an axis, the definition is the
column's footnote, the unit goes into the axis label, and the kind decides where the figure goes:

- ``METRIC`` (lower is better) and ``SCORE`` (in [0, 1], higher is better): a column of the metrics
  table, one row per run (the private run, each baseline); a y-axis of a figure.
- ``BOUND``: a theorem's bound on a metric (``bounds`` names it): a row of the table under that
  metric's column, labelled with the theorem.
- ``DETAIL``: a count, a derived setting or a yes/no check: the separate block of run details.

:data:`SHARED` defines the figures several algorithms report alike; an algorithm adds or overrides
entries in its experiment's ``quantities``. A key found nowhere is shown under its own name, as a
metric if it is a number.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass


class Kind(str, enum.Enum):
    METRIC = "metric"
    SCORE = "score"
    BOUND = "bound"
    DETAIL = "detail"


@dataclass(frozen=True)
class Quantity:
    """One figure: ``label`` (a few words, a column header or an axis label), ``definition`` (one
    line: how it is computed), ``unit`` (an axis label's unit; empty for a pure number), ``kind`` (where
    a view puts it) and, for a bound, the metric it ``bounds``."""

    label: str
    definition: str = ""
    kind: Kind = Kind.METRIC
    unit: str = ""
    bounds: str = ""

    @property
    def higher_is_better(self) -> bool:
        return self.kind is Kind.SCORE

    @property
    def axis_label(self) -> str:
        """The label with its unit, as an axis shows it."""
        return f"{self.label} ({self.unit})" if self.unit else self.label


SHARED: dict[str, Quantity] = {
    # the subspace problems (altmin, expmech, fedrep)
    "subspace_error": Quantity(
        "subspace error", "‖(I − U*U*ᵀ)U‖_F: distance of the released subspace U from the true U* (0: equal)"
    ),
    "subspace_error_spectral": Quantity(
        "subspace error, spectral", "‖(I − U*U*ᵀ)U‖₂: the sine of the largest principal angle between U and U*"
    ),
    "excess_risk": Quantity(
        "excess risk", "mean over users of ‖U v_j − U* v*_j‖²: each user's population risk above the noise σ_F²"
    ),
    "test_mse": Quantity("test MSE", "mean squared error of each user's model on held-out samples"),
    "population_mse": Quantity(
        "population MSE", "mean over users of the test MSE after refitting v_j on fresh samples with the released U"
    ),
    "candidates": Quantity("candidates", "candidate subspaces the exponential mechanism chose among", Kind.DETAIL),
    # classification (noisygd)
    "accuracy": Quantity("accuracy", "fraction of test examples classified correctly", Kind.SCORE),
    "balanced_accuracy": Quantity("balanced accuracy", "mean over classes of each class's accuracy", Kind.SCORE),
    # figures every run has
    "epsilon": Quantity(
        "ε spent", "the ε the accountant gives the releases the run made (not its target)", Kind.DETAIL
    ),
    "target_epsilon": Quantity("target ε", "the ε the noise was calibrated for", Kind.DETAIL),
    "delta": Quantity("δ", "the δ of the (ε, δ) guarantee", Kind.DETAIL),
    "noise_multiplier": Quantity("noise multiplier z", "z = 2σ/Δ: noise std over half the sensitivity", Kind.DETAIL),
    "seconds": Quantity("time", "wall time of the run", Kind.DETAIL, unit="s"),
    "modular_wraps": Quantity(
        "modular wraps", "coordinates of a modular sum that wrapped (distributed DP)", Kind.DETAIL
    ),
    "suspected_wraps": Quantity(
        "suspected wraps", "coordinates of a modular sum near its range's edge (distributed DP)", Kind.DETAIL
    ),
    # a baseline's own figures beside its metrics
    "samples_used": Quantity("samples used", "samples per user the baseline fit on", Kind.DETAIL),
    "rounds": Quantity("rounds", "rounds the baseline ran until it converged", Kind.DETAIL),
    "ridge": Quantity("ridge λ", "the baseline's ridge, tuned on a validation split", Kind.DETAIL),
}
"""The figures several algorithms report with one meaning (an algorithm overrides one whose meaning differs)."""


FIELD_LABELS: dict[str, str] = {
    "n_users": "users n",
    "epsilon": "target ε",
    "delta": "δ",
    "dim": "dimension d",
    "rank": "rank k",
    "samples_per_user": "samples per user m",
    "rounds": "rounds T",
    "steps": "steps T",
    "prompts": "prompts N",
    "context": "context length L",
    "examples": "examples n",
    "feature_dim": "feature dimension p",
    "columns": "columns d",
    "rows": "rows n",
    "n_items": "items",
    "noise_std": "label noise σ_F",
    "clip_model": "model clip c_η",
    "clip_label": "label clip c_ζ",
    "bits": "bits per coordinate",
    "nodes": "nodes",
    "min_nodes": "minimum nodes",
    "sampling_rate": "sampling rate q",
    "cycle": "cohorts K",
    "bands": "bands b",
    "calibration": "calibration",
    "dp_model": "trust model",
    "noise": "noise across rounds",
}
"""Axis and legend labels of config fields a sweep varies (a field not here is shown by its name)."""


def field_label(name: str) -> str:
    """How an axis or a legend names config field ``name``."""
    return FIELD_LABELS.get(name, name.replace("_", " "))


def quantity(key: str, own: Mapping[str, Quantity] | None = None) -> Quantity:
    """The figure ``key`` as ``own`` (an algorithm's) or :data:`SHARED` defines it; else its own name,
    a metric."""
    if own is not None and key in own:
        return own[key]
    if key in SHARED:
        return SHARED[key]
    return Quantity(key.replace("_", " "))
