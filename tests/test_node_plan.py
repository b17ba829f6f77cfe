"""Nodes enforce the run's public plan and their users' budget themselves (fedpers/runtime/flower/nodeplan.py).

A stolen ServerApp session is simulated by pushing hand-made tasks through the nodes of a run
(same Flower run id, same node config): the differencing pair [0, 100) and [1, 100) is refused,
no round is computed twice, and a round outside the plan is refused, each logged.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, RecordDict

from fedpers import config as config_lib
from fedpers.app import build_node, flower_job, make_client_app, run_flower
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import Privatizer
from fedpers.runtime.flower import codec
from fedpers.runtime.flower.client import handle_train
from fedpers.runtime.flower.nodeplan import NODE_STORE_ENV, NodeLedger, planned_range
from fedpers.runtime.flower.policy import POLICY_ENV, PolicyRefused
from tests.flower_support import InProcessGrid

EXP = EXPERIMENTS["altmin"]
POLICY = 'federation = "lab"\nmax-epsilon = 8.0\nmax-delta = 1e-4\nrequire-secure-noise = false\nmin-units = 50\nalgorithms = ["altmin"]\n'
FIELDS = {
    "n_users": 200,
    "dim": 5,
    "rank": 2,
    "samples_per_user": 8,
    "rounds": 1,
    "seed": 3,
    "cohorts": "all",
    "epsilon": 4.0,
}


@pytest.fixture
def node_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "policy.toml").write_text(POLICY)
    monkeypatch.setenv(POLICY_ENV, str(tmp_path / "policy.toml"))
    monkeypatch.setenv(NODE_STORE_ENV, str(tmp_path / "store"))
    return tmp_path / "store"


def _setup(**extra: object):
    cfg = config_lib.build(EXP.config_type, {**FIELDS, **extra})
    protocol = EXP.protocol(cfg)
    return cfg, protocol


def _honest_run(grid: InProcessGrid, cfg, protocol) -> None:
    options = config_lib.build(RuntimeOptions, {"runtime": "flower", "round_timeout": 5.0})
    run_flower(EXP, cfg, protocol, Privatizer(1), options, grid=grid, progress=False)


def _task(grid: InProcessGrid, round: int, units: range, broadcast_of: int | None = None) -> RecordDict:
    """A hand-made task over ``units`` with the honest broadcast of round ``broadcast_of`` (default: ``round``'s),
    as a stolen session would send it."""
    want = round if broadcast_of is None else broadcast_of
    tasks = [codec.decode_task(m.content) for m in grid.sent if m.metadata.message_type == "train"]
    honest = max((t for t in tasks if t.round <= want), key=lambda t: t.round)  # past the plan: the last one
    return codec.encode_task(honest.job, round, units, codec.broadcast_record(honest.broadcast))


REPLIES: list[bytes] = []


def _send(grid: InProcessGrid, partition: int, content: RecordDict, run_id: int = 1) -> str:
    """What node ``partition`` answers: 'released' or the refusal's rule (each reply's bytes in REPLIES)."""
    from flwr.app import Message, MessageType

    node = next(n for n, c in grid.contexts.items() if int(c.node_config[codec.PARTITION_ID]) == partition)
    ctx = grid.contexts[node]
    context = Context(run_id=run_id, node_id=node, node_config=ctx.node_config, state=RecordDict(), run_config={})
    message = Message(content, node, MessageType.TRAIN)
    try:
        reply = handle_train(message, context, build_node)
    except PolicyRefused as e:
        return e.rule
    assert codec.decode_reply(reply.content).count == 100
    REPLIES.append(bytes(reply.content.config_records[codec.TAG][codec.BLOB]))
    return "released"


def test_a_stolen_session_cannot_difference_a_user_or_release_a_round_twice(node_policy: Path) -> None:
    cfg, protocol = _setup()
    grid = RecordingGrid(make_client_app(), 2)
    _honest_run(grid, cfg, protocol)  # the planned run: 2 rounds (init + 1), each node once a round
    node_store = node_policy
    ledger = NodeLedger(node_store, "lab")
    assert ledger.rounds("1/partition-0") == ledger.rounds("1/partition-1") == [0, 1] and ledger.spent((0, 200)) == (
        4.0,
        cfg.delta,
    )
    # the same session (run 1), every planned round already released: nothing more comes out
    assert _send(grid, 0, _task(grid, 0, range(0, 100))) == "plan-once"  # an older round: no reply kept
    assert _send(grid, 0, _task(grid, 1, range(1, 100))) == "plan-units"
    assert _send(grid, 0, _task(grid, 2, range(0, 100))) == "plan-round"
    assert _send(grid, 0, _task(grid, 1, range(0, 100), broadcast_of=0)) == "plan-broadcast"  # another U for round 1
    assert _send(grid, 0, _task(grid, 1, range(0, 100))) == "released"  # an identical repeat: the stored reply
    sent = {m.metadata.message_id: m for m in grid.sent if m.metadata.message_type == "train"}
    honest = [  # the honest run's round-1 reply of partition 0
        r
        for r in grid.received
        if r.metadata.reply_to_message_id in sent
        and codec.decode_task(sent[r.metadata.reply_to_message_id].content).round == 1
        and codec.decode_task(sent[r.metadata.reply_to_message_id].content).start == 0
    ]
    assert len(honest) == 1 and bytes(honest[0].content.config_records[codec.TAG][codec.BLOB]) == REPLIES[-1]
    # a session of another run: the first task of the pair runs (and is charged), its neighbour is refused
    assert _send(grid, 0, _task(grid, 0, range(0, 100)), run_id=2) == "released"
    assert _send(grid, 0, _task(grid, 0, range(1, 100)), run_id=2) == "plan-units"
    assert _send(grid, 0, _task(grid, 1, range(1, 100)), run_id=2) == "plan-units"  # pinned for the whole run
    assert _send(grid, 0, _task(grid, 0, range(0, 100)), run_id=2) == "released"  # the same task: the same reply
    assert REPLIES[-1] == REPLIES[-2]
    assert _send(grid, 1, _task(grid, 0, range(0, 100)), run_id=2) == "plan-units"  # another partition's units
    raw = json.loads((node_store / "lab-node-ledger.json").read_text())
    for run in raw["runs"].values():  # no unit's statistic twice in a round
        assert len(run["rounds"]) == len(set(run["rounds"]))
    assert raw["runs"]["2/partition-0"]["units"] == [0, 100] and raw["runs"]["2/partition-0"]["rounds"] == [0]
    refused = [json.loads(line) for line in (node_store / "refused.log").read_text().splitlines()]
    assert [r["rule"] for r in refused] == [
        "plan-once",
        "plan-units",
        "plan-round",
        "plan-broadcast",
        "plan-units",
        "plan-units",
        "plan-units",
    ]
    assert stat.S_IMODE(node_store.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in node_store.iterdir())
    # runs 1 and 2 of ε=4 spent the lab's 8 for users 0..99: a third run is refused by the node's own
    # ledger whatever the server's ledger says (nothing computed, nothing charged)
    before = (node_store / "lab-node-ledger.json").read_text()
    assert _send(grid, 0, _task(grid, 0, range(0, 100)), run_id=3) == "max-epsilon"
    assert (node_store / "lab-node-ledger.json").read_text() == before
    assert ledger.spent((0, 100))[0] == 8.0 and ledger.spent((100, 200))[0] == 4.0


class RecordingGrid(InProcessGrid):
    """An in-process grid that keeps every reply the server pulled."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.received: list[Any] = []

    def pull_messages(self, message_ids: Any) -> list[Any]:
        out = super().pull_messages(message_ids)
        self.received.extend(out)
        return out


@pytest.mark.slow
def test_a_job_changed_mid_run_is_refused(node_policy: Path) -> None:
    cfg, protocol = _setup()
    grid = InProcessGrid(make_client_app(), 2)
    assert _send(grid, 0, _initial_task(cfg, protocol), run_id=5) == "released"
    other_cfg, other = _setup(epsilon=2.0)
    assert _send(grid, 0, _initial_task(other_cfg, other, round=1), run_id=5) == "plan-job"


def _initial_task(cfg, protocol, round: int = 0) -> RecordDict:
    job = flower_job(EXP, cfg, protocol)
    state = protocol.server_start(protocol.initial_state(), Privatizer(0))
    return codec.encode_task(job, round, range(0, 100), codec.broadcast_record(protocol.broadcast(state, 0)))


@pytest.mark.parametrize(
    ("n", "parts", "q", "want"),
    [
        (200, 2, 0, [(0, 100), (100, 200)]),
        (10, 3, 0, [(0, 3), (3, 6), (6, 10)]),
        (10, 3, 4, [(0, 4), (4, 8), (8, 10)]),  # the node config's users-per-node
    ],
)
def test_the_plan_gives_each_partition_one_range(n: int, parts: int, q: int, want: list[tuple[int, int]]) -> None:
    assert [(r.start, r.stop) for r in (planned_range(n, p, parts, q) for p in range(parts))] == want
    with pytest.raises(PolicyRefused, match="plan-units"):
        planned_range(n, parts, parts)
    with pytest.raises(PolicyRefused, match="plan-units"):
        planned_range(n, 0, parts, 1)  # 1 user per node needs n nodes


def test_without_a_policy_nothing_is_enforced_or_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulation (no lab policy) keeps no node ledger."""
    monkeypatch.delenv(POLICY_ENV, raising=False)
    monkeypatch.setenv(NODE_STORE_ENV, str(tmp_path / "store"))
    cfg, protocol = _setup()
    _honest_run(InProcessGrid(make_client_app(), 2), cfg, protocol)
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(("asked", "ok"), [((0, 100), True), ((0, 99), False), ((0, 101), False), ((1, 100), False)])
def test_the_unit_range_rule_at_its_boundary(node_policy: Path, asked: tuple[int, int], ok: bool) -> None:
    """Partition 0 of 2 over 200 units holds exactly [0, 100): one unit more or less at either end is refused."""
    from fedpers.runtime.flower.nodeplan import node_gate, plan_units
    from fedpers.runtime.flower.policy import load_policy

    policy = load_policy(node_policy.parent / "policy.toml")
    gate = node_gate(policy, run="9", round=0, asked=range(*asked), partition=0)
    fields = dict(run="9", round=0, asked=range(*asked), num_units=200, partition=0, partitions=2, num_rounds=2)
    if ok:
        assert plan_units(gate, **fields, job="j", config={"epsilon": 1.0, "delta": 1e-6}, digest="d").units == range(
            0, 100
        )
    else:
        with pytest.raises(PolicyRefused, match="rule 'plan-units'"):
            plan_units(gate, **fields, job="j", config={"epsilon": 1.0, "delta": 1e-6}, digest="d")
