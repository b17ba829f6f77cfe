"""The node side of the Flower runtime: rebuild the public protocol, load this node's units,
call ``protocol.client_update``. No algorithm code lives here.

The runtime never looks an algorithm up: :func:`make_client_app` receives a
:data:`NodeBuilder` (the app layer's :func:`fedpers.app.build_node`) that turns a job and the
node's data file into the protocol and a unit loader. Per process, nodes are cached by job and
units by (job, unit range), so a long-lived Ray actor or SuperNode builds each once. Nothing
per-user goes into ``context.state`` (Flower ships every node's Context with each message).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import Context
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from fedpers.protocols.base import Message, Protocol, Units, client_message
from fedpers.runtime.flower import codec

log = logging.getLogger("fedpers.flower")
UNIT_CACHE_BYTES = 1 << 30
"""Most bytes of unit data one process keeps between rounds (least recently used go first)."""
USERS_PER_NODE = "users-per-node"
"""Node-config key: the run's users per node when it sets one (the node's range then follows it; default 0: the even split)."""
NODE_CACHE_ENV = "FEDPERS_NODE_CACHE"
"""A directory (node-local, private) where a node keeps its loaded units between processes: Flower
1.41 runs each message in a new process, so without it every round loads (or generates) them again."""


@dataclass(frozen=True)
class Node:
    """What a node needs for a job: the public protocol, and its units by global id."""

    protocol: Protocol
    units: Callable[[torch.Tensor], Units]
    num_units: int = 0
    """How many units the run's plan has, as this node computes it from its config and data (0: unknown)."""
    node_side: Callable[[codec.Trust], Any] | None = None
    """The job's trust model → the :class:`~fedpers.runtime.flower.nodeside.NodeSidePlan` this node derives
    from the job for it (distributed or local DP); None: this node runs no node-side plan."""


NodeBuilder = Callable[[codec.Job, str], Node]
"""(job, data file from the node config, "" if none) → :class:`Node`; raises ValueError for a job
this node cannot build (unknown algorithm, a data file the algorithm does not read)."""


@dataclass(frozen=True)
class NodeJob:
    node: Node
    digest: str
    sides: dict[str, Any] = field(default_factory=dict)
    """Trust model (JSON) → the node-side plan derived for it (once per process: it solves a calibration)."""

    @property
    def protocol(self) -> Protocol:
        return self.node.protocol

    def side(self, trust: codec.Trust) -> Any:
        """The :class:`~fedpers.runtime.flower.nodeside.NodeSidePlan` this node derives for ``trust``."""
        if self.node.node_side is None:
            from fedpers.runtime.flower.policy import PolicyRefused

            raise PolicyRefused(
                "trust-model", "this node cannot derive a node-side plan; it noises nothing on the server's word"
            )
        key = trust.to_json()
        if key not in self.sides:
            from fedpers.privacy.refusal import RefusedBeforeRelease
            from fedpers.runtime.flower.policy import PolicyRefused

            try:
                self.sides[key] = self.node.node_side(trust)
            except RefusedBeforeRelease as e:  # the job's own values cannot be noised as it claims
                raise PolicyRefused("plan-noise", str(e)) from None
        return self.sides[key]


_jobs: dict[tuple[str, str, str, str], NodeJob] = {}
_units: OrderedDict[tuple[str, str, str, int, int], Units] = OrderedDict()


def node_job(job: codec.Job, data_file: str, build: NodeBuilder) -> NodeJob:
    """The node ``build`` makes for ``job`` (once per process), checked against the server's protocol digest."""
    key = (job.algorithm, job.config_json, data_file, job.calibrations_json)  # the calibrations set the protocol's z
    if key not in _jobs:
        node = build(job, data_file)
        _jobs[key] = NodeJob(node, codec.protocol_digest(node.protocol))
    found = _jobs[key]
    if found.digest != job.digest:
        from fedpers.runtime.flower.policy import PolicyRefused

        logging.getLogger("fedpers.flower").warning("this node built protocol %s from the job", found.digest)
        raise PolicyRefused(  # the node's own digest stays in its log: its protocol is built from its data file
            "plan-job",
            f"protocol mismatch: this node built another protocol from the job than the server's {job.digest} "
            "(different fedpers version, or a data file that differs from the server's)",
        )
    return found


def run_device(job: codec.Job) -> torch.device:
    """The run's device as the job's config names it (``device``; cpu for an algorithm without one).
    In the Flower simulation ``cuda`` is the GPU share Ray gave this node's actor."""
    return torch.device(str(json.loads(job.config_json).get("device", "cpu")))


def node_units(job: codec.Job, data_file: str, node: NodeJob, start: int, stop: int) -> Units:
    """This node's units (ids ``start..stop-1``) on the run's device, loaded once per process and
    kept while they fit. A small range of generated users is read out of its
    :data:`SHARED_BLOCK`-user block, loaded whole (see :func:`_load_range`)."""
    lo, hi = _load_range(job, data_file, node, start, stop)
    key = (job.algorithm, job.config_json, data_file, lo, hi)
    if key in _units:
        _units.move_to_end(key)
        units = _units[key]
    else:
        units = _disk_cached(key, lambda: node.node.units(torch.arange(lo, hi)))
        device = run_device(job)  # kept there between rounds: a GPU node's users stay on its GPU
        units = {k: v.to(device) for k, v in units.items()}
        _units[key] = units
        while len(_units) > 1 and sum(_nbytes(u) for u in _units.values()) > UNIT_CACHE_BYTES:
            _units.popitem(last=False)
    if (lo, hi) == (start, stop):
        return units
    return {k: v[start - lo : stop - lo] for k, v in units.items()}  # views: no copy per call


@functools.lru_cache(maxsize=16)
def _reads_data(config_json: str) -> bool:
    """Whether the job's users come from a data set (``data``, ``dataset``) rather than the generator."""
    config = json.loads(config_json)
    return bool(config.get("data") or config.get("dataset"))


SHARED_BLOCK = 256
"""Generated users a process loads at once for the small ranges of the nodes it serves."""


def _load_range(job: codec.Job, data_file: str, node: NodeJob, start: int, stop: int) -> tuple[int, int]:
    """The ids to load for ``start..stop-1``: the range itself, or, for a range under
    :data:`SHARED_BLOCK` users generated from the public config (no data file, no ``data`` path),
    its aligned block. A simulation's node actor serves many one-user nodes, and which actor gets
    which node changes every round: one batched generation per block replaces one per node and
    actor (about 100x cheaper per user), and the block's rows equal each range's own."""
    total = node.node.num_units
    if data_file or stop - start >= SHARED_BLOCK or not 0 <= start < stop <= total or _reads_data(job.config_json):
        return start, stop
    lo = start - start % SHARED_BLOCK
    return lo, max(stop, min(lo + SHARED_BLOCK, total))


def _disk_cached(key: tuple, load: Any) -> Units:
    """``load()``, kept in ``$FEDPERS_NODE_CACHE`` (if set) under a digest of the job, the data
    file (path, size, mtime) and the unit range; written atomically, read memory-mapped."""
    import hashlib
    import os
    from pathlib import Path

    directory = os.environ.get(NODE_CACHE_ENV, "")
    if not directory:
        return load()
    data_file = key[2]
    stamp = ""
    if data_file and os.path.exists(data_file):
        st = os.stat(data_file)
        stamp = f"{os.path.abspath(data_file)}:{st.st_size}:{st.st_mtime_ns}"
    from fedpers import __version__

    name = hashlib.sha256(json.dumps([__version__, *map(str, key), stamp]).encode()).hexdigest()[:32] + ".pt"
    path = Path(directory) / name
    # Raw user data at rest: the cache directory is created 0700; one that others can reach fails the task.
    from fedpers.results.securefs import UnsafeDirectory, private_dir

    try:
        private_dir(path.parent)
    except UnsafeDirectory:
        raise
    except OSError as e:  # cannot be made: costs speed, never the round
        import logging

        logging.getLogger("fedpers.flower").warning(
            "%s=%s cannot be written (%s); this node loads its users for every message", NODE_CACHE_ENV, directory, e
        )
        return load()
    if path.is_file():
        try:
            return torch.load(path, mmap=True, weights_only=True)
        except Exception:
            path.unlink(missing_ok=True)
    units = load()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600: no other user reads a cached unit
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(units), f)
        os.replace(tmp, path)
    except OSError as e:  # a cache that cannot be written costs speed, never the round
        import contextlib
        import logging

        with contextlib.suppress(OSError):
            tmp.unlink()

        logging.getLogger("fedpers.flower").warning(
            "%s=%s cannot be written (%s); this node loads its users for every message", NODE_CACHE_ENV, directory, e
        )
    return units


def _nbytes(units: Units) -> int:
    return sum(t.numel() * t.element_size() for t in units.values())


def units_contributed(
    protocol: Protocol, round: int, broadcast: Mapping[str, torch.Tensor], units: Units, own_draw: bool = False
) -> int:
    """How many of ``units`` this node's message for ``round`` is computed over: the round's cohort
    (``units_in_round``: a cycle's block) narrowed to the ids ``client_update`` reads (``units_needed``: a
    Poisson cohort's sampled members), so a min-units check counts the users the message really holds.
    ``own_draw`` (distributed DP: the node draws its units' Poisson membership itself): the cohort before the
    draw, as a refusal on the sampled count would tell the server how many of this node's users were sampled."""
    count = protocol.units_in_round(round, units)
    if own_draw and "sampled" in broadcast:
        return count
    needed, _ = protocol.units_needed(round, broadcast)
    if needed is None:
        return count
    ids = units["ids"]
    return min(count, int(torch.isin(ids, needed.to(ids.device)).sum()))


def _node_config(context: Context, key: str) -> Any:
    if key not in context.node_config:
        raise ValueError(
            f'node config lacks {key!r}; start the SuperNode with --node-config "{codec.PARTITION_ID}=I {codec.NUM_PARTITIONS}=N"'
        )
    return context.node_config[key]


def handle_query(message: FlowerMessage, context: Context) -> FlowerMessage:
    """Discovery round: report this node's partition (its stable index)."""
    content = codec.encode_node(
        int(_node_config(context, codec.PARTITION_ID)), int(_node_config(context, codec.NUM_PARTITIONS))
    )
    return FlowerMessage(content, reply_to=message)


def handle_train(message: FlowerMessage, context: Context, build: NodeBuilder, settings: Any = None) -> FlowerMessage:
    """One round: the protocol's statistics summed over this node's units, after every check the node makes
    itself (its lab policy from ``$FEDPERS_POLICY``, the run's trust model, its plan and, under distributed or
    local DP, the broadcast it derives from the run's releases). A refusal is a
    :class:`~fedpers.runtime.flower.policy.PolicyRefused` naming its rule, raised before any computation and
    logged (in the node's store when it has a policy); ``settings``: the node's own
    :class:`~fedpers.runtime.flower.nodeside.NodeSettings` (its noise seed in the simulation)."""
    from fedpers.runtime.flower.nodeside import NodeSettings
    from fedpers.runtime.flower.policy import PolicyRefused, active_policy

    start = time.perf_counter()
    task = codec.decode_task(message.content)
    policy = active_policy()
    gate: Any = None
    if policy is not None:
        from fedpers.runtime.flower.nodeplan import node_gate

        partition = int(context.node_config.get(codec.PARTITION_ID, -1))
        gate = node_gate(
            policy, run=str(context.run_id), round=task.round, asked=range(task.start, task.stop), partition=partition
        )
    try:
        return _train(message, context, build, settings or NodeSettings(), task, policy, gate, start)
    except PolicyRefused as e:
        if gate is not None:
            gate.refuse(e)
        else:
            import logging

            logging.getLogger("fedpers.flower").warning("refused task of round %s: %s", task.round, e)
        raise


def _train(
    message: FlowerMessage,
    context: Context,
    build: NodeBuilder,
    settings: Any,
    task: codec.Task,
    policy: Any,
    gate: Any,
    start: float,
) -> FlowerMessage:
    from fedpers.runtime.flower.nodeside import (
        NODE,
        NODE_SIDE,
        PLAN,
        SECURE,
        SEED,
        check_broadcast,
        check_once,
        check_plan,
        derive_broadcast,
        mark_computed,
        read_plan,
    )
    from fedpers.runtime.flower.policy import PolicyRefused, check_bits, check_task, check_trust

    job = task.job
    try:
        trust = job.trust
    except ValueError as e:
        raise PolicyRefused("plan-job", str(e)) from None
    rec = message.content.config_records.get(NODE_SIDE)
    node_side = trust.dp_model != "central"
    if not node_side and rec is not None:
        raise PolicyRefused("trust-model", "a central run's task carries a node-side record")
    if node_side:  # every check a node makes of the trust model comes before anything is computed
        if rec is None:
            raise PolicyRefused(
                "trust-model",
                f"the run's dp_model is {trust.dp_model}: a task without its node-side record would release this "
                "node's exact sum",
            )
        taken = [k for k in (SEED, SECURE, NODE) if k in rec]
        if taken:
            raise PolicyRefused(
                "node-noise",
                f"the task sets {taken}: this node takes neither its noise nor its identity from a message (it draws "
                "from its own OS entropy, or from the seed its own configuration names in a simulation)",
            )
        if trust.nodes != (partitions := int(_node_config(context, codec.NUM_PARTITIONS))):
            raise PolicyRefused(
                "plan-nodes",
                f"the run's noise shares are sized for {trust.nodes} nodes; this node's config says {partitions}",
            )
    config = json.loads(job.config_json)
    if policy is not None:
        check_trust(policy, trust.dp_model, trust.min_nodes, trust.collusion)
        if node_side and settings.noise_seed is not None and policy.require_secure_noise:
            raise PolicyRefused(
                "require-secure-noise", "this node's own configuration seeds its noise, which its lab policy forbids"
            )
        check_task(
            policy, job.algorithm, config, task.stop - task.start
        )  # the range asked for, before any user is loaded
    data_file = str(context.node_config.get(codec.DATA_FILE, "") or "")
    node = node_job(job, data_file, build)
    if not 0 <= task.round < node.protocol.num_rounds:  # with or without a store: no release past the plan
        raise PolicyRefused(
            "plan-round", f"round {task.round} is outside the run's plan (rounds 0..{node.protocol.num_rounds - 1})"
        )
    if gate is not None:  # the node's own units under the run's plan, never the server's word
        from fedpers.runtime.flower.nodeplan import plan_units

        plan_units(
            gate,
            run=str(context.run_id),
            round=task.round,
            asked=range(task.start, task.stop),
            num_units=node.node.num_units,
            partition=int(_node_config(context, codec.PARTITION_ID)),
            partitions=int(_node_config(context, codec.NUM_PARTITIONS)),
            users_per_node=int(context.node_config.get(USERS_PER_NODE, 0)),
            num_rounds=node.protocol.num_rounds,
            job=job.key,
            config=config,
            digest=task.digest,
        )
        if gate.check():  # an identical repeat: the stored reply, or nothing (never computed twice)
            return _stored(gate, message, task)
    broadcast: Mapping[str, torch.Tensor] = task.broadcast
    side: Any = None
    if node_side:
        assert rec is not None
        side = node.side(trust)
        try:
            sent_plan = read_plan(str(rec[PLAN]))
        except (KeyError, ValueError) as e:
            raise PolicyRefused("plan-noise", str(e)) from None
        check_plan(str(rec[PLAN]), sent_plan, side.plan)
        if policy is not None and side.plan.model.value == "distributed":
            check_bits(policy, side.plan.bits)
        broadcast = derive_broadcast(context, job, side, task.round, rec, message.content)
        check_broadcast(broadcast, task.broadcast, task.round)
        check_once(context, task.round)
    units = node_units(job, data_file, node, task.start, task.stop)
    if policy is not None:  # the users this round's message would be computed over (a cohort may be fewer)
        contributed = units_contributed(node.protocol, task.round, broadcast, units, own_draw=node_side)
        check_task(policy, job.algorithm, config, contributed)
    secagg_node: Any = None
    if side is not None and side.plan.model.value == "distributed":
        from fedpers.runtime.flower.secaggplus import RELAY_IDS, receive_relays

        assert rec is not None  # a node-side run's task without its record was refused above
        if RELAY_IDS not in rec:
            raise PolicyRefused("secagg-relays", "a distributed-DP vector leaves this node only masked by SecAgg+")
        secagg_node = receive_relays(rec, context, task.round, side.plan)
    if gate is not None and gate.admit():  # charged and recorded last; a repeat that raced this one
        return _stored(gate, message, task)
    device = units["ids"].device
    on_device = {k: v.to(device) for k, v in broadcast.items()}
    if side is not None:
        from fedpers.runtime.flower.nodeside import node_message, node_summary

        partition = int(_node_config(context, codec.PARTITION_ID))
        mine, own = node_message(
            node.protocol,
            task.round,
            on_device,
            units,
            task.start,
            task.stop,
            side.plan,
            partition,
            settings,
            node.node.num_units,
        )
        node_summary(own, gate)  # its own counts reach its operator, never the reply
        if secagg_node is not None:
            from fedpers.runtime.flower.secaggplus import mask

            mine = mask(secagg_node, mine, context, task.round)
        mark_computed(context, task.round)
        symmetric: list[str] = []
    else:
        mine = client_message(node.protocol, task.round, on_device, units)
        symmetric = [spec.name for spec in node.protocol.stat_specs(task.round) if spec.symmetric]
    log.debug("round %d computed in %.3f s (this node's own timing, not sent)", task.round, time.perf_counter() - start)
    if gate is not None:
        gate.store(_dump_reply(mine, symmetric))
    return FlowerMessage(codec.encode_reply(mine, task.round, task.digest, symmetric), reply_to=message)


def _dump_reply(message: Message, symmetric: list[str]) -> bytes:
    import io

    buffer = io.BytesIO()
    stats = {k: v.detach().cpu() for k, v in message.stats.items()}
    torch.save({"stats": stats, "count": message.count, "zeroed": message.zeroed, "symmetric": symmetric}, buffer)
    return buffer.getvalue()


def _stored(gate: Any, message: FlowerMessage, task: codec.Task) -> FlowerMessage:
    """The stored reply to an identical repeat of this node's latest round (refused: an older round)."""
    import io

    from fedpers.runtime.flower.policy import PolicyRefused

    body = gate.stored()
    if body is None:
        raise PolicyRefused(
            "plan-once",
            f"round {task.round} was already computed; each unit's statistic is released once a round (only the "
            "latest round's reply is kept to answer a repeat)",
        )
    kept = torch.load(io.BytesIO(body), weights_only=True)
    reply = Message(kept["stats"], int(kept["count"]), int(kept["zeroed"]))
    content = codec.encode_reply(reply, task.round, task.digest, list(kept["symmetric"]))
    return FlowerMessage(content, reply_to=message)


class NodeError(RuntimeError):
    """What the server learns of a node's unexpected error: its type only. Flower sends a ClientApp's
    exception text to the server, and an error's text may quote the node's data (a malformed row, a value);
    the text and traceback stay in the node's own log."""


def errors_stay_on_the_node(handler: Callable[[FlowerMessage, Context], FlowerMessage]) -> Callable[..., FlowerMessage]:
    """``handler`` whose unexpected exceptions reach Flower as a :class:`NodeError` naming the type alone, after
    the node's own log got the whole text; a :class:`~fedpers.runtime.flower.policy.PolicyRefused` (its text
    written by fedpers from the plan and the policy) passes as it is."""

    @functools.wraps(handler)
    def wrapped(message: FlowerMessage, context: Context) -> FlowerMessage:
        from fedpers.runtime.flower.policy import PolicyRefused

        try:
            return handler(message, context)
        except PolicyRefused:
            raise
        except Exception as e:
            logging.getLogger("fedpers.flower").exception("this node's error (kept here, not released)")
            raise NodeError(
                f"{type(e).__name__} on the node (its text is in the node's own log: an error's text may quote its data)"
            ) from None

    return wrapped


def make_client_app(build: NodeBuilder, settings: Any = None) -> ClientApp:
    """The fedpers ClientApp: ``query`` for discovery, ``train`` for protocol rounds of the nodes ``build``
    makes, ``query.secagg`` for SecAgg+ stages. ``settings``: the nodes' own
    :class:`~fedpers.runtime.flower.nodeside.NodeSettings` (None: noise from OS entropy). Every handler's
    unexpected error reaches the server as its type alone (:func:`errors_stay_on_the_node`)."""
    app = ClientApp()
    app.query()(errors_stay_on_the_node(handle_query))
    from fedpers.runtime.flower.secaggplus import ACTION, handle_stage

    app.query(ACTION)(errors_stay_on_the_node(handle_stage))  # SecAgg+ stages under distributed DP

    @app.train()
    @errors_stay_on_the_node
    def train(message: FlowerMessage, context: Context) -> FlowerMessage:
        return handle_train(message, context, build, settings)

    return app
