"""``fedpers run dpals``: user-level private ALS for matrix completion (Chien et al. 2021).

One concern a file: :mod:`~fedpers.configs.dpals` the config (re-exported here), :mod:`.data` the
ratings, :mod:`.protocol` the protocol calibrated to (ε, δ), :mod:`.evaluation` what a run measures
and :mod:`.baselines` the tuned non-private ALS it is held against, :mod:`.audit` the audit
canaries, :mod:`.experiment` the experiment."""

from fedpers.configs.dpals import DpAlsConfig, rating_scale
from fedpers.experiments.dpals.audit import CANARY_DESIGN
from fedpers.experiments.dpals.data import center, load_units, n_items, n_users, table
from fedpers.experiments.dpals.evaluation import DpAlsEvaluator
from fedpers.experiments.dpals.experiment import DpAlsExperiment
from fedpers.experiments.dpals.protocol import make_protocol

__all__ = [
    "CANARY_DESIGN",
    "DpAlsConfig",
    "DpAlsEvaluator",
    "DpAlsExperiment",
    "center",
    "load_units",
    "make_protocol",
    "n_items",
    "n_users",
    "rating_scale",
    "table",
]
