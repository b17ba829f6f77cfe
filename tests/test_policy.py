"""The lab's privacy policy (issue 23): file format, the ServerApp's and the nodes' checks, the
federation's cumulative budget ledger, and private files at rest."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch

from fedpers.results.securefs import UnsafeDirectory, private_dir, write_private
from fedpers.runtime.flower.policy import (
    BudgetLedger,
    Policy,
    PolicyRefused,
    check_partitions,
    check_run,
    check_task,
    load_policy,
)

POLICY = 'federation = "lab"\nmax-epsilon = 8.0\nmax-delta = 1e-4\nrequire-secure-noise = true\nmin-units = 50\nalgorithms = ["altmin"]\n'


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    (tmp_path / "policy.toml").write_text(POLICY)
    return load_policy(tmp_path / "policy.toml")


def test_policy_file_is_read_and_malformed_files_name_the_key(tmp_path: Path, policy: Policy) -> None:
    assert policy.max_epsilon == 8.0 and policy.min_units == 50 and policy.algorithms == ("altmin",)
    assert (policy.max_rounds, policy.max_seconds) == (1000, 86400.0)  # the defaults
    assert policy.ledger == (tmp_path / "lab-budget.json").resolve()
    for bad, word in (
        (POLICY.replace("8.0", "inf"), "max-epsilon"),
        (POLICY.replace("1e-4", "2.0"), "max-delta"),
        (POLICY.replace("min-units = 50", "min-units = 0"), "min-units"),
        (POLICY + "epsilon = 1\n", r"unknown keys \['epsilon'\]"),
        (POLICY.replace('["altmin"]', '"altmin"'), "algorithms"),
        (POLICY + "max-rounds = 0\n", "max-rounds"),
        (POLICY + "max-seconds = -1.0\n", "max-seconds"),
        (POLICY + 'max-rounds = "9"\n', "max-rounds"),
    ):
        (tmp_path / "bad.toml").write_text(bad)
        with pytest.raises(ValueError, match=word):
            load_policy(tmp_path / "bad.toml")


@pytest.mark.parametrize(
    ("algorithm", "config", "secure", "rule"),
    [
        ("dpals", {"epsilon": 1.0, "delta": 1e-5}, True, "algorithms"),
        ("altmin", {"epsilon": math.inf, "delta": 1e-5}, True, "max-epsilon"),
        ("altmin", {"epsilon": 9.0, "delta": 1e-5}, True, "max-epsilon"),
        ("altmin", {"delta": 1e-5}, True, "max-epsilon"),  # no epsilon at all: non-private
        ("altmin", {"epsilon": 1.0, "delta": 1e-3}, True, "max-delta"),
        ("altmin", {"epsilon": 1.0, "delta": 1e-5}, False, "require-secure-noise"),
    ],
)
def test_server_refuses_a_run_outside_the_policy_naming_the_rule(
    policy: Policy, algorithm, config, secure, rule
) -> None:
    with pytest.raises(PolicyRefused, match=f"rule '{rule}'") as e:
        check_run(policy, algorithm, config, secure_noise=secure)
    assert e.value.rule == rule
    assert check_run(policy, "altmin", {"epsilon": 8.0, "delta": 1e-4}, secure_noise=True) == (8.0, 1e-4)


def test_node_refuses_a_task_over_fewer_units_than_the_minimum(policy: Policy) -> None:
    check_task(policy, "altmin", {"epsilon": 4.0, "delta": 1e-5}, 50)
    with pytest.raises(PolicyRefused, match="rule 'min-units'.*over 49 users"):
        check_task(policy, "altmin", {"epsilon": 4.0, "delta": 1e-5}, 49)
    with pytest.raises(PolicyRefused, match="rule 'max-epsilon'"):
        check_task(policy, "altmin", {"epsilon": math.inf, "delta": 1e-5}, 500)
    with pytest.raises(PolicyRefused, match="rule 'min-units'.*partitions \\{1: 10\\}"):
        check_partitions(policy, {0: 50, 1: 10})


def test_budget_ledger_accumulates_per_user_across_runs_and_refuses_before_writing(policy: Policy) -> None:
    ledger = BudgetLedger(policy.ledger, policy.federation)
    ledger.charge(policy, "run-a", (0, 100), 4.0, 1e-5)
    ledger.charge(policy, "run-b", (100, 200), 4.0, 1e-5)  # other users: their own budget
    ledger.charge(policy, "run-c", (50, 150), 4.0, 1e-5)  # users 50..149 reach 8.0: exactly allowed
    assert ledger.spent((0, 200)) == (8.0, 2e-5) and ledger.spent((0, 50)) == (4.0, 1e-5)
    before = policy.ledger.read_bytes()
    with pytest.raises(PolicyRefused, match="rule 'max-epsilon'.*spent epsilon=8"):
        ledger.charge(policy, "run-d", (149, 160), 0.5, 1e-5)  # user 149 would exceed
    assert policy.ledger.read_bytes() == before  # nothing half-written
    ledger.charge(policy, "run-e", (150, 200), 0.5, 1e-5)
    assert ledger.charge(policy, "run-a", (0, 100), 4.0, 1e-5).run == "run-a"  # a resumed run is not charged twice
    assert [c["run"] for c in json.loads(policy.ledger.read_text())["charges"]] == ["run-a", "run-b", "run-c", "run-e"]
    assert stat.S_IMODE(policy.ledger.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="belongs to federation 'lab'"):
        BudgetLedger(policy.ledger, "other").charges()


def test_private_dir_creates_0700_and_refuses_one_others_can_reach(tmp_path: Path) -> None:
    made = private_dir(tmp_path / "a" / "cache")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(UnsafeDirectory, match="mode 0777"):
        private_dir(open_dir)
    os.chmod(open_dir, 0o750)
    with pytest.raises(UnsafeDirectory, match="mode 0750"):
        private_dir(open_dir)
    write_private(made / "f", b"x")
    assert stat.S_IMODE((made / "f").stat().st_mode) == 0o600


def test_node_cache_is_private_and_refuses_a_shared_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FEDPERS_NODE_CACHE: a missing directory is created 0700 with 0600 files; an existing 0777 one
    fails the task (raw user data never lands where other local users can read it)."""
    import torch

    from fedpers.runtime.flower import client

    monkeypatch.setattr(os, "umask", os.umask)  # keep the process umask as it is
    old = os.umask(0o022)
    try:
        monkeypatch.setenv(client.NODE_CACHE_ENV, str(tmp_path / "cache"))
        client._disk_cached(("altmin", "{}", "", 0, 3), lambda: {"ids": torch.arange(3)})
        files = list((tmp_path / "cache").iterdir())
        assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o700 and files
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
        shared = tmp_path / "shared"
        shared.mkdir()
        os.chmod(shared, 0o777)
        monkeypatch.setenv(client.NODE_CACHE_ENV, str(shared))
        with pytest.raises(UnsafeDirectory):
            client._disk_cached(("altmin", "{}", "", 0, 3), lambda: {"ids": torch.arange(3)})
        assert list(shared.iterdir()) == []
    finally:
        os.umask(old)


def test_integrity_refuses_a_fedpers_that_differs_from_the_fab(tmp_path: Path) -> None:
    from fedpers.deploy import integrity

    root = Path(integrity.__file__).resolve().parents[2]  # fedpers/deploy/integrity.py -> the checkout
    integrity.require_fab_code(root)  # this checkout against itself
    fab = tmp_path / "fab"
    import shutil

    shutil.copytree(root / "fedpers", fab / "fedpers", ignore=shutil.ignore_patterns("__pycache__"))
    integrity.require_fab_code(fab)  # an identical copy
    (fab / "fedpers" / "runtime" / "flower" / "client.py").write_text("# modified\n")
    with pytest.raises(integrity.ModifiedCode, match="runtime/flower/client.py"):
        integrity.require_fab_code(fab)


def test_fleet_proxy_forwards_only_the_fleet_api() -> None:
    """Control (flwr ls/log/run, supernode register/unregister) and Runtime paths get 404 from the
    network face; Fleet paths are forwarded (here to an address nobody serves: 502)."""
    import asyncio

    from fedpers.deploy.fleetproxy import make_app

    app = make_app("https://127.0.0.1:9", None, timeout=2.0)

    async def call(method: str, path: str) -> int:
        sent: list[dict] = []
        done = asyncio.Event()
        queue = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

        async def life_receive() -> dict:
            if len(queue) == 1:
                await done.wait()
            return queue.pop(0)

        async def send(m: dict) -> None:
            sent.append(m)

        task = asyncio.create_task(app({"type": "lifespan"}, life_receive, send))
        await asyncio.sleep(0)

        async def receive() -> dict:
            return {"type": "http.request", "body": b"x", "more_body": False}

        await app({"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}, receive, send)
        done.set()
        await task
        return next(m["status"] for m in sent if m["type"] == "http.response.start")

    for path in (
        "/v1/control/list-runs",
        "/v1/control/start-run",
        "/v1/control/register-supernode",
        "/v1/control/stream-logs",
        "/v1/runtime/acquire-task",
        "/docs",
        "/v1/fleet/../control/list-runs",
    ):
        assert asyncio.run(call("POST", path)) == 404, path
    assert asyncio.run(call("GET", "/v1/fleet/pull-messages")) == 404
    assert asyncio.run(call("POST", "/v1/fleet/pull-messages")) == 502


def test_admitting_a_new_run_into_a_reused_out_directory_charges_it_again(policy: Policy, tmp_path: Path) -> None:
    """A run is keyed by its out directory and the Flower run id: a new run writing to the same
    directory is a new release of the users' data, charged again (only ``resume`` is not)."""
    from types import SimpleNamespace

    from fedpers.runtime.flower.policy import admit_run

    job = SimpleNamespace(
        resume=None,
        experiment=SimpleNamespace(name="altmin", num_units=lambda cfg: 100),
        cfg={"epsilon": 3.0, "delta": 1e-5},
        options=SimpleNamespace(secure_noise=True),
        out=tmp_path / "run",
    )
    admit_run(policy, job, "1")
    admit_run(policy, job, "2")
    assert BudgetLedger(policy.ledger, policy.federation).spent((0, 100)) == (6.0, 2e-5)
    with pytest.raises(PolicyRefused, match="rule 'max-epsilon'"):
        admit_run(policy, job, "3")  # 9 > 8


@pytest.mark.parametrize("algorithm", ["fedrep", "noisygd"])
def test_a_node_counts_the_sampled_units_of_a_cyclic_poisson_round_not_its_whole_block(
    policy: Policy, algorithm: str
) -> None:
    """Cycle + Poisson cohorts (2 blocks, each sampled at 0.5 in its rounds): the min-units check counts the
    node's units in the round's block *and* in the server's sample (what the message holds), not the block;
    a minimum between the two counts is refused (with the block's count it passed)."""
    from fedpers import config as config_lib
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runtime.flower.client import units_contributed

    exp = EXPERIMENTS[algorithm]
    small = {
        "fedrep": dict(n_users=40, dim=6, rank=2, samples_per_user=5, refit_samples=3, test_samples=10, rounds=8),
        "noisygd": dict(examples=48, classes=3, feature_dim=5, steps=8, test_examples=20, collapse="random"),
    }[algorithm]
    cfg = config_lib.build(exp.config_type, {**small, "epsilon": 2.0, "baselines": "none", "dtype": "float64",
                                             "cohorts": "poisson", "sampling_rate": 0.25, "noise": "banded", "bands": 2})  # fmt: skip
    protocol = exp.protocol(cfg)
    assert protocol.cycle == 2 and protocol.sampling_rate == 0.5
    total = 40 if algorithm == "fedrep" else 48
    units = exp.units(cfg, torch.arange(total))
    sampled = (torch.arange(total) % 3 == 0).to(torch.float64)  # the server's sample: every third unit
    round = 3 if algorithm == "fedrep" else protocol.remedy_rounds + 1
    cohort = protocol.round_cohort(round) if algorithm == "fedrep" else protocol.step_cohort(round)
    lo, hi = protocol.cohort_range(cohort)
    expected = sum(1 for i in range(lo, hi) if sampled[i] > 0)  # in the block and sampled, counted one by one
    block = protocol.units_in_round(round, units)
    assert block == hi - lo > expected > 0
    count = units_contributed(protocol, round, {"sampled": sampled}, units)
    assert count == expected
    strict = Policy(**{**policy.__dict__, "min_units": expected + 1, "algorithms": (algorithm,)})
    check_task(strict, algorithm, {"epsilon": 2.0, "delta": 1e-5}, block)  # the old count let it through
    with pytest.raises(PolicyRefused, match=f"rule 'min-units'.*over {expected} users"):
        check_task(strict, algorithm, {"epsilon": 2.0, "delta": 1e-5}, count)
