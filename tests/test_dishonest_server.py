"""A dishonest server (or a stolen ServerApp session) against the nodes' real handlers, under each trust model.

Each attack of issue-style review, played in process through the ClientApp a SuperNode runs, with the lab's
node policy in force: the server strips the node-side record from a distributed run's task, chooses the
nodes' noise seed, withholds SecAgg+ relays or tells nodes different survivor sets, asks a round not yet
reachable under a broadcast of its choosing, or repeats a round. Each is refused before anything of node 0
can be recovered, the round is discarded, and node 0's ledger is unchanged (refused before its charge) or
records the round as discarded (refused after it); an honest repeat is answered from the node's store and
the honest run completes. The nodes count only what SecAgg+ actually summed (a node whose share reply was
lost gives the local runtime's run without it, to the bit and in ε).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from fedpers import config
from fedpers.app import build_node, make_client_app, run_flower
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments.altmin import AltMinConfig, AltMinExperiment
from fedpers.privacy.accountant import Calibrations, ledger_epsilon
from fedpers.protocols.base import Message
from fedpers.runner import resolve
from fedpers.runtime import distributed as local_nodes
from fedpers.runtime.driver import RoundFailed
from fedpers.runtime.flower import codec, nodeside, secaggplus
from fedpers.runtime.flower.client import handle_train
from fedpers.runtime.flower.nodeplan import NODE_STORE_ENV, NodeLedger
from fedpers.runtime.flower.policy import POLICY_ENV, PolicyRefused
from fedpers.runtime.local import run_local
from fedpers.seeds import split_seed
from tests.flower_support import InProcessGrid

SMALL = dict(n_users=120, dim=5, rank=2, samples_per_user=16, rounds=1, baselines="none", epsilon=2.0)


def policy_text(model: str = "distributed", secure: bool = True) -> str:
    return (
        f'federation = "lab"\nmax-epsilon = 8.0\nmax-delta = 1e-4\nrequire-secure-noise = {str(secure).lower()}\n'
        f'min-units = 1\nalgorithms = ["altmin"]\ntrust-model = "{model}"\nmin-nodes = 2\n'
    )


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every node's lab policy (trust-model distributed, min-nodes 2) and store."""
    (tmp_path / "policy.toml").write_text(policy_text())
    monkeypatch.setenv(POLICY_ENV, str(tmp_path / "policy.toml"))
    monkeypatch.setenv(NODE_STORE_ENV, str(tmp_path / "store"))
    return tmp_path / "store"


class RecordingGrid(InProcessGrid):
    """An in-process grid that keeps every reply (errors too) and can run a hook before a message is pushed."""

    def __init__(self, app: ClientApp, partitions: int, **kw: Any) -> None:
        super().__init__(app, partitions, **kw)
        self.received: list[FlowerMessage] = []
        self.before: Any = None

    def push_messages(self, messages: Any) -> list[str]:
        messages = list(messages)
        if self.before is not None:
            for m in messages:
                self.before(self, m)
        return super().push_messages(messages)

    def pull_messages(self, message_ids: Any) -> list[FlowerMessage]:
        out = super().pull_messages(message_ids)
        self.received.extend(out)
        return out

    def context(self, partition: int) -> Context:
        return next(c for c in self.contexts.values() if int(c.node_config[codec.PARTITION_ID]) == partition)

    def node(self, partition: int) -> int:
        return next(n for n, c in self.contexts.items() if int(c.node_config[codec.PARTITION_ID]) == partition)

    def replies(self, stage: str) -> dict[int, list[FlowerMessage]]:
        """Partition → its replies to ``stage`` (a SecAgg+ stage, or 'train')."""
        asked = {m.metadata.message_id: m for m in self.sent}
        out: dict[int, list[FlowerMessage]] = {}
        for r in self.received:
            m = asked[r.metadata.reply_to_message_id]
            rec = m.content.config_records.get(secaggplus.SECAGG)
            kind = (
                "train" if m.metadata.message_type == "train" else (str(rec["stage"]) if rec is not None else "query")
            )
            if kind == stage:
                part = int(self.contexts[m.metadata.dst_node_id].node_config[codec.PARTITION_ID])
                out.setdefault(part, []).append(r)
        return out


def plan(nodes: int = 4, cfg: dict[str, Any] | None = None, **options: Any) -> Any:
    opts = {
        "nodes": nodes, "runtime": "flower", "dp_model": "distributed", "bits": 16, "secure_noise": True,
        "round_timeout": 0.5, **options,
    }  # fmt: skip
    return resolve(AltMinExperiment(), config.build(AltMinConfig, cfg or SMALL), config.build(RuntimeOptions, opts))


def on_flower(p: Any, grid: Any) -> tuple[Any, list[Any]]:
    table = p.calibrations.table
    node_protocol = p.experiment.protocol(p.cfg, Calibrations(table))
    return run_flower(
        p.experiment, p.cfg, p.protocol, p.privatizer, p.options, grid=grid, progress=False, calibrations=table,
        node_protocol=node_protocol,
    )  # fmt: skip


def send(
    grid: RecordingGrid, partition: int, content: RecordDict, context: Context | None = None, settings: Any = None
) -> FlowerMessage | str:
    """Node ``partition``'s answer to ``content`` through its real train handler: the reply, or the rule of
    its refusal. ``context``: the node's Context of the run (default: a fresh run's, run id 2)."""
    node = grid.node(partition)
    if context is None:
        context = Context(
            run_id=2, node_id=node, node_config=grid.context(partition).node_config, state=RecordDict(), run_config={}
        )
    message = FlowerMessage(content, node, "train")
    try:
        return handle_train(message, context, build_node, settings)
    except PolicyRefused as e:
        return e.rule


def first_task(grid: RecordingGrid, partition: int = 0, round: int = 0) -> FlowerMessage:
    return next(
        m for m in grid.sent
        if m.metadata.message_type == "train" and m.metadata.dst_node_id == grid.node(partition)
        and codec.decode_task(m.content).round == round
    )  # fmt: skip


def copy_content(content: RecordDict, **record: Any) -> RecordDict:
    """The task with its node-side record changed: a key set to None is removed; ``drop`` removes the record."""
    out = RecordDict({k: v for k, v in content.items()})
    rec = content.config_records[nodeside.NODE_SIDE].copy()
    for key, value in record.items():
        if value is None:
            del rec[key]
        else:
            rec[key] = value
    out[nodeside.NODE_SIDE] = rec
    return out


def ledger_bytes(store: Path) -> bytes:
    path = store / "lab-node-ledger.json"
    return path.read_bytes() if path.exists() else b""


def refused_rules(store: Path) -> list[str]:
    path = store / "refused.log"
    return [json.loads(line)["rule"] for line in path.read_text().splitlines()] if path.exists() else []


# ----- findings 1 and 3: a plain task, a server-chosen seed, a weaker plan -----------------------------
@pytest.mark.parametrize("model", ["distributed", "local"])
def test_a_node_side_run_never_gets_a_plain_answer_or_a_seed_from_a_message(store: Path, model: str) -> None:
    """Node 0 of a distributed or local run, sent the run's own task stripped of its node-side record, the same task
    relabelled central, a task setting a seed and secure=false, or one whose plan asks for half the
    noise: each refused with its rule before any computation (no reply: nothing of node 0's sum leaves it),
    nothing charged to node 0's users; a ClientApp whose own config seeds its noise is refused by a policy
    that requires OS entropy; and without a seed two runs' noise differs (the node draws its own)."""
    p = plan(3, min_nodes=2) if model == "distributed" else plan(3, dp_model="local", bits=0)
    grid = RecordingGrid(make_client_app(), 3)
    on_flower(p, grid)  # the honest run (every node's own noise), so the attacks below reuse its task
    honest = first_task(grid).content
    before = ledger_bytes(store)
    charged = NodeLedger(store, "lab").spent((0, 40))
    stripped = RecordDict({k: v for k, v in honest.items() if k != nodeside.NODE_SIDE})
    assert send(grid, 0, stripped) == "trust-model"
    job = codec.decode_task(honest).job
    central = codec.encode_task(dataclasses.replace(job, trust_json="{}"), 0, range(0, 40), codec.broadcast_record({}))
    assert send(grid, 0, central) == "trust-model"  # its users require distributed: a central job is refused
    assert send(grid, 0, copy_content(honest, **{nodeside.SEED: 1234, nodeside.SECURE: False})) == "node-noise"
    weaker = dataclasses.replace(p.privatizer.plan, noise_multiplier=p.privatizer.plan.noise_multiplier / 2)
    assert send(grid, 0, copy_content(honest, plan=nodeside.plan_json(weaker))) == "plan-noise"
    seeded = nodeside.NodeSettings(noise_seed=7)
    assert send(grid, 0, honest, settings=seeded) == "require-secure-noise"
    assert ledger_bytes(store) == before and NodeLedger(store, "lab").spent((0, 40)) == charged
    assert refused_rules(store)[-5:] == [
        "trust-model",
        "trust-model",
        "node-noise",
        "plan-noise",
        "require-secure-noise",
    ]
    # the node's own noise: two computations of one task's vector differ (no seed of the server's choosing)
    node = build_node(job)
    side = nodeside.NodeSidePlan(p.privatizer.plan, node.protocol)
    units = node.units(torch.arange(0, 40))
    vectors = [
        nodeside.node_message(node.protocol, 0, {}, units, 0, 40, side.plan, 0, nodeside.NodeSettings())[0].stats["W"]
        for _ in range(2)
    ]
    assert not torch.equal(vectors[0], vectors[1])


# ----- finding 2: SecAgg+ relays withheld, survivor sets that differ -----------------------------------
class Cheat(secaggplus.SecAggRounds):
    """The server's SecAgg+ side, playing dishonestly: node 0 gets the relays of ``relay_to_0`` only, and
    after the masked vectors arrive each node is told the survivor set ``views`` gives it."""

    relay_to_0: list[int] | None = None
    views: dict[int, list[int]] | None = None
    unmasked: list[dict[int, ConfigRecord]] = []

    def task_fields(self, p: int) -> dict[str, Any]:
        fields = super().task_fields(p)
        if p == 0 and self.relay_to_0 is not None:
            keep = [i for i, j in enumerate(fields[secaggplus.RELAY_IDS]) if j in self.relay_to_0]
            fields = {k: [v[i] for i in keep] for k, v in fields.items()}
        return fields

    def unmask(self, round: int, masked: Any, length: int) -> Any:
        if self.views is None:
            return super().unmask(round, masked, length)
        ask = {
            p: ConfigRecord({secaggplus.STAGE: "consistency", secaggplus.ROUND: round, secaggplus.IDS: v})
            for p, v in self.views.items()
        }
        sigs = {p: bytes(r[secaggplus.SIGNATURE]) for p, r in self._exchange(round, ask).items()}  # type: ignore[arg-type]
        signers = sorted(sigs)
        ask = {
            p: ConfigRecord(
                {
                    secaggplus.STAGE: "unmask",
                    secaggplus.ROUND: round,
                    secaggplus.IDS: v,
                    secaggplus.SIGNERS: signers,
                    secaggplus.SIGNATURES: [sigs[s] for s in signers],
                }
            )
            for p, v in self.views.items()
        }
        Cheat.unmasked.append(self._exchange(round, ask))
        raise RoundFailed(f"round {round}: the dishonest server unmasked nothing")


def cheat(monkeypatch: pytest.MonkeyPatch, relay_to_0: list[int] | None, views: dict[int, list[int]] | None) -> None:
    Cheat.unmasked = []

    def make(*args: Any) -> Cheat:
        c = Cheat(*args)
        c.relay_to_0, c.views = relay_to_0, views
        return c

    monkeypatch.setattr(secaggplus, "SecAggRounds", make)


def test_withheld_relays_leave_node_0_unmasked_by_nobody(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server relays node 0 no ciphertext and runs every other stage honestly (3 nodes, min-nodes 2):
    node 0 refuses its task (it would mask with its self mask only), so no vector of node 0 reaches the
    server; the honest nodes' sum is released without it, and node 0's users are charged nothing."""
    cheat(monkeypatch, relay_to_0=[], views=None)
    p = plan(3, min_nodes=2)
    grid = RecordingGrid(make_client_app(), 3)
    _, records = on_flower(p, grid)
    node0 = grid.replies("train")[0]
    assert node0 and all(r.has_error() and "secagg-relays" in r.error.reason for r in node0)
    assert all(r.diagnostics["nodes_survived"] == 2 for r in records)
    assert NodeLedger(store, "lab").spent((0, 40)) == (0.0, 0.0) and NodeLedger(store, "lab").spent((40, 120))[0] == 2.0
    assert "1/partition-0" not in json.loads(ledger_bytes(store))["runs"]
    assert set(refused_rules(store)) == {"secagg-relays"}


@pytest.mark.parametrize("relay_to_0", [[], [1]], ids=["no relay", "one relay"])
def test_different_survivor_sets_reveal_no_share_and_discard_the_round(
    store: Path, monkeypatch: pytest.MonkeyPatch, relay_to_0: list[int]
) -> None:
    """The attack that recovered node 0's vector before (3 nodes, min-nodes 2): node 0 gets one relay (node
    1's) and the survivors are told different sets — node 0 and node 2 that node 1 dropped, node 1 that
    node 2 dropped. Node 0 refuses to sign a set naming a neighbour it did not mask with, the others refuse
    to reveal without every surviving neighbour's signature on their set: no share of anything is revealed,
    the round is discarded with nothing released, node 0's run entry records why (its charge kept: its masked
    vector had left it). With no relay at all node 0 never masks and is charged nothing."""
    cheat(monkeypatch, relay_to_0=relay_to_0, views={0: [0, 2], 1: [0, 1], 2: [0, 2]})
    p = plan(3, min_nodes=2)
    grid = RecordingGrid(make_client_app(), 3)
    with pytest.raises(RoundFailed, match="unmasked nothing|min_nodes"):
        on_flower(p, grid)
    assert len(p.privatizer.ledger.releases) == 0
    assert all(not got for got in Cheat.unmasked)  # not one unmask answer, so no share of b_0 or s^sk of anyone
    unmask = [r for rs in grid.replies("unmask").values() for r in rs]
    assert all(r.has_error() for r in unmask)
    raw = json.loads(ledger_bytes(store) or b'{"runs": {}}')
    if relay_to_0:
        # it refused to sign; asked to unmask anyway, it refused that too (it had no signed set)
        assert [r["rule"] for r in raw["runs"]["1/partition-0"]["discarded"]] == ["secagg-survivors", "secagg-order"]
        assert "secagg-consistency" in refused_rules(store)
    else:
        assert "1/partition-0" not in raw["runs"] and "secagg-relays" in refused_rules(store)


# ----- finding 4: a stolen session's future round, chosen U, and repeats ------------------------------
def stolen_session(grid: RecordingGrid, message: FlowerMessage, thief: Any) -> None:
    """Before the honest run's first round-1 task, the thief (the run's session: node 0's own Context) acts."""
    if message.metadata.message_type == "train" and codec.decode_task(message.content).round == 1 and not thief.done:
        thief.done = True
        thief(grid)


def chosen(round: int, like: dict[str, torch.Tensor]) -> Any:
    g = torch.Generator().manual_seed(round)
    return {k: torch.linalg.qr(torch.randn(v.shape, dtype=v.dtype, generator=g))[0] for k, v in like.items()}


@pytest.mark.parametrize("model", ["distributed", "local", "central"])
def test_a_stolen_session_gets_no_future_round_no_chosen_U_and_repeats_from_the_store(
    store: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: str
) -> None:
    """Mid-run, a stolen session (node 0's run) asks round 3 of 4 under a U of its choosing, round 2 (one past
    the next), and repeats round 0's task exactly. The future rounds are refused (plan-reachable), the repeat
    is answered from the node's store with the honest reply's bytes, and the honest run completes with every
    node in every round. Under distributed DP a chosen U for the next round is refused too (the node derives
    U from round 0's release); under central DP the node pins the first broadcast of a round, so a thief's
    round-1 task that comes first is answered and the honest one is refused, reported to the server. Local DP
    is checked as distributed (without SecAgg+, the node derives U the same way)."""
    (tmp_path / "policy.toml").write_text(policy_text(model))
    cfg = {**SMALL, "rounds": 3}
    p = plan(4, cfg=cfg, dp_model=model) if model != "central" else plan(4, cfg=cfg, dp_model=model, min_fraction=0.5)
    grid = RecordingGrid(make_client_app(), 4)
    outcome: dict[str, Any] = {}

    def thief(grid: RecordingGrid) -> None:
        context = grid.context(0)  # the run's own session
        honest0 = first_task(grid).content
        task0 = codec.decode_task(honest0)
        U = {"U": torch.zeros(cfg["dim"], cfg["rank"], dtype=torch.float64)}
        for round in (3, 2):
            forged = codec.encode_task(
                task0.job, round, range(task0.start, task0.stop), codec.broadcast_record(chosen(round, U))
            )
            if model != "central":
                forged[nodeside.NODE_SIDE] = honest0.config_records[nodeside.NODE_SIDE].copy()
            outcome[f"round {round}"] = send(grid, 0, forged, context)
        repeat = send(grid, 0, honest0, context)
        outcome["repeat"] = (
            repeat if isinstance(repeat, str) else bytes(repeat.content.config_records[codec.TAG][codec.BLOB])
        )
        next_round = codec.encode_task(
            task0.job, 1, range(task0.start, task0.stop), codec.broadcast_record(chosen(1, U))
        )
        if model != "central":
            next_round[nodeside.NODE_SIDE] = honest0.config_records[nodeside.NODE_SIDE].copy()
        got = send(grid, 0, next_round, context)
        outcome["chosen next"] = got if isinstance(got, str) else "answered"

    thief.done = False  # type: ignore[attr-defined]
    grid.before = lambda g, m: stolen_session(g, m, thief)
    _, records = on_flower(p, grid)
    assert outcome["round 3"] == outcome["round 2"] == "plan-reachable"
    honest_reply = grid.replies("train")[0][0]
    assert outcome["repeat"] == bytes(honest_reply.content.config_records[codec.TAG][codec.BLOB])
    assert len(records) == 4  # the honest run completed
    if model != "central":
        assert outcome["chosen next"] == "plan-broadcast"
        assert all(r.diagnostics["nodes_survived"] == 4 for r in records)
    else:
        assert outcome["chosen next"] == "answered"  # central DP trusts the server with exact sums: first wins
        assert "rule 'plan-broadcast'" in records[1].dropped["partition-0"]  # the honest server is told why
        assert [r.accepted for r in records] == [4, 3, 4, 4]


# ----- finding 8: the release counts only the nodes SecAgg+ summed ------------------------------------
class ShareLost(InProcessGrid):
    """Partition 2's reply to the SecAgg+ share stage never reaches the server; with ``forge``, partition 2
    (a node that ignores its refusal) answers its train task anyway, with a vector of the right shape."""

    def __init__(self, app: ClientApp, partitions: int, forge: bool) -> None:
        super().__init__(app, partitions)
        self.forge = forge

    def push_messages(self, messages: Any) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        for m in messages:
            part = int(self.contexts[m.metadata.dst_node_id].node_config[codec.PARTITION_ID])
            rec = m.content.config_records.get(secaggplus.SECAGG)
            if part == 2 and rec is not None and rec["stage"] == "share":
                self._replies.pop(m.metadata.message_id, None)
            if part == 2 and self.forge and m.metadata.message_type == "train":
                task = codec.decode_task(m.content)
                plan_ = nodeside.read_plan(str(m.content.config_records[nodeside.NODE_SIDE][nodeside.PLAN]))
                names = [spec.name for spec in build_node(task.job).protocol.stat_specs(task.round)]
                encs = {k: plan_.encodings[k] for k in names}
                stats = {k: torch.randint(0, 2**e.bits, (e.padded,), dtype=torch.int64) for k, e in encs.items()}
                reply = codec.encode_reply(Message(stats, 0), task.round, task.digest)  # an honest node's shape
                self._replies[m.metadata.message_id] = FlowerMessage(reply, reply_to=m)
        return ids


@pytest.mark.parametrize("forge", [False, True], ids=["node 2 refuses", "node 2 answers anyway"])
def test_a_lost_share_reply_gives_the_local_run_without_that_node(monkeypatch: pytest.MonkeyPatch, forge: bool) -> None:
    """4 nodes, min-nodes 3, 16 bits: partition 2's SecAgg+ share reply is lost. It gets no relays and refuses
    its task, or (a node that answers anyway) its vector arrives but no mask of it can be rebuilt: either way
    the sum holds nodes 0, 1 and 3 only, and the release is counted so: U equals, bit for bit, the local
    runtime's run without node 2, and so do the ledger and its ε (counted as the 4 nodes that answered, the
    variance would be 4/3 of it and ε lower)."""
    seed = split_seed(config.build(AltMinConfig, SMALL))[1]
    flower = plan(4, min_nodes=3, secure_noise=False)
    state, records = on_flower(flower, ShareLost(make_client_app(noise_seed=seed), 4, forge))
    monkeypatch.setattr(local_nodes, "dropouts", lambda rate, seed: lambda round, node: node != 2)
    local = resolve(
        AltMinExperiment(), config.build(AltMinConfig, SMALL),
        config.build(RuntimeOptions, {"nodes": 4, "dp_model": "distributed", "bits": 16, "min_nodes": 3, "node_dropout": 0.25}),
    )  # fmt: skip
    local_state, _ = run_local(
        local.protocol, local.experiment.unit_source(local.cfg), local.privatizer, progress=False
    )
    torch.testing.assert_close(state["U"], local_state["U"], rtol=0, atol=0)
    assert flower.privatizer.ledger == local.privatizer.ledger
    assert ledger_epsilon(flower.privatizer.ledger, 1e-5) == ledger_epsilon(local.privatizer.ledger, 1e-5)
    assert all(r.diagnostics["nodes_survived"] == 3 for r in records)
    assert all(r.params["nodes_survived"] == 3 for r in flower.privatizer.ledger.releases)


def test_the_node_side_rules_of_the_policy_at_their_boundaries(tmp_path: Path) -> None:
    """min-nodes: a plan sized for exactly the policy's minimum is accepted, one fewer refused; trust-model:
    distributed accepts distributed and local, refuses central; bits: only the listed ones; collusion: shares
    that tolerate fewer colluders than the policy requires are refused."""
    from fedpers.runtime.flower.policy import check_bits, check_trust, load_policy

    (tmp_path / "p.toml").write_text(policy_text() + "bits = [16, 20]\n")
    policy = load_policy(tmp_path / "p.toml")
    check_trust(policy, "distributed", 2)
    with pytest.raises(PolicyRefused, match="rule 'min-nodes'"):
        check_trust(policy, "distributed", 1)
    check_trust(policy, "local", 1)  # min-nodes sizes distributed shares only
    with pytest.raises(PolicyRefused, match="rule 'trust-model'"):
        check_trust(policy, "central", 4)
    check_bits(policy, 16)
    for bits in (15, 17, 32):
        with pytest.raises(PolicyRefused, match="rule 'bits'"):
            check_bits(policy, bits)
    (tmp_path / "bad.toml").write_text(policy_text().replace('"distributed"', '"secure"'))
    with pytest.raises(ValueError, match="trust-model must be one of"):
        load_policy(tmp_path / "bad.toml")
    (tmp_path / "c.toml").write_text(policy_text() + "collusion = 1\n")
    policy = load_policy(tmp_path / "c.toml")
    check_trust(policy, "distributed", 2, 1)  # shares that tolerate exactly the policy's colluders
    with pytest.raises(PolicyRefused, match="rule 'collusion'"):
        check_trust(policy, "distributed", 4, 0)
