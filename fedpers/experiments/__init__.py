"""Registry of runnable algorithms (``fedpers run NAME``)."""
from fedpers.experiments.altmin import AltMinExperiment
from fedpers.experiments.base import Evaluator, Experiment
from fedpers.experiments.expmech import ExpMechExperiment

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (AltMinExperiment(), ExpMechExperiment())}

__all__ = ["EXPERIMENTS", "Evaluator", "Experiment"]
