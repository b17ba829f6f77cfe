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
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Context
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from fedpers.protocols.base import Protocol, Units, client_message
from fedpers.runtime.flower import codec

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
    node_side_plan: Callable[[Any], Any] | None = None
    """Sent plan → the plan this node derives from the job for the same trust model and node counts
    (distributed or local DP: a node refuses any other); None: this node refuses node-side plans."""


NodeBuilder = Callable[[codec.Job, str], Node]
"""(job, data file from the node config, "" if none) → :class:`Node`; raises ValueError for a job
this node cannot build (unknown algorithm, a data file the algorithm does not read)."""


@dataclass(frozen=True)
class NodeJob:
    node: Node
    digest: str

    @property
    def protocol(self) -> Protocol:
        return self.node.protocol


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
        raise ValueError(
            f"protocol mismatch: this node built protocol {found.digest} from the job, the server sent {job.digest} "
            "(different fedpers version, or a data file that differs from the server's)"
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


def handle_train(message: FlowerMessage, context: Context, build: NodeBuilder) -> FlowerMessage:
    """One round: the protocol's statistics summed over this node's units."""
    start = time.perf_counter()
    task = codec.decode_task(message.content)
    data_file = str(context.node_config.get(codec.DATA_FILE, "") or "")
    # The lab's policy ($FEDPERS_POLICY) is checked on every task before any computation.
    from fedpers.runtime.flower.policy import active_policy, check_task

    policy = active_policy()
    if policy is not None:  # the range asked for, before any user is loaded
        check_task(policy, task.job.algorithm, json.loads(task.job.config_json), task.stop - task.start)
    node = node_job(task.job, data_file, build)
    if policy is not None:  # the node's own units under the run's plan, never the server's word
        _enforce(policy, context, task, node, admit=False)
    units = node_units(task.job, data_file, node, task.start, task.stop)
    if policy is not None:  # the users this round's message would be computed over (a cohort may be fewer)
        check_task(
            policy,
            task.job.algorithm,
            json.loads(task.job.config_json),
            node.protocol.units_in_round(task.round, units),
        )
        _enforce(policy, context, task, node, admit=True)  # charged and recorded last
    device = units["ids"].device
    broadcast = {k: v.to(device) for k, v in task.broadcast.items()}
    digest = task.digest
    from fedpers.runtime.flower.nodeside import NODE_SIDE, node_message

    if NODE_SIDE in message.content.config_records:  # distributed or local DP: this node noises its own sum
        rec = message.content.config_records[NODE_SIDE]
        mine = node_message(
            node.protocol, task.round, broadcast, units, task.start, task.stop, rec, node.node.node_side_plan, context
        )
        return FlowerMessage(
            codec.encode_reply(mine, time.perf_counter() - start, task.round, digest), reply_to=message
        )
    reply = client_message(node.protocol, task.round, broadcast, units)
    symmetric = [spec.name for spec in node.protocol.stat_specs(task.round) if spec.symmetric]
    return FlowerMessage(
        codec.encode_reply(reply, time.perf_counter() - start, task.round, digest, symmetric), reply_to=message
    )


def _enforce(policy: Any, context: Context, task: codec.Task, node: NodeJob, *, admit: bool) -> None:
    """:func:`fedpers.runtime.flower.nodeplan.enforce_plan` for this task (deployments with a policy)."""
    from fedpers.runtime.flower.nodeplan import enforce_plan

    job = task.job
    enforce_plan(
        policy,
        run=str(context.run_id),
        round=task.round,
        asked=range(task.start, task.stop),
        num_units=node.node.num_units,
        partition=int(_node_config(context, codec.PARTITION_ID)),
        partitions=int(_node_config(context, codec.NUM_PARTITIONS)),
        users_per_node=int(context.node_config.get(USERS_PER_NODE, 0)),
        num_rounds=node.protocol.num_rounds,
        job=f"{job.algorithm}|{job.digest}|{job.config_json}|{job.calibrations_json}",
        config=json.loads(job.config_json),
        admit=admit,
    )


def make_client_app(build: NodeBuilder) -> ClientApp:
    """The fedpers ClientApp: ``query`` for discovery, ``train`` for protocol rounds of the nodes ``build`` makes."""
    app = ClientApp()
    app.query()(handle_query)
    from fedpers.runtime.flower.secaggplus import ACTION, handle_stage

    app.query(ACTION)(handle_stage)  # SecAgg+ stages under distributed DP (no user data read)

    @app.train()
    def train(message: FlowerMessage, context: Context) -> FlowerMessage:
        return handle_train(message, context, build)

    return app
