"""Registry of runnable algorithms (``fedpers run NAME``)."""
from fedpers.experiments.altmin import AltMinExperiment
from fedpers.experiments.base import Evaluator, Experiment
from fedpers.experiments.noisyhead import NoisyHeadExperiment

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (AltMinExperiment(), NoisyHeadExperiment())}

__all__ = ["EXPERIMENTS", "Evaluator", "Experiment"]
