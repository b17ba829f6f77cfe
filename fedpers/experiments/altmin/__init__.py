"""``fedpers run altmin``: user-level private AltMin (docs/algorithms.md §1) with its baselines.

One concern a file: :mod:`~fedpers.configs.altmin` the config (re-exported here), :mod:`.plan` the
data and memory of a run, :mod:`.protocol` the protocol calibrated to (ε, δ), :mod:`.evaluation`
what a run measures and its baselines, :mod:`.audit` the audit canaries, :mod:`.tuning` the private
scores, :mod:`.experiment` the experiment that ties them together. What another algorithm uses is
imported from this package's face (the names below), never from its modules."""

from fedpers.configs.altmin import BASELINES, AltMinConfig
from fedpers.experiments.altmin.audit import CANARY_DESIGN
from fedpers.experiments.altmin.evaluation import AltMinEvaluator, Fit, Scores
from fedpers.experiments.altmin.experiment import AltMinExperiment
from fedpers.experiments.altmin.plan import (
    BLOCK_COHORTS_FROM,
    AltMinPlan,
    AltMinSource,
    clip_bounds,
    cohort_block,
    load_units,
    resolve,
    resolve_plan,
    truth,
    unit_source,
)
from fedpers.experiments.altmin.protocol import make_protocol, paper_epsilon
from fedpers.experiments.altmin.tuning import PRIVATE_SCORES

__all__ = [
    "BASELINES",
    "BLOCK_COHORTS_FROM",
    "CANARY_DESIGN",
    "PRIVATE_SCORES",
    "AltMinConfig",
    "AltMinEvaluator",
    "AltMinExperiment",
    "AltMinPlan",
    "AltMinSource",
    "Fit",
    "Scores",
    "clip_bounds",
    "cohort_block",
    "load_units",
    "make_protocol",
    "paper_epsilon",
    "resolve",
    "resolve_plan",
    "truth",
    "unit_source",
]
