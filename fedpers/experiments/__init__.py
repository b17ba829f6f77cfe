"""Registry of runnable algorithms (``fedpers run NAME``)."""
from fedpers.experiments.altmin import AltMinExperiment
from fedpers.experiments.base import Evaluator, Experiment
from fedpers.experiments.dpattention import DpAttentionExperiment
from fedpers.experiments.expmech import ExpMechExperiment
from fedpers.experiments.noisygd import NoisyGDExperiment
from fedpers.experiments.noisyhead import NoisyHeadExperiment

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (AltMinExperiment(), NoisyHeadExperiment(), ExpMechExperiment(), NoisyGDExperiment(), DpAttentionExperiment())
}

__all__ = ["EXPERIMENTS", "Evaluator", "Experiment"]
