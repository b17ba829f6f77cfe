"""Flower message encoding: one place for every record name and key, shared by both ends.

A training instruction is a Flower ``RecordDict`` with one ``ConfigRecord``: the job
(algorithm, public config as JSON, protocol digest), the round, the node's unit range and
the broadcast tensors packed into one byte string. A reply is one ``ConfigRecord`` too: the
round and broadcast digest it answers, the unit count and the summed statistics, packed.
Flower 1.41 sends every record, array and array chunk as an object of its own, one call
per object per hop (six hops a round), so packing makes a task 3 objects instead of 6 and a
reply 3 instead of 9; tensors over :data:`INLINE_BYTES` go as one chunked ``Array``.
Decoding a reply never trusts it: anything malformed raises :class:`MalformedReply`, which
the server turns into a drop.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.constant import SType

from fedpers import config as config_lib
from fedpers.protocols.base import Message, Protocol
from fedpers.runtime.flower.policy import TRUST_MODELS

Tensor = torch.Tensor

# Record names inside a RecordDict.
JOB = "fedpers.job"
TAG = "fedpers.tag"
TENSORS = "fedpers.tensors"
NODE = "fedpers.node"

# Keys inside the job ConfigRecord.
ALGORITHM = "algorithm"
CONFIG = "config"
DIGEST = "protocol-digest"
ROUND = "round"
UNIT_START = "unit-start"
UNIT_STOP = "unit-stop"

# Keys of packed tensors (in the job or tag ConfigRecord; BLOB also names the Array of large ones).
LAYOUT = "tensors"
BLOB = "tensor-bytes"
INLINE_BYTES = 4 << 20
"""Packed tensors up to this size travel inside the ConfigRecord (Flower chunks arrays at 5 MiB)."""
DTYPES = frozenset({"<f8", "<f4", "<f2", "<i8", "<i4", "<i2", "|i1", "|u1", "|b1"})
"""The only dtypes a packed layout may name."""

# Keys inside the reply's tag ConfigRecord.
DIGEST_OF_BROADCAST = "broadcast-digest"
UNITS = "units"
ZEROED = "zeroed"

# Node-config keys (Flower's own partition keys, plus an optional data file per node).
PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
DATA_FILE = "data-file"


class MalformedReply(ValueError):
    """A client reply that cannot be decoded into a protocol message."""


@dataclass(frozen=True)
class Trust:
    """The run's trust model as every node pins it with the job: who adds the noise and, under distributed
    or local DP, the node count, the fewest survivors whose noise shares must reach a sum (``min_nodes``), the
    bits of the modular sum (0: chosen from the plan) and the run's users per node (0: the even split). A node
    derives its noise plan from these and the public job, never from the server's plan."""

    dp_model: str = "central"
    nodes: int = 0
    min_nodes: int = 0
    bits: int = 0
    users_per_node: int = 0
    collusion: int = 0
    """Nodes that may collude with the server: shares sized for min_nodes − collusion honest survivors."""

    def __post_init__(self) -> None:
        if self.dp_model not in TRUST_MODELS:
            raise ValueError(f"trust model {self.dp_model!r} is not one of {list(TRUST_MODELS)}")
        numbers = (self.nodes, self.min_nodes, self.bits, self.users_per_node, self.collusion)
        if not all(_is_int(n) and n >= 0 for n in numbers):
            raise ValueError(
                f"trust: nodes, min_nodes, bits, users_per_node, collusion must be integers >= 0; got {numbers}"
            )
        if self.dp_model != "central" and not 1 <= self.min_nodes <= self.nodes:
            raise ValueError(f"trust: min_nodes must be in [1, nodes={self.nodes}]; got {self.min_nodes}")
        if self.collusion and not (self.dp_model == "distributed" and self.collusion < self.min_nodes):
            raise ValueError(
                f"trust: collusion must be in [0, min_nodes={self.min_nodes}) under distributed DP; got {self.collusion}"
            )

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @staticmethod
    def of(options: Any) -> Trust:
        """The trust model of runtime options (``dp_model``, ``nodes``, ``min_nodes`` 0 for all, ``bits``)."""
        model = str(getattr(options.dp_model, "value", options.dp_model))
        if model == "central":
            return Trust()
        nodes = int(options.nodes)
        collusion = int(getattr(options, "collusion", 0))
        return Trust(
            model, nodes, int(options.min_nodes) or nodes, int(options.bits), int(options.users_per_node), collusion
        )


@dataclass(frozen=True)
class Job:
    """What every node needs to rebuild the public protocol: never the noise seed."""

    algorithm: str
    config_json: str
    digest: str
    calibrations_json: str = "{}"
    """The server's noise calibrations (public: key → noise multiplier), so nodes need no accountant."""
    trust_json: str = "{}"
    """The run's :class:`Trust` (``{}``: central DP), pinned with the rest of the job by every node."""

    @staticmethod
    def of(
        algorithm: str,
        cfg: Any,
        protocol: Protocol,
        calibrations: Mapping[str, float] | None = None,
        trust: Trust | None = None,
    ) -> Job:
        return Job(
            algorithm,
            json.dumps(config_lib.to_dict(cfg), sort_keys=True),
            protocol_digest(protocol),
            json.dumps(dict(calibrations or {}), sort_keys=True),
            "{}" if trust is None or trust == Trust() else trust.to_json(),
        )

    @property
    def trust(self) -> Trust:
        """The job's :class:`Trust`; a ValueError for one that is not (the node refuses the task)."""
        return _read_trust(self.trust_json)

    @property
    def key(self) -> str:
        """Everything a node pins of a run's job, as one string."""
        return "|".join((self.algorithm, self.digest, self.config_json, self.calibrations_json, self.trust_json))


@functools.lru_cache(maxsize=16)
def _read_trust(text: str) -> Trust:
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise TypeError("not an object")
        return Trust(**raw)
    except (ValueError, TypeError) as e:
        raise ValueError(f"job: malformed trust model {text[:120]!r} ({e})") from None


@dataclass(frozen=True)
class Task:
    """One decoded training instruction."""

    job: Job
    round: int
    start: int
    stop: int
    broadcast: dict[str, Tensor]
    digest: str = ""
    """:func:`broadcast_digest` of ``round`` and ``broadcast`` (what the reply answers)."""


def protocol_digest(protocol: Protocol) -> str:
    """Fingerprint of the public protocol, so a node built from other code or data is refused."""
    return hashlib.sha256(repr(protocol).encode()).hexdigest()[:16]


CALIBRATIONS = "calibrations"
TRUST = "trust"


def job_record(job: Job) -> ConfigRecord:
    rec = ConfigRecord(
        {ALGORITHM: job.algorithm, CONFIG: job.config_json, DIGEST: job.digest, CALIBRATIONS: job.calibrations_json}
    )
    if job.trust_json != "{}":
        rec[TRUST] = job.trust_json
    return rec


def read_job(content: RecordDict) -> Job:
    rec = content[JOB]
    return Job(
        str(rec[ALGORITHM]),
        str(rec[CONFIG]),
        str(rec[DIGEST]),
        str(rec.get(CALIBRATIONS, "{}") or "{}"),
        str(rec.get(TRUST, "{}") or "{}"),
    )


@dataclass(frozen=True)
class Packed:
    """Tensors as one byte string: ``layout`` (JSON of [name, dtype, shape]) and a ``payload``
    of inline bytes or, above :data:`INLINE_BYTES`, an ``ArrayRecord`` of one uint8 Array."""

    layout: str
    payload: bytes | ArrayRecord

    def into(self, rec: ConfigRecord, content: dict[str, Any], array: str = TENSORS) -> None:
        """Into ``rec`` (layout, inline bytes) or, above :data:`INLINE_BYTES`, ``content[array]``."""
        rec[LAYOUT] = self.layout
        if isinstance(self.payload, bytes):
            rec[BLOB] = self.payload
        else:
            content[array] = self.payload


NUMPY_STYPE = SType.NUMPY
"""Flower's serialization type of an ``Array`` holding ``np.save`` bytes (what ``Array.numpy()`` reads)."""


def pack(tensors: Mapping[str, Tensor]) -> Packed:
    """The tensors' bytes copied once, straight into the message's byte string (a host tensor is
    read in place; above :data:`INLINE_BYTES` the string is the ``.npy`` form ``Array`` decodes)."""
    layout, parts = [], []
    for name in sorted(tensors):
        a = tensors[name].detach().cpu().contiguous().numpy()
        layout.append([name, a.dtype.str, list(a.shape)])
        parts.append(a.reshape(-1).view(np.uint8).data)
    size = sum(part.nbytes for part in parts)
    text = json.dumps(layout)
    if size <= INLINE_BYTES:
        return Packed(text, b"".join(parts))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (size,)})
    npy = b"".join([header.getvalue(), *parts])  # what np.save writes, without the concatenated copy
    return Packed(text, ArrayRecord({BLOB: Array(dtype="|u1", shape=(size,), stype=NUMPY_STYPE, data=npy)}))


def unpack(rec: ConfigRecord, content: RecordDict, what: str, array: str = TENSORS) -> dict[str, Tensor]:
    """Tensors packed by :func:`pack`; raises :class:`MalformedReply` on any inconsistency
    (unknown dtype, negative or mismatched shapes, bytes missing or left over, repeated names)."""
    try:
        text = str(rec[LAYOUT])
        data: bytes | np.ndarray
        if BLOB in rec:
            inline = rec[BLOB]
            if not isinstance(inline, bytes):
                raise MalformedReply(f"{what}: {BLOB} must be bytes")
            data = inline
        else:
            packed = content.array_records[array][BLOB]
            try:
                data = packed.numpy()
            except Exception as e:
                raise MalformedReply(f"{what}: cannot decode its tensors ({type(e).__name__}: {e})") from None
            if data.dtype != np.uint8 or data.ndim != 1:
                raise MalformedReply(f"{what}: packed tensors must be a 1-D uint8 array; got {data.dtype} {data.shape}")
    except MalformedReply:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise MalformedReply(f"{what} lacks its tensors ({type(e).__name__}: {e})") from None
    out: dict[str, Tensor] = {}
    offset = 0
    for name, dtype, shape, count, size in _layout(text, what):
        if offset + size > len(data):
            raise MalformedReply(f"{what}: {name} needs {size} bytes at offset {offset}; only {len(data)} sent")
        out[name] = torch.from_numpy(np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape).copy())
        offset += size
    if offset != len(data):
        raise MalformedReply(f"{what}: {len(data) - offset} bytes beyond its tensor layout")
    return out


LayoutEntries = tuple[tuple[str, np.dtype, tuple[int, ...], int, int], ...]
LAYOUT_CACHE_CHARS = 4096
"""Layouts up to this length are parsed once per process (a run sends a few, each on every message);
longer ones, which no fedpers protocol sends, are parsed each time, so a sender cannot make the cache
hold more than 64 × this many characters."""


def _layout(text: str, what: str) -> LayoutEntries:
    """A packed layout's entries (name, dtype, shape, count, bytes), checked: JSON of a list of
    [name, dtype, shape] with a known dtype, non-negative int dims, no repeated name; raises
    :class:`MalformedReply`. A pure function of the text: a short one is parsed once per process
    (every task of a round, every reply of a protocol share one); a refused layout is never
    cached (an exception is not a result), so it is refused on every message."""
    return _cached_layout(text, what) if len(text) <= LAYOUT_CACHE_CHARS else _parse_layout(text, what)


def _parse_layout(text: str, what: str) -> LayoutEntries:
    try:
        layout = json.loads(text)
    except ValueError as e:
        raise MalformedReply(f"{what} lacks its tensors ({type(e).__name__}: {e})") from None
    if not isinstance(layout, list):
        raise MalformedReply(f"{what}: the tensor layout must be a list")
    entries, names = [], set()
    for entry in layout:
        ok = (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and entry[1] in DTYPES
            and isinstance(entry[2], list)
        )
        if (
            not ok
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry[2])
            or entry[0] in names
        ):
            raise MalformedReply(f"{what}: bad tensor layout entry {str(entry)[:80]}")
        names.add(entry[0])
        dtype, shape = np.dtype(entry[1]), tuple(entry[2])
        count = math.prod(shape)
        entries.append((entry[0], dtype, shape, count, count * dtype.itemsize))
    return tuple(entries)


_cached_layout = functools.lru_cache(maxsize=64)(_parse_layout)


def broadcast_record(broadcast: Mapping[str, Tensor]) -> Packed:
    """The round's public tensors, serialised once and shared by every node's message."""
    return pack(broadcast)


def encode_task(job: Job, round: int, units: range, broadcast: Packed) -> RecordDict:
    return TaskEncoder(job, round, broadcast)(units)


class TaskEncoder:
    """A round's tasks, one per node's unit range: the job, round and broadcast entries are checked
    by Flower once per round (``ConfigRecord`` type-checks every entry it is given) and copied per
    node with ``ConfigRecord.copy`` (a shallow copy of immutable str/bytes/int values), so a task
    costs two checked entries, not nine; every task carries the same entries as one built alone."""

    def __init__(self, job: Job, round: int, broadcast: Packed) -> None:
        self.record = job_record(job)
        self.record[ROUND] = int(round)
        self.content: dict[str, Any] = {}
        broadcast.into(self.record, self.content)

    def __call__(self, units: range) -> RecordDict:
        rec = self.record.copy()
        rec[UNIT_START], rec[UNIT_STOP] = int(units.start), int(units.stop)
        return RecordDict({JOB: rec, **self.content})


def decode_task(content: RecordDict) -> Task:
    rec = content[JOB]
    if not isinstance(rec, ConfigRecord):
        raise MalformedReply(f"task: {JOB} must be a ConfigRecord; got {type(rec).__name__}")
    broadcast = unpack(rec, content, "task")
    round = _number(rec, ROUND)
    inline = rec.get(BLOB)
    digest = (
        _packed_digest(round, str(rec[LAYOUT]), inline)
        if isinstance(inline, bytes)
        else broadcast_digest(round, broadcast)
    )
    return Task(read_job(content), round, _number(rec, UNIT_START), _number(rec, UNIT_STOP), broadcast, digest)


@functools.lru_cache(maxsize=4)
def _packed_digest(round: int, layout: str, payload: bytes) -> str:
    """:func:`broadcast_digest` read off a packed broadcast that :func:`unpack` accepted (its
    layout names each tensor's dtype and shape, its payload is their bytes in layout order):
    the same digest, computed once per round in a process that serves many nodes."""
    view, offset, parts = memoryview(payload), 0, {}
    for name, dtype, shape in json.loads(layout):
        size = math.prod(shape) * np.dtype(dtype).itemsize
        # broadcast_digest formats shapes through np.ascontiguousarray, which makes a scalar 1-D
        parts[name] = (f";{name}:{dtype}:{tuple(shape) or (1,)}:".encode(), view[offset : offset + size])
        offset += size
    h = hashlib.sha256(f"round={int(round)}".encode())
    for name in sorted(parts):
        h.update(parts[name][0])
        h.update(parts[name][1])
    return h.hexdigest()


def _number(rec: ConfigRecord, key: str) -> int:
    """``int(rec[key])``: a list value raises TypeError, as ``int()`` does."""
    value = rec[key]
    if isinstance(value, list):
        raise TypeError(f"{key} must be a number, not a list")
    return int(value)


def _is_int(value: object) -> TypeGuard[int]:
    """An int, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def broadcast_digest(round: int, broadcast: Mapping[str, Tensor]) -> str:
    """SHA-256 of a round's number and broadcast (names, dtypes, shapes, bytes): what a reply answers."""
    h = hashlib.sha256(f"round={int(round)}".encode())
    for name in sorted(broadcast):
        a = np.ascontiguousarray(broadcast[name].detach().cpu().numpy())
        h.update(f";{name}:{a.dtype.str}:{a.shape}:".encode())
        h.update(a.tobytes())
    return h.hexdigest()


PACKED = "packed"
"""Tag key: the comma-separated names of symmetric statistics sent as their upper triangle."""


def encode_reply(message: Message, round: int, digest: str, symmetric: Iterable[str] = ()) -> RecordDict:
    """A client's reply, tagged with the round and the digest of the broadcast it answers: its statistics
    and the message's counts, nothing else (no timing: a node's compute time follows its users' data).

    ``symmetric`` statistics travel as their packed upper triangle (half the bytes); the
    server rebuilds them symmetric, so such a reply cannot be asymmetric at all.
    """
    packed = sorted(n for n in symmetric if n in message.stats and message.stats[n].dim() == 2)
    tag = ConfigRecord(
        {
            ROUND: int(round),
            DIGEST_OF_BROADCAST: str(digest),
            PACKED: ",".join(packed),
            UNITS: int(message.count),
            ZEROED: int(message.zeroed),
        }
    )
    content: dict[str, Any] = {TAG: tag}
    pack({k: (_triu(v) if k in packed else v) for k, v in message.stats.items()}).into(tag, content)
    return RecordDict(content)


def _triu(a: Tensor) -> Tensor:
    upper, _ = _triu_flat(a.shape[0], a.shape[1])
    return a.reshape(-1).index_select(0, upper.to(a.device))


@functools.lru_cache(maxsize=8)
def _triu_flat(rows: int, cols: int) -> tuple[Tensor, Tensor]:
    """Flat indices of the upper triangle (row-major) and of its mirror, made once per shape:
    a node packs, and the server unpacks, the same shape every call (one gather, no 2-D indexing)."""
    i, j = torch.triu_indices(rows, cols)
    return i * cols + j, j * cols + i


def _untriu(t: Tensor, name: str) -> Tensor:
    size = int(t.numel())
    n = round((math.sqrt(8 * size + 1) - 1) / 2)
    if t.dim() != 1 or n * (n + 1) // 2 != size:
        raise MalformedReply(
            f"{name}: a packed symmetric statistic must be a 1-D upper triangle; got shape {tuple(t.shape)}"
        )
    # one gather: entry (i, j) and its mirror (j, i) both read the same sent number
    return t.index_select(0, _triu_source(n).to(t.device)).view(n, n)


@functools.lru_cache(maxsize=8)
def _triu_source(n: int) -> Tensor:
    """For each entry of an n×n matrix (row-major), its position in the packed upper triangle."""
    upper, lower = _triu_flat(n, n)
    source = torch.empty(n * n, dtype=torch.long)
    positions = torch.arange(upper.numel())
    source[lower] = positions
    source[upper] = positions  # upper and lower together cover every entry
    return source


def decode_reply(content: RecordDict, expect: tuple[int, str] | None = None) -> Message:
    """Protocol message from a reply; raises :class:`MalformedReply` on anything unexpected.

    ``expect`` = (round, broadcast digest) of the task sent: a reply tagged otherwise (a
    replay of an earlier round, an answer to another broadcast) is refused.
    """
    return decode_reply_symmetric(content, expect)[0]


def decode_reply_symmetric(
    content: RecordDict, expect: tuple[int, str] | None = None
) -> tuple[Message, frozenset[str]]:
    """:func:`decode_reply`, and the names of the statistics rebuilt from their sent upper
    triangle: each entry and its mirror are one sent number, so they are exactly symmetric."""
    try:
        tag = content.config_records[TAG]
        tagged = (tag[ROUND], tag[DIGEST_OF_BROADCAST])
        count = tag[UNITS]
    except (KeyError, TypeError) as e:
        raise MalformedReply(f"reply lacks {e}") from None
    if expect is not None and tagged != (int(expect[0]), str(expect[1])):
        raise MalformedReply(
            f"reply answers round {tagged[0]!s} with broadcast {str(tagged[1])[:12]}…, not this round's task: replayed or stale"
        )
    zeroed = tag.get(ZEROED, 0)
    if not _is_int(count):
        raise MalformedReply(f"{UNITS} must be an integer; got {count!r}")
    if not _is_int(zeroed):
        raise MalformedReply(f"{ZEROED} must be an integer; got {zeroed!r}")
    packed = str(tag.get(PACKED, "") or "")
    packed_names = set(packed.split(",")) if packed else set()
    stats = unpack(tag, content, "reply")
    rebuilt = frozenset(packed_names & set(stats))
    for name in rebuilt:
        stats[name] = _untriu(stats[name], name)
    return Message(stats, count, zeroed), rebuilt


def encode_node(partition_id: int, num_partitions: int) -> RecordDict:
    return RecordDict({NODE: MetricRecord({PARTITION_ID: int(partition_id), NUM_PARTITIONS: int(num_partitions)})})


def decode_node(content: RecordDict) -> tuple[int, int]:
    """(partition-id, num-partitions) from a discovery reply."""
    try:
        rec = content.metric_records[NODE]
        pid, num = rec[PARTITION_ID], rec[NUM_PARTITIONS]
    except (KeyError, TypeError) as e:
        raise MalformedReply(f"discovery reply lacks {e}") from None
    if not (_is_int(pid) and _is_int(num)) or not 0 <= pid < num:
        raise MalformedReply(f"node config needs 0 <= {PARTITION_ID} < {NUM_PARTITIONS}; got {pid!r}, {num!r}")
    return pid, num
