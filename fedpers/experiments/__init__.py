"""Registry of runnable algorithms (``fedpers run NAME``), imported lazily.

``ALGORITHMS`` names every algorithm and where it lives without importing it (so
``fedpers --help`` starts in a fraction of a second); ``EXPERIMENTS`` and
:func:`experiment` import what is asked for. An algorithm outside this package (a plugin, a
test's toy) joins with :func:`register`: the entry is a module path and a class name, so a
Flower node process rebuilds it by importing the module itself (:func:`fedpers.app.make_client_app`
carries the entry of the algorithm it runs).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedpers.experiments.base import Evaluator, Experiment

ALGORITHMS: dict[str, tuple[str, str, str]] = {
    "altmin": (
        "fedpers.experiments.altmin",
        "AltMinExperiment",
        "User-level private alternating minimisation with private initialisation (docs/algorithms.md §1)",
    ),
    "noisyhead": (
        "fedpers.experiments.noisyhead_mc",
        "NoisyHeadMonteCarloExperiment",
        "NoisyHead: DP pretraining of a linear attention head (docs/algorithms.md §2)",
    ),
    "expmech": (
        "fedpers.experiments.expmech",
        "ExpMechExperiment",
        "User-level ε-DP selection of U by the exponential mechanism (Algorithm 4)",
    ),
    "noisygd": (
        "fedpers.experiments.noisygd",
        "NoisyGDExperiment",
        "NoisyGD for last-layer fine-tuning under neural collapse (docs/algorithms.md §3)",
    ),
    "fedrep": (
        "fedpers.experiments.fedrep",
        "FedRepExperiment",
        "Private FedRep: clipped user gradients of U, private accounted init (Snedeker et al. 2025)",
    ),
    "dpattention": (
        "fedpers.experiments.dpattention",
        "DpAttentionExperiment",
        "DP attention computation by DPCovariance (docs/algorithms.md §4)",
    ),
    "dpals": (
        "fedpers.experiments.dpals",
        "DpAlsExperiment",
        "User-level private alternating least squares for matrix completion (Chien et al. 2021)",
    ),
}
"""name → (module, class, one-line description)."""

_loaded: dict[str, Experiment[Any, Any]] = {}


def register(name: str, module: str, cls: str, description: str) -> None:
    """Add algorithm ``name``: class ``cls`` (an :class:`~fedpers.experiments.base.Experiment`) of the
    importable ``module``, described by ``description`` (one line, shown by ``fedpers run --help``).

    Registering the same entry again does nothing; another entry under a registered name is
    refused (ValueError), so a plugin cannot silently replace an algorithm. Nothing is imported
    until the algorithm is first used."""
    entry = (module, cls, description)
    if not name.isidentifier() or not module or not cls:
        raise ValueError(f"register: name must be an identifier and module/cls non-empty; got {name!r}, {entry[:2]}")
    if ALGORITHMS.get(name, entry) != entry:
        raise ValueError(
            f"register: algorithm {name!r} is already registered as {ALGORITHMS[name][:2]}; got {entry[:2]}"
        )
    ALGORITHMS[name] = entry


def unregister(name: str) -> None:
    """Remove algorithm ``name`` (a plugin unloading, a test cleaning up); unknown names are ignored."""
    ALGORITHMS.pop(name, None)
    _loaded.pop(name, None)


def experiment(name: str) -> Experiment[Any, Any]:
    """The registered experiment ``name`` (its module is imported on first use)."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {name!r}")
    if name not in _loaded:
        module, cls, _ = ALGORITHMS[name]
        _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]


def __getattr__(attr: str) -> Any:
    if attr == "EXPERIMENTS":
        return {name: experiment(name) for name in ALGORITHMS}
    if attr in ("Evaluator", "Experiment"):
        from fedpers.experiments import base

        return getattr(base, attr)
    raise AttributeError(attr)


__all__ = ["ALGORITHMS", "EXPERIMENTS", "Evaluator", "Experiment", "experiment", "register", "unregister"]
