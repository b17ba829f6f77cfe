"""A node's own enforcement of a run's public plan and of its users' budget (deployments with a lab policy).

The server's word is not trusted: whoever holds a ServerApp session (the Runtime API's task token)
can send a node any task. Before it computes anything a node therefore checks the task against
what the run's public plan lets it release, and keeps its own persistent per-user ledger:

- its units are the ones the plan gives its partition (:func:`planned_range`: a function of the
  number of units, which the node computes from its own config and data, and of its node config's
  ``partition-id``, ``num-partitions`` and ``users-per-node``, default 0: the even split); a task
  naming any other unit range is refused (so of [0, 100) and [1, 100) at most one can ever run),
  and within one run the range is pinned by the first task accepted;
- the round is one of the plan's (``0 <= round < protocol.num_rounds``) and reachable: after a run's
  first task, only the round after the last one this node computed (``plan-reachable``: a stolen
  session cannot ask round 150 of 300 under a broadcast of its choosing);
- each round is computed once per run, on the first broadcast the node accepted for it: an identical
  repeat (same round, same broadcast digest) is answered with the stored reply of the node's latest round
  (idempotent: a stolen session repeating the current round cannot kill the honest run), a repeat of an
  older round is refused (``plan-once``), and one with another broadcast is refused (``plan-broadcast``:
  the honest server then sees that a conflicting task came first);
- the task's job (algorithm, public config, protocol, noise calibrations, trust model) is the one the
  run's first task pinned;
- at a run's first task its (ε, δ) is charged to the node's users in the node's own ledger, after
  every other check, and refused if any of them would go past the lab's policy (one budget check:
  :class:`~fedpers.runtime.flower.policy.BudgetStore`, the same as the federation's ledger).

The store is one JSON file in a 0700 directory of the node (``$FEDPERS_NODE_STORE``, default
``node-ledger/`` beside the policy file), written atomically under an exclusive lock (each message
may run in its own process). Every refused task is logged and appended to ``refused.log`` there; a
round the node discarded after its charge (a SecAgg+ stage refused because the server cheated) is also
recorded in the run's entry (``discarded``), its charge kept: the node's masked vector had left it.
A resumed run is a new Flower run to a node: it is charged again (over-counting, never under). Under
distributed and local DP the run's entry also keeps the node's own counts of each round (``data``: units
taking part, units zeroed), which its replies never carry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpers.runtime.flower.partition import unit_ranges
from fedpers.runtime.flower.policy import BudgetStore, Policy, PolicyRefused, _privacy

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
    """One node's record (a view of the one :class:`~fedpers.runtime.flower.policy.BudgetStore`): what each
    run was charged to its users, which rounds it computed on which broadcast, and its latest reply."""

    def __init__(self, directory: str | Path, federation: str) -> None:
        self.directory, self.federation = Path(directory), federation
        self.store = BudgetStore(self.directory / f"{federation}-node-ledger.json", federation, "node ledger")
        self.path = self.store.path

    def spent(self, units: tuple[int, int]) -> tuple[float, float]:
        """The most (ε, δ) any of these users has spent on this node."""
        return self.store.spent(units)

    def _runs(self, raw: dict[str, Any]) -> dict[str, Any]:
        runs = raw.setdefault("runs", {})
        if not isinstance(runs, dict):
            raise ValueError(
                f"node ledger {self.path}: its runs are not a table; this node runs no task until it is repaired"
            )
        return runs

    def rounds(self, run: str) -> list[int]:
        """The rounds this node computed for ``run``."""
        return list(self._runs(self.store.read()).get(run, {}).get("rounds", []))

    def _decide(
        self,
        raw: dict[str, Any],
        policy: Policy,
        task: PlannedTask,
        job: str,
        num_rounds: int,
        epsilon: float,
        delta: float,
        digest: str,
        record: bool,
    ) -> bool:
        units = (task.units.start, task.units.stop)
        runs = self._runs(raw)
        if not 0 <= task.round < num_rounds:
            raise PolicyRefused(
                "plan-round", f"round {task.round} is outside the run's plan (rounds 0..{num_rounds - 1})"
            )
        pinned = runs.get(task.run)
        if pinned is None:
            self.store.check(policy, raw, units, epsilon, delta, f"run {task.run}")
            if record:
                self.store.record(raw, task.run, units, epsilon, delta)
                runs[task.run] = {"job": job, "units": list(units), "rounds": [task.round], "broadcasts": {}}
                runs[task.run]["broadcasts"][str(task.round)] = digest
            return False
        if pinned["job"] != job:
            raise PolicyRefused(
                "plan-job", f"run {task.run}: the task's job differs from the one this run started with"
            )
        if tuple(pinned["units"]) != units:
            raise PolicyRefused(
                "plan-units",
                f"run {task.run}: the task asks for units {list(units)}; this node's units in this run are {pinned['units']}",
            )
        seen = pinned.setdefault("broadcasts", {})
        if task.round in pinned["rounds"]:
            if seen.get(str(task.round)) != digest:
                raise PolicyRefused(
                    "plan-broadcast",
                    f"run {task.run}: round {task.round} was already computed on another broadcast; a conflicting "
                    "task for it came first (refused: each unit's statistic is released once a round)",
                )
            return True
        last = max(pinned["rounds"])
        if task.round != last + 1:
            raise PolicyRefused(
                "plan-reachable",
                f"run {task.run}: round {task.round} is not reachable; this node computed up to round {last}, so only "
                f"round {last + 1} is",
            )
        if record:
            pinned["rounds"].append(task.round)
            seen[str(task.round)] = digest
        return False

    def check(
        self, policy: Policy, task: PlannedTask, *, job: str, num_rounds: int, epsilon: float, delta: float, digest: str
    ) -> bool:
        """:meth:`admit`'s checks without writing anything (run them before any computation)."""
        return self._decide(self.store.read(), policy, task, job, num_rounds, epsilon, delta, digest, False)

    def admit(
        self,
        policy: Policy,
        task: PlannedTask,
        *,
        job: str,
        num_rounds: int,
        epsilon: float,
        delta: float,
        digest: str = "",
    ) -> bool:
        """Record ``task`` on broadcast ``digest`` (charging its run at its first task), or refuse it
        (:class:`PolicyRefused`, nothing written) if it breaks the plan or the budget. True: the task repeats
        a round already computed on the same broadcast (nothing recorded; answer it from :meth:`stored`)."""
        with self.store.transaction() as raw:
            return self._decide(raw, policy, task, job, num_rounds, epsilon, delta, digest, True)

    def _reply_path(self, run: str) -> Path:
        return self.directory / f"{hashlib.sha256(run.encode()).hexdigest()[:24]}.reply"

    def store_reply(self, run: str, round: int, digest: str, body: bytes) -> None:
        """Keep ``body`` (the reply to ``run``'s ``round`` on broadcast ``digest``) as the run's latest reply (0600)."""
        from fedpers.results.securefs import write_private

        head = json.dumps({"round": int(round), "digest": digest}).encode()
        write_private(self._reply_path(run), len(head).to_bytes(4, "little") + head + body)

    def stored(self, run: str, round: int, digest: str) -> bytes | None:
        """The stored reply to ``run``'s ``round`` on ``digest`` (None: not the run's latest, or none kept)."""
        path = self._reply_path(run)
        try:
            data = path.read_bytes()
            n = int.from_bytes(data[:4], "little")
            head = json.loads(data[4 : 4 + n])
        except (OSError, ValueError):
            return None
        if head.get("round") != int(round) or head.get("digest") != digest:
            return None
        return data[4 + n :]

    def discarded(self, run: str, round: int, error: PolicyRefused) -> None:
        """Record in ``run``'s entry that ``round`` was discarded on this node after its charge (a refused
        SecAgg+ stage): the charge stays, never refunded (its masked vector had left the node)."""
        with contextlib.suppress(ValueError), self.store.transaction() as raw:
            entry = self._runs(raw).get(run)
            if entry is not None:
                entry.setdefault("discarded", []).append(
                    {"round": int(round), "rule": error.rule, "reason": str(error), "time": time.time()}
                )

    def summary(self, run: str, round: int, counts: Mapping[str, int]) -> None:
        """Keep this node's own counts of ``run``'s ``round`` (units taking part, units zeroed) in the run's
        entry (``data``), for the node's operator: they depend on its users' data, so no reply carries them."""
        with contextlib.suppress(ValueError), self.store.transaction() as raw:
            entry = self._runs(raw).get(run)
            if entry is not None:
                data = entry.setdefault("data", {"note": "this node's own counts, for its operator: not released"})
                data[str(int(round))] = {k: int(v) for k, v in counts.items()}

    def refused(self, task: Mapping[str, Any], error: PolicyRefused) -> None:
        """Append a refused task to ``refused.log`` (0600) and the log."""
        log.warning("refused task %s: %s", json.dumps(dict(task)), error)
        line = json.dumps({**task, "rule": error.rule, "reason": str(error), "time": time.time()}) + "\n"
        with contextlib.suppress(OSError):
            fd = os.open(self.directory / "refused.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(line)


@dataclass
class NodeGate:
    """One task's passage through a node's policy and ledger: :meth:`check` runs before any computation,
    :meth:`admit` (the charge) after every other check; :meth:`refuse` logs a refusal (``refused.log``)."""

    policy: Policy
    ledger: NodeLedger
    record: dict[str, Any]
    task: PlannedTask | None = None
    job: str = ""
    num_rounds: int = 0
    privacy: tuple[float, float] = (0.0, 0.0)
    digest: str = ""

    def refuse(self, error: PolicyRefused) -> PolicyRefused:
        """``error``, logged with this task (raise what it returns)."""
        self.ledger.refused(self.record, error)
        return error

    def _fields(self) -> dict[str, Any]:
        epsilon, delta = self.privacy
        return {
            "job": self.job,
            "num_rounds": self.num_rounds,
            "epsilon": epsilon,
            "delta": delta,
            "digest": self.digest,
        }

    def check(self) -> bool:
        """The plan's checks of :meth:`NodeLedger.check`; True: an identical repeat (answer from the store)."""
        assert self.task is not None
        return self.ledger.check(self.policy, self.task, **self._fields())

    def admit(self) -> bool:
        """:meth:`NodeLedger.admit`: recorded (and charged at the run's first task); True: a repeat after all."""
        assert self.task is not None
        return self.ledger.admit(self.policy, self.task, **self._fields())

    def stored(self) -> bytes | None:
        assert self.task is not None
        return self.ledger.stored(self.task.run, self.task.round, self.digest)

    def store(self, body: bytes) -> None:
        assert self.task is not None
        self.ledger.store_reply(self.task.run, self.task.round, self.digest, body)

    def summary(self, round: int, counts: Mapping[str, int]) -> None:
        """:meth:`NodeLedger.summary` for this task's run."""
        assert self.task is not None
        self.ledger.summary(self.task.run, round, counts)


def node_gate(policy: Policy, *, run: str, round: int, asked: range, partition: int) -> NodeGate:
    """The gate of one task (its unit range and job are checked by :func:`plan_units`)."""
    ledger = NodeLedger(node_store(policy), policy.federation)
    record = {"run": run, "round": round, "units": [asked.start, asked.stop], "partition": partition}
    return NodeGate(policy, ledger, record)


def plan_units(
    gate: NodeGate,
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
    digest: str,
) -> PlannedTask:
    """The node's check of one task's unit range against the run's plan (see the module docstring); fills
    ``gate`` with the task (run key, round, units), its job, the plan's rounds, the run's (ε, δ) and the
    broadcast digest for :meth:`NodeGate.check` and :meth:`NodeGate.admit`."""
    if num_units < 1:
        raise PolicyRefused("plan-units", "the node cannot tell its number of units from the run's plan")
    planned = planned_range(num_units, partition, partitions, users_per_node)
    if asked != planned:
        raise PolicyRefused(
            "plan-units",
            f"the task asks for units [{asked.start}, {asked.stop}); the plan gives partition {partition} of {partitions} "
            f"[{planned.start}, {planned.stop})",
        )
    gate.task = PlannedTask(f"{run}/partition-{partition}", round, asked)  # nodes may share a store
    gate.job, gate.num_rounds, gate.privacy, gate.digest = job, num_rounds, _privacy(config), digest
    return gate.task
