"""SecAgg+ over Flower Messages: the distributed model's sum, with the server holding only masked vectors.

One SecAgg+ instance per release round, in the five stages of :mod:`fedpers.privacy.secagg` (the order of
Flower's own ``SecAggPlusWorkflow`` / ``secaggplus_mod``, with the consistency check of the malicious
setting added), each a Message exchange:

1. ``query.secagg`` *advertise* — the node draws fresh X25519 keys, an Ed25519 signing key and a self-mask
   seed b for this round and answers its three public keys;
2. ``query.secagg`` *share* — given its neighbours' public keys, the node answers its Shamir shares of
   (s^sk, b), each AES-GCM-encrypted for one neighbour (the server relays ciphertexts);
3. ``train`` (the round's task) *masked* — the task carries the ciphertexts addressed to the node; it
   masks only if they hold the shares of at least threshold − 1 neighbours, computes its noised integer
   vector (:func:`fedpers.runtime.flower.nodeside.node_message`), masks it and answers only the masked
   vector (uniform mod 2^b to anyone without the masks);
4. ``query.secagg`` *consistency* — given the survivors, the node signs that set (one per round) if it may
   reveal on it (:meth:`~fedpers.privacy.secagg.SecAggNode.check_view`);
5. ``query.secagg`` *unmask* — given the survivors and its surviving neighbours' signatures on them (the
   ones it checks), the node answers, for each
   neighbour, the share of b (survived) or of s^sk (dropped), only on the set it signed and that every
   surviving neighbour signed, and forgets the round.

Everything security-relevant a node uses is derived by the node itself, never taken from the server:
its SecAgg id is its own partition index, the neighbour graph, degree and threshold follow from the
plan's node count (:func:`fedpers.privacy.secagg.plus_degree`, ``default_threshold``: more than half of
each neighbourhood), the node count, min_nodes and bits it keys at *advertise* are checked against the plan
it derived from the job before it sends a masked vector. The stages must come in order, once each, and a
round is keyed once per run. The node keeps its round state in ``context.state`` (what Flower's
secaggplus_mod does: the simulation and a SuperNode keep a node's Context between messages). Trust: a server
that deviates from the protocol in any way but substituting public keys (it relays them); nodes colluding
with it learn nothing of a node with fewer than ``threshold`` colluding neighbours. Every refusal is a
:class:`~fedpers.runtime.flower.policy.PolicyRefused` naming its rule, logged in the node's store when it
has a lab policy (and, after the round's charge, recorded as the round discarded in its ledger).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, MessageType, RecordDict
from flwr.app import Message as FlowerMessage

from fedpers.privacy import distributed as dist
from fedpers.privacy import secagg
from fedpers.protocols.base import Message
from fedpers.runtime.driver import RoundFailed
from fedpers.runtime.flower import codec
from fedpers.runtime.flower.policy import PolicyRefused

Tensor = torch.Tensor
SECAGG = "fedpers.secagg"
"""Record key of a SecAgg+ stage (message content), of the relayed ciphertexts (in the masked stage's
node-side record) and of the node's round state (``context.state``)."""
KEYED = "fedpers.secagg-keyed"
"""``context.state`` record: the rounds this node keyed in this run (each at most once)."""
ACTION = "secagg"
"""The ClientApp's query action: SecAgg+ stages travel as ``query.secagg`` messages."""
MESSAGE_TYPE = f"{MessageType.QUERY}.{ACTION}"
STAGE, ROUND, NODES, MIN_NODES, BITS = "stage", "round", "nodes", "min-nodes", "bits"
IDS, C_PK, S_PK, G_PK, BLOBS, KINDS, SHARES = "ids", "c-pk", "s-pk", "g-pk", "blobs", "kinds", "shares"
SIGNATURE, SIGNERS, SIGNATURES = "signature", "signers", "signatures"
RELAY_IDS, RELAY_BLOBS = "secagg-from", "secagg-blobs"
"""Fields of the masked stage's node-side record: who sent each relayed ciphertext, and the ciphertexts."""
ORDER = {"advertise": "", "share": "advertise", "masked": "share", "consistency": "masked", "unmask": "consistency"}
"""Each stage → the stage the node's state must be at (advertise starts a round, once per round and run)."""


def round_tag(round: int) -> bytes:
    """The public tag binding one round's keys, channels and masks (both ends derive it)."""
    return hashlib.sha256(f"fedpers-secagg-round:{int(round)}".encode()).digest()[:16]


def graph(nodes: int, round: int) -> Mapping[int, Sequence[int]]:
    """The round's public neighbour graph over partitions 0..nodes−1 (both ends derive it)."""
    return secagg.plus_graph(nodes, round)


def threshold(nodes: int) -> int:
    """Shares needed to rebuild a secret: more than half of each neighbourhood's holders."""
    return secagg.plus_threshold(nodes)


def _int(rec: Mapping[str, Any], key: str) -> int:
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{SECAGG}: {key} must be an integer; got {type(value).__name__}")
    return value


def _ints(rec: Mapping[str, Any], key: str) -> list[int]:
    values = rec[key]
    if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{SECAGG}: {key} must be a list of integers")
    return [int(v) for v in values]


def _bytes(rec: Mapping[str, Any], key: str) -> bytes:
    value = rec[key]
    if not isinstance(value, bytes):
        raise ValueError(f"{SECAGG}: {key} must be bytes; got {type(value).__name__}")
    return value


def _blobs(rec: Mapping[str, Any], key: str) -> list[bytes]:
    values = rec[key]
    if not isinstance(values, list) or any(not isinstance(v, bytes) for v in values):
        raise ValueError(f"{SECAGG}: {key} must be a list of bytes")
    return [bytes(v) for v in values]


# ----- node side -----------------------------------------------------------------------------------
def config_record(records: RecordDict, key: str) -> ConfigRecord | None:
    """``records[key]`` when it is a ConfigRecord, else None: read directly (``RecordDict.config_records``
    builds and type-checks a view of every record on each access, a cost per stage that grows with the
    node's state)."""
    value = records.get(key)
    return value if isinstance(value, ConfigRecord) else None


def _load(context: Context, stage: str, round: int) -> tuple[secagg.SecAggNode, ConfigRecord]:
    state = config_record(context.state, SECAGG)
    want = ORDER[stage]
    if state is None or str(state.get(STAGE, "")) != want or state.get(ROUND, -1) != int(round):
        at = "none" if state is None else f"{state.get(STAGE)!r} of round {state.get(ROUND)!r}"
        raise PolicyRefused(
            "secagg-order",
            f"{SECAGG}: stage {stage!r} of round {round} must follow {want!r} of that round; this node is at {at}",
        )
    return secagg.SecAggNode.restore(state), state


def _save(context: Context, node: secagg.SecAggNode, stage: str, round: int, nodes: int, min_nodes: int) -> None:
    context.state[SECAGG] = ConfigRecord(
        {**node.export(), STAGE: stage, ROUND: int(round), NODES: int(nodes), MIN_NODES: int(min_nodes)}
    )


def _keyed_once(context: Context, round: int) -> None:
    """Record that this node keys ``round`` in this run; refused if it already did (a second set of keys for
    one round would let a server reveal the b-share of one key set and the s-share of another)."""
    keyed = config_record(context.state, KEYED)
    rounds = [] if keyed is None else _ints(keyed, ROUND)
    if int(round) in rounds:
        raise PolicyRefused("secagg-once", f"{SECAGG}: round {round} was already keyed in this run; keyed once a round")
    context.state[KEYED] = ConfigRecord({ROUND: [*rounds, int(round)]})


def _refusal(error: BaseException) -> PolicyRefused:
    """A node's refusal as a :class:`PolicyRefused` naming its rule."""
    if isinstance(error, PolicyRefused):
        return error
    if isinstance(error, secagg.ProtocolViolation):
        return PolicyRefused(error.rule, str(error))
    return PolicyRefused("secagg-malformed", f"{SECAGG}: {type(error).__name__}: {error}")


def record_refusal(context: Context, round: int, error: PolicyRefused, stage: str) -> None:
    """Log a refused SecAgg+ stage in the node's store (with a lab policy): ``refused.log``, and the round
    as discarded in the run's ledger entry once the run was charged."""
    from fedpers.runtime.flower.nodeplan import NodeLedger, node_store
    from fedpers.runtime.flower.policy import active_policy

    policy = active_policy()
    if policy is None:
        import logging

        logging.getLogger("fedpers.flower").warning("refused SecAgg+ %s of round %s: %s", stage, round, error)
        return
    ledger = NodeLedger(node_store(policy), policy.federation)
    partition = int(str(context.node_config.get(codec.PARTITION_ID, -1)))
    ledger.refused({"run": str(context.run_id), "round": int(round), "stage": stage, "partition": partition}, error)
    ledger.discarded(f"{context.run_id}/partition-{partition}", round, error)


def handle_stage(message: FlowerMessage, context: Context) -> FlowerMessage:
    """``query.secagg``: the advertise, share, consistency and unmask stages (no user data is read in any)."""
    rec = config_record(message.content, SECAGG)
    if rec is None:
        raise PolicyRefused("secagg-malformed", f"{SECAGG}: the message holds no {SECAGG} ConfigRecord")
    stage, round = str(rec[STAGE]), _int(rec, ROUND)
    try:
        out = _stage(stage, round, rec, context)
    except (PolicyRefused, secagg.AggregationAborted, ValueError, KeyError, TypeError) as e:
        refused = _refusal(e)
        record_refusal(context, round, refused, stage)
        raise refused from None
    return FlowerMessage(RecordDict({SECAGG: out}), reply_to=message)


def _stage(stage: str, round: int, rec: ConfigRecord, context: Context) -> ConfigRecord:
    me = int(str(context.node_config[codec.PARTITION_ID]))
    if stage == "advertise":
        nodes, min_nodes, bits = _int(rec, NODES), _int(rec, MIN_NODES), _int(rec, BITS)
        partitions = int(str(context.node_config[codec.NUM_PARTITIONS]))
        if nodes != partitions:  # the degree and threshold follow the node count: never the server's word alone
            raise PolicyRefused(
                "plan-nodes",
                f"{SECAGG}: the server says {nodes} nodes, this node's config says {partitions} partitions",
            )
        if not (1 <= min_nodes <= nodes and 0 <= me < nodes and 1 <= bits <= 32):
            raise ValueError(f"{SECAGG}: nodes={nodes}, min_nodes={min_nodes}, bits={bits} do not fit partition {me}")
        _keyed_once(context, round)
        node = secagg.SecAggNode(me, graph(nodes, round)[me], threshold(nodes), bits, round_tag(round))
        _save(context, node, stage, round, nodes, min_nodes)
        c_pk, s_pk, g_pk = node.advertise()
        return ConfigRecord({C_PK: c_pk, S_PK: s_pk, G_PK: g_pk})
    if stage == "share":
        node, state = _load(context, stage, round)
        ids = _ints(rec, IDS)
        keys = dict(zip(ids, zip(_blobs(rec, C_PK), _blobs(rec, S_PK), _blobs(rec, G_PK), strict=True), strict=True))
        shares = node.share(keys)
        _save(context, node, stage, round, _int(state, NODES), _int(state, MIN_NODES))
        return ConfigRecord({IDS: sorted(shares), BLOBS: [shares[j] for j in sorted(shares)]})
    if stage == "consistency":
        node, state = _load(context, stage, round)
        nodes, min_nodes = _int(state, NODES), _int(state, MIN_NODES)
        signature = node.sign(_ints(rec, IDS), min_nodes, graph(nodes, round))
        _save(context, node, stage, round, nodes, min_nodes)
        return ConfigRecord({SIGNATURE: signature})
    if stage == "unmask":
        node, state = _load(context, stage, round)
        nodes, min_nodes = _int(state, NODES), _int(state, MIN_NODES)
        signatures = dict(zip(_ints(rec, SIGNERS), _blobs(rec, SIGNATURES), strict=True))
        del context.state[SECAGG]  # one unmasking per round: the secrets are forgotten, refused or not
        revealed = node.unmask(_ints(rec, IDS), signatures, min_nodes, graph(nodes, round))
        ids = sorted(revealed)
        return ConfigRecord(
            {IDS: ids, KINDS: "".join(revealed[i][0] for i in ids), SHARES: [revealed[i][1] for i in ids]}
        )
    raise ValueError(f"{SECAGG}: unknown stage {stage!r}; expected advertise, share, consistency or unmask")


def receive_relays(rec: ConfigRecord, context: Context, round: int, plan: dist.DistributedPlan) -> secagg.SecAggNode:
    """The masked stage's checks, before the node computes anything: the round it keyed at *advertise*
    matches the plan it derived from the job, the relayed ciphertexts decrypt, and they hold the shares of
    at least threshold − 1 neighbours (else it masks nothing: refused, rule ``secagg-relays``). The node's
    state is unchanged until :func:`mask` saves it."""
    node, state = _load(context, "masked", round)
    keyed = (_int(state, NODES), _int(state, MIN_NODES), node.bits)
    if keyed != (plan.nodes, plan.min_nodes, plan.bits):
        raise PolicyRefused(
            "plan-secagg",
            f"{SECAGG}: keyed for (nodes, min_nodes, bits)={keyed}, the plan this node derives says "
            f"{(plan.nodes, plan.min_nodes, plan.bits)}",
        )
    try:
        node.receive(dict(zip(_ints(rec, RELAY_IDS), _blobs(rec, RELAY_BLOBS), strict=True)))
        node.check_relays()
    except Exception as e:  # a forged ciphertext (InvalidTag), a malformed relay, too few relays
        raise _refusal(e) from None
    return node


def mask(node: secagg.SecAggNode, mine: Message, context: Context, round: int) -> Message:
    """``mine`` (this node's integer vectors mod 2^b) masked by ``node`` (from :func:`receive_relays`)."""
    state = config_record(context.state, SECAGG)
    assert state is not None  # receive_relays loaded it
    names = sorted(mine.stats)
    y = torch.from_numpy(node.masked(concat(mine.stats, names)))
    _save(context, node, "masked", round, _int(state, NODES), _int(state, MIN_NODES))
    out, at = {}, 0
    for k in names:
        n = mine.stats[k].numel()
        out[k] = y[at : at + n].reshape(mine.stats[k].shape)
        at += n
    return Message(out, mine.count, mine.zeroed)


# ----- server side ---------------------------------------------------------------------------------
class SecAggRounds:
    """The server's side over a Grid: runs *advertise* and *share* before a round's task, gives the
    task its relayed ciphertexts, and after the masked vectors arrive runs *consistency* and *unmask* and
    rebuilds the survivors' sum mod 2^b. It only ever holds public keys, ciphertexts, masked vectors,
    signatures and the shares the survivors reveal."""

    def __init__(self, gather: Any, plan: dist.DistributedPlan, exchange: Callable[..., list[FlowerMessage]]) -> None:
        self.gather, self.plan, self.exchange = gather, plan, exchange
        """``exchange(grid, messages, timeout, stop)``: :func:`fedpers.runtime.flower.server.exchange`."""
        self.relayed: dict[int, dict[int, bytes]] = {}
        self.server: secagg.SecAggServer | None = None

    def _exchange(self, round: int, records: Mapping[int, ConfigRecord]) -> dict[int, ConfigRecord]:
        """Send each partition its stage record; the valid replies by partition (others: dropped)."""
        g, fed = self.gather, self.gather.federation
        sent = {fed.nodes[p]: p for p in records if p in fed.nodes}
        messages = [
            FlowerMessage(RecordDict({SECAGG: records[p]}), node, MESSAGE_TYPE, group_id=str(round))
            for node, p in sent.items()
        ]
        out: dict[int, ConfigRecord] = {}
        for reply in self.exchange(g.grid, messages, g.timeout, g.stop):
            p = sent.get(reply.metadata.src_node_id)
            rec = None if p is None or reply.has_error() else config_record(reply.content, SECAGG)
            if p is None or rec is None:
                continue
            out[p] = rec
        return out

    def setup(self, round: int) -> None:
        """*advertise* and *share*: afterwards :meth:`task_fields` gives each partition its ciphertexts."""
        plan = self.plan
        stage = ConfigRecord(
            {STAGE: "advertise", ROUND: int(round), NODES: plan.nodes, MIN_NODES: plan.min_nodes, BITS: plan.bits}
        )
        keys: dict[int, tuple[bytes, bytes, bytes]] = {}
        for p, r in self._exchange(round, dict.fromkeys(range(plan.nodes), stage)).items():
            try:
                keys[p] = (_bytes(r, C_PK), _bytes(r, S_PK), _bytes(r, G_PK))
            except (KeyError, ValueError):
                continue
        neighbours = graph(plan.nodes, round)
        records = {}
        for p in keys:
            ids = [j for j in neighbours[p] if j in keys]
            records[p] = ConfigRecord(
                {
                    STAGE: "share",
                    ROUND: int(round),
                    IDS: ids,
                    C_PK: [keys[j][0] for j in ids],
                    S_PK: [keys[j][1] for j in ids],
                    G_PK: [keys[j][2] for j in ids],
                }
            )
        self.relayed = {p: {} for p in range(plan.nodes)}
        sharers: set[int] = set()
        for i, r in self._exchange(round, records).items():
            try:
                pairs = dict(zip(_ints(r, IDS), _blobs(r, BLOBS), strict=True))
            except (KeyError, TypeError, ValueError):
                continue
            for j, blob in pairs.items():
                if j in self.relayed and j in neighbours[i]:
                    self.relayed[j][i] = blob
            sharers.add(i)
        self.server = secagg.SecAggServer(
            list(range(plan.nodes)), neighbours, threshold(plan.nodes), plan.bits, round_tag(round), dict(keys), sharers
        )
        if len(sharers) < plan.min_nodes:
            raise RoundFailed(
                f"round {round}: {len(sharers)} of {plan.nodes} nodes completed SecAgg+ key sharing, below "
                f"min_nodes={plan.min_nodes}; the round is discarded before any release"
            )

    def task_fields(self, p: int) -> dict[str, Any]:
        """What partition p's task carries for the masked stage: the ciphertexts addressed to it."""
        server = self.server
        relayed = self.relayed.get(p, {}) if server is not None and p in server.sharers else {}
        ids = sorted(i for i in relayed if server is not None and i in server.sharers)
        return {RELAY_IDS: ids, RELAY_BLOBS: [relayed[i] for i in ids]}

    def unmask(self, round: int, masked: Mapping[int, np.ndarray], length: int) -> tuple[np.ndarray, list[int]]:
        """*consistency* and *unmask*: the sum mod 2^b of the survivors (the partitions of ``masked`` that
        shared keys, each of which signed that set), and the survivors it sums; RoundFailed when one of them
        does not sign, too few answer or too few shares rebuild a mask (nothing is released)."""
        server = self.server
        if server is None:
            raise RoundFailed(f"round {round}: SecAgg+ unmasking before key sharing")
        try:
            survivors = sorted(p for p in masked if p in server.sharers)
            if len(survivors) < self.plan.min_nodes:
                raise RoundFailed(
                    f"round {round}: {len(survivors)} masked inputs, below min_nodes={self.plan.min_nodes}; "
                    "the round is discarded before any release"
                )
            ask = ConfigRecord({STAGE: "consistency", ROUND: int(round), IDS: survivors})
            signatures: dict[int, bytes] = {}
            for p, r in self._exchange(round, dict.fromkeys(survivors, ask)).items():
                try:
                    signatures[p] = _bytes(r, SIGNATURE)
                except (KeyError, ValueError):
                    continue
            if set(signatures) != set(survivors):
                raise RoundFailed(
                    f"round {round}: survivors {sorted(set(survivors) - set(signatures))} did not sign the survivor "
                    "set (SecAgg+ consistency); the round is discarded before any release"
                )
            # each node is sent the signatures it checks (its surviving neighbours'): O(degree) a node, not O(n)
            asks = {}
            for p in survivors:
                signers = [j for j in server.graph[p] if j in signatures]
                asks[p] = ConfigRecord(
                    {
                        STAGE: "unmask",
                        ROUND: int(round),
                        IDS: survivors,
                        SIGNERS: signers,
                        SIGNATURES: [signatures[j] for j in signers],
                    }
                )
            revealed: dict[int, dict[int, tuple[str, bytes]]] = {}
            for p, r in self._exchange(round, asks).items():
                try:
                    ids, kinds, shares = _ints(r, IDS), str(r[KINDS]), _blobs(r, SHARES)
                    revealed[p] = dict(zip(ids, zip(kinds, shares, strict=True), strict=True))
                except (KeyError, TypeError, ValueError):
                    continue
            try:
                total = server.unmasked_sum({p: masked[p] for p in survivors}, revealed, length)
            except secagg.AggregationAborted as e:
                raise RoundFailed(
                    f"round {round}: SecAgg+ aborted ({e}); the round is discarded before any release"
                ) from None
            return total, survivors
        finally:
            self.server = None


def concat(vectors: Mapping[str, Tensor], names: Sequence[str]) -> np.ndarray:
    """The statistics a node masks as one vector, in ``names`` order (sorted, as the node does)."""
    return np.concatenate([vectors[k].cpu().numpy().astype(np.int64).ravel() for k in names])
