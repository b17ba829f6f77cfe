"""``fedpers run fedrep`` (docs/fedrep.md): (private) FedRep with a private, accounted initialisation.

One concern a file: :mod:`~fedpers.configs.fedrep` the config (re-exported here), :mod:`.plan` the
users and the protocol calibrated to (ε, δ), :mod:`.evaluation` what a run measures and its
baselines, :mod:`.audit` the audit canaries (steered ones included), :mod:`.experiment` the
experiment."""

from fedpers.configs.fedrep import FedRepConfig
from fedpers.experiments.fedrep.audit import CANARY_DESIGN, fedrep_init_fraction
from fedpers.experiments.fedrep.evaluation import FedRepEvaluator
from fedpers.experiments.fedrep.experiment import FedRepExperiment
from fedpers.experiments.fedrep.plan import load_all, make_protocol, truth

__all__ = [
    "CANARY_DESIGN",
    "FedRepConfig",
    "FedRepEvaluator",
    "FedRepExperiment",
    "fedrep_init_fraction",
    "load_all",
    "make_protocol",
    "truth",
]
