"""``fedpers run noisyhead`` (docs/algorithms.md §2): prompt-level DP pretraining of a linear attention head.

One concern a file: :mod:`~fedpers.configs.noisyhead` the config (re-exported here), :mod:`.data`
the prompts, :mod:`.protocol` the numbers resolved from the config and the protocol calibrated to
(ε, δ), :mod:`.evaluation` what a run measures, :mod:`.audit` the audit canaries,
:mod:`.experiment` the experiment; Monte-Carlo sweeps: :mod:`.montecarlo` (batched statistics),
:mod:`.sweep` (a sweep point, and :class:`NoisyHeadMonteCarloExperiment`, the registered experiment)
and :mod:`.figures`."""

from fedpers.configs.noisyhead import NoisyHeadConfig
from fedpers.experiments.noisyhead.audit import CANARY_DESIGN
from fedpers.experiments.noisyhead.data import load_units, sherman_morrison_replace
from fedpers.experiments.noisyhead.evaluation import NoisyHeadEvaluator
from fedpers.experiments.noisyhead.experiment import NoisyHeadExperiment
from fedpers.experiments.noisyhead.protocol import Resolved, make_protocol, resolve, step_event
from fedpers.experiments.noisyhead.sweep import NoisyHeadMonteCarloExperiment, sweep_point

__all__ = [
    "CANARY_DESIGN",
    "NoisyHeadConfig",
    "NoisyHeadEvaluator",
    "NoisyHeadExperiment",
    "NoisyHeadMonteCarloExperiment",
    "Resolved",
    "load_units",
    "make_protocol",
    "resolve",
    "sherman_morrison_replace",
    "step_event",
    "sweep_point",
]
