"""The Flower series whose private internals :mod:`fedpers.deploy` patches, and the gate that refuses others.

What is patched (all of it in this package): ``run_superexec.get_executor`` and
``run_clientapp.run_clientapp`` / ``install_from_fab`` (:mod:`.forkserver`), the ``time`` and
``subprocess`` modules of ``start_client_internal`` (:mod:`.supernode`), the keyword defaults of
``pull_objects`` / ``pull_and_inflate_object_from_tree`` (:mod:`.pulls`), the ``uvicorn`` module of
``flwr.superlink.cli.flower_superlink`` (its ``run`` gets an HTTP protocol that checks each peer's uid:
:mod:`.superlink`). These were read in the
sources of each series below (1.42.0 changed none of them) and are exercised by
``tests/test_deploy_wrappers.py``, ``tests/test_deploy_superlink.py`` and ``tests/test_flower_deploy.py``. A new series is added here
only after reading its sources and running those tests against it.
"""

from __future__ import annotations

SUPPORTED_SERIES = ("1.41", "1.42")
"""Flower minor versions (``major.minor``) these wrappers were checked against."""


def flower_version() -> str:
    import flwr

    return str(getattr(flwr, "__version__", ""))


def series(version: str) -> str:
    """``"1.42.0"`` → ``"1.42"``."""
    return ".".join(version.split(".")[:2])


def supported(version: str | None = None) -> bool:
    """Whether the installed Flower (or ``version``) is a series these wrappers were checked on."""
    return series(flower_version() if version is None else version) in SUPPORTED_SERIES


def refusal(command: str, version: str) -> str:
    """What to tell someone running ``fedpers deploy COMMAND`` on an unchecked Flower series."""
    return (
        f"fedpers deploy {command} patches Flower internals checked on flwr {', '.join(SUPPORTED_SERIES)}; this is flwr {version}. "
        f"Either run Flower's own flower-{command} with the same flags (without --poll/--trust-app; set "
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.05 for a quicker SuperExec: rounds are slower, results the same), "
        f"or install a checked Flower: pip install 'flwr[simulation]>={SUPPORTED_SERIES[0]},<{_next(SUPPORTED_SERIES[-1])}'"
    )


def require_flower(command: str) -> None:
    """Refuse (SystemExit with :func:`refusal`) a Flower series these wrappers were not checked on."""
    version = flower_version()
    if not supported(version):
        raise SystemExit(refusal(command, version))


def _next(minor: str) -> str:
    major, m = minor.split(".")
    return f"{major}.{int(m) + 1}"
