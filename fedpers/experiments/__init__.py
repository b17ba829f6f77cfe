"""Registry of runnable algorithms (``fedpers run NAME``), imported lazily.

``ALGORITHMS`` names every algorithm and where it lives without importing it (so
``fedpers --help`` starts in a fraction of a second); ``EXPERIMENTS`` and
:func:`experiment` import what is asked for. ``CONFIGS`` names where each built-in algorithm's
config class lives in the light :mod:`fedpers.configs` layer, so :func:`config_type` gives a
run's flags and checks its values without importing torch. An algorithm outside this package (a
plugin, a test's toy) joins with :func:`register`: the entry is a module path and a class name, so
a Flower node process rebuilds it by importing the module itself (:func:`fedpers.app.make_client_app`
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
        "fedpers.experiments.noisyhead",
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

CONFIGS: dict[str, tuple[str, str]] = {
    "altmin": ("fedpers.configs.altmin", "AltMinConfig"),
    "noisyhead": ("fedpers.configs.noisyhead", "NoisyHeadConfig"),
    "expmech": ("fedpers.configs.expmech", "ExpMechConfig"),
    "noisygd": ("fedpers.configs.noisygd", "NoisyGDConfig"),
    "fedrep": ("fedpers.configs.fedrep", "FedRepConfig"),
    "dpattention": ("fedpers.configs.dpattention", "DpAttentionConfig"),
    "dpals": ("fedpers.configs.dpals", "DpAlsConfig"),
}
"""name → (module, class) of the algorithm's config where it can be imported without the experiment
(a module of :mod:`fedpers.configs`: no torch); an algorithm missing here has its experiment's
``config_type`` read instead (:func:`config_type`)."""

_loaded: dict[str, Experiment[Any, Any]] = {}


def register(name: str, module: str, cls: str, description: str, *, config: tuple[str, str] | None = None) -> None:
    """Add algorithm ``name``: class ``cls`` (an :class:`~fedpers.experiments.base.Experiment`) of the
    importable ``module``, described by ``description`` (one line, shown by ``fedpers run --help``).
    ``config``: (module, class) of its config where that module imports nothing heavy, so a bad flag
    or value is refused before the experiment's module is imported (default: the experiment's
    ``config_type``, read by importing ``module``).

    Registering the same entry again does nothing; another entry under a registered name is
    refused (ValueError), so a plugin cannot silently replace an algorithm. Nothing is imported
    until the algorithm is first used."""
    entry = (module, cls, description)
    if not name.isidentifier() or not module or not cls:
        raise ValueError(f"register: name must be an identifier and module/cls non-empty; got {name!r}, {entry[:2]}")
    if ALGORITHMS.get(name, entry) != entry or (config is not None and CONFIGS.get(name, config) != config):
        raise ValueError(
            f"register: algorithm {name!r} is already registered as {ALGORITHMS[name][:2]}; got {entry[:2]}"
        )
    ALGORITHMS[name] = entry
    if config is not None:
        CONFIGS[name] = config


def unregister(name: str) -> None:
    """Remove algorithm ``name`` (a plugin unloading, a test cleaning up); unknown names are ignored."""
    ALGORITHMS.pop(name, None)
    CONFIGS.pop(name, None)
    _loaded.pop(name, None)


def config_type(name: str) -> type[Any]:
    """The config class of algorithm ``name``: from :data:`CONFIGS` where it is named there (imports
    no torch), else its experiment's ``config_type``."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {name!r}")
    if name in CONFIGS:
        module, cls = CONFIGS[name]
        found: type[Any] = getattr(importlib.import_module(module), cls)
        return found
    return experiment(name).config_type


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


__all__ = [
    "ALGORITHMS",
    "CONFIGS",
    "EXPERIMENTS",
    "Evaluator",
    "Experiment",
    "config_type",
    "experiment",
    "register",
    "unregister",
]
