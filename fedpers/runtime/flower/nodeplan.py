"""A node's own enforcement of a run's public plan and of its users' budget (deployments with a lab policy).

The server's word is not trusted: whoever holds a ServerApp session (the Runtime API's task token)
can send a node any task. Before it computes anything a node therefore checks the task against
what the run's public plan lets it release, and keeps its own persistent per-user ledger:

- its units are the ones the plan gives its partition (:func:`planned_range`: a function of the
  number of units, which the node computes from its own config and data, and of its node config's
  ``partition-id``, ``num-partitions`` and ``users-per-node``, default 0: the even split); a task
  naming any other unit range is refused (so of [0, 100) and [1, 100) at most one can ever run),
  and within one run the range is pinned by the first task accepted;
- the round is one of the plan's (``0 <= round < protocol.num_rounds``), and each round is computed
  at most once per run: each unit's statistic is released at most once a round;
- the task's job (algorithm, public config, protocol, noise calibrations) is the one the run's first
  task pinned;
- at a run's first task its (ε, δ) is charged to the node's users in the node's own ledger, after
  every other check, and refused if any of them would go past the lab's policy.

The store is one JSON file in a 0700 directory of the node (``$FEDPERS_NODE_STORE``, default
``node-ledger/`` beside the policy file), written atomically under an exclusive lock (each message
may run in its own process). Every refused task is logged and appended to ``refused.log`` there.
A resumed run is a new Flower run to a node: it is charged again (over-counting, never under).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpers.runtime.flower.partition import unit_ranges
from fedpers.runtime.flower.policy import Charge, Policy, PolicyRefused, _max_over, _privacy

NODE_STORE_ENV = "FEDPERS_NODE_STORE"
"""Directory (0700, the node's own) holding the node's ledger; unset: ``node-ledger/`` beside the policy file."""
log = logging.getLogger("fedpers.flower")


@dataclass(frozen=True)
class PlannedTask:
    """A task as the plan allows it: the run, the round, and the node's own units for it."""

    run: str
    round: int
    units: range


def planned_range(num_units: int, partition: int, partitions: int, users_per_node: int = 0) -> range:
    """The units the plan gives partition ``partition`` of ``partitions`` (:func:`unit_ranges`)."""
    if not 0 <= partition < partitions:
        raise PolicyRefused("plan-units", f"partition-id {partition} is not in 0..{partitions - 1}")
    try:
        return unit_ranges(num_units, partitions, users_per_node)[partition]
    except ValueError as e:
        raise PolicyRefused("plan-units", f"this node's plan has no unit range: {e}") from None


def node_store(policy: Policy) -> Path:
    """The node's private store directory: ``$FEDPERS_NODE_STORE`` or ``node-ledger/`` beside the policy."""
    from fedpers.results.securefs import private_dir

    given = os.environ.get(NODE_STORE_ENV, "")
    if given:
        return private_dir(given)
    if policy.ledger is None:
        raise ValueError("policy has no ledger path: load it with load_policy")
    return private_dir(policy.ledger.parent / "node-ledger")


class NodeLedger:
    """One node's record: what each run was charged to its users, and which rounds it computed."""

    def __init__(self, directory: str | Path, federation: str) -> None:
        self.directory, self.federation = Path(directory), federation
        self.path = self.directory / f"{federation}-node-ledger.json"

    def _read(self) -> dict[str, Any]:
        if not self.path.exists():
            return {"federation": self.federation, "charges": [], "runs": {}}
        try:
            raw = json.loads(self.path.read_text())
            if raw.get("federation") != self.federation:
                raise ValueError(f"it belongs to federation {raw.get('federation')!r}, not {self.federation!r}")
            if not isinstance(raw.get("charges"), list) or not isinstance(raw.get("runs"), dict):
                raise ValueError("charges or runs missing")
            return raw
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(
                f"node ledger {self.path}: unreadable ({e}); this node runs no task until it is repaired"
            ) from None

    @staticmethod
    def _charges(raw: Mapping[str, Any]) -> list[Charge]:
        return [Charge.from_json(c) for c in raw["charges"]]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        from fedpers.results.securefs import private_dir

        private_dir(self.directory)
        fd = os.open(self.directory / f"{self.federation}-node-ledger.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def spent(self, units: tuple[int, int]) -> tuple[float, float]:
        """The most (ε, δ) any of these users has spent on this node."""
        return _max_over(self._charges(self._read()), units)

    def rounds(self, run: str) -> list[int]:
        """The rounds this node computed for ``run``."""
        return list(self._read()["runs"].get(run, {}).get("rounds", []))

    def admit(
        self, policy: Policy, task: PlannedTask, *, job: str, num_rounds: int, epsilon: float, delta: float
    ) -> None:
        """Record ``task`` (charging its run at its first task), or refuse it (:class:`PolicyRefused`,
        nothing written) if it breaks the plan or the budget."""
        units = (task.units.start, task.units.stop)
        with self._locked():
            raw = self._read()
            if not 0 <= task.round < num_rounds:
                raise PolicyRefused(
                    "plan-round", f"round {task.round} is outside the run's plan (rounds 0..{num_rounds - 1})"
                )
            pinned = raw["runs"].get(task.run)
            if pinned is not None:
                if pinned["job"] != job:
                    raise PolicyRefused(
                        "plan-job", f"run {task.run}: the task's job differs from the one this run started with"
                    )
                if tuple(pinned["units"]) != units:
                    raise PolicyRefused(
                        "plan-units",
                        f"run {task.run}: the task asks for units {list(units)}; this node's units in this run are {pinned['units']}",
                    )
                if task.round in pinned["rounds"]:
                    raise PolicyRefused(
                        "plan-once",
                        f"run {task.run}: round {task.round} was already computed; each unit's statistic is released once a round",
                    )
                pinned["rounds"].append(task.round)
            else:
                charges = self._charges(raw)
                eps, dl = _max_over(charges, units)
                if not (math.isfinite(epsilon) and eps + epsilon <= policy.max_epsilon * (1 + 1e-12)):
                    raise PolicyRefused(
                        "max-epsilon",
                        f"this node's users {list(units)} have spent epsilon={eps:g}; "
                        f"run {task.run}'s {epsilon:g} would exceed the lab's {policy.max_epsilon:g}",
                    )
                if not dl + delta <= policy.max_delta * (1 + 1e-12):
                    raise PolicyRefused(
                        "max-delta",
                        f"this node's users {list(units)} have spent delta={dl:g}; run {task.run}'s {delta:g} would exceed the lab's {policy.max_delta:g}",
                    )
                raw["charges"].append(
                    {"run": task.run, "epsilon": epsilon, "delta": delta, "units": list(units), "time": time.time()}
                )
                raw["runs"][task.run] = {"job": job, "units": list(units), "rounds": [task.round]}
            from fedpers.results.securefs import write_private

            write_private(self.path, (json.dumps(raw, indent=1) + "\n").encode())

    def refused(self, task: Mapping[str, Any], error: PolicyRefused) -> None:
        """Append a refused task to ``refused.log`` (0600) and the log."""
        log.warning("refused task %s: %s", json.dumps(dict(task)), error)
        line = json.dumps({**task, "rule": error.rule, "reason": str(error), "time": time.time()}) + "\n"
        with contextlib.suppress(OSError):
            fd = os.open(self.directory / "refused.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(line)


def enforce_plan(
    policy: Policy,
    *,
    run: str,
    round: int,
    asked: range,
    num_units: int,
    partition: int,
    partitions: int,
    users_per_node: int = 0,
    num_rounds: int,
    job: str,
    config: Mapping[str, Any],
    admit: bool = True,
) -> PlannedTask:
    """The node's check of one task against the run's plan (see the module docstring). With
    ``admit`` false only the unit range is checked (call again with ``admit`` once every other
    check has passed: the charge comes last). Refusals are logged and raised."""
    ledger = NodeLedger(node_store(policy), policy.federation)
    record = {"run": run, "round": round, "units": [asked.start, asked.stop], "partition": partition}
    try:
        if num_units < 1:
            raise PolicyRefused("plan-units", "the node cannot tell its number of units from the run's plan")
        planned = planned_range(num_units, partition, partitions, users_per_node)
        if asked != planned:
            raise PolicyRefused(
                "plan-units",
                f"the task asks for units [{asked.start}, {asked.stop}); the plan gives partition {partition} of {partitions} "
                f"[{planned.start}, {planned.stop})",
            )
        task = PlannedTask(f"{run}/partition-{partition}", round, asked)  # nodes may share a store
        if admit:
            epsilon, delta = _privacy(config)
            ledger.admit(policy, task, job=job, num_rounds=num_rounds, epsilon=epsilon, delta=delta)
        return task
    except PolicyRefused as e:
        ledger.refused(record, e)
        raise
