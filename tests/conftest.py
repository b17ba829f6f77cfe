import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "2")
# The suite solves every calibration afresh (no entry of a user's cache, none left behind);
# tests/test_calibration_cache.py turns the cache on where it tests it.
os.environ.setdefault("FEDPERS_CALIBRATION_CACHE", "0")


import pytest  # noqa: E402

# Taken at import, before any fixture: a module-scoped fixture that runs ``fedpers`` in process
# (tests/test_resume.py's reference runs) would otherwise set the variables before a per-test
# snapshot and leave them to every later test.
_SUITE_ENVIRONMENT = dict(os.environ)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test sees the environment the suite started with: an in-process ``fedpers`` command sets
    FLWR_LOG_LEVEL and PYTHONWARNINGS for its own Ray workers, and a later test's Flower processes
    (a SuperLink whose start-up line the loopback tests wait for) must not inherit them."""
    yield
    current = {k: v for k, v in os.environ.items() if k.startswith("PYTEST_")}  # pytest's own, removed by pytest
    if os.environ != {**_SUITE_ENVIRONMENT, **current}:
        os.environ.clear()
        os.environ.update({**_SUITE_ENVIRONMENT, **current})


@pytest.fixture(autouse=True)
def _torch_global_generator_seeded():
    """Each test starts from one state of torch's global generator, so a test that draws its inputs without a
    generator of its own (``torch.randn(6, 5)``) sees the same numbers alone, in any subset of the suite, or
    after any other test: its outcome is a function of the code only. Nothing is imported for it: a test that
    never loaded torch is left as it is."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)
    yield


@pytest.fixture
def statistical_errors(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every standard error the non-private reference's stopping rule computes, in order (the
    function itself still answers): the yardstick tests of tests/test_baselines.py and
    tests/test_shared_passes.py read the last one."""
    import fedpers.experiments.common.lowrank_baselines as baselines

    seen: list[float] = []
    original = baselines.statistical_error

    def spy(*args):
        seen.append(original(*args))
        return seen[-1]

    monkeypatch.setattr(baselines, "statistical_error", spy)
    return seen
