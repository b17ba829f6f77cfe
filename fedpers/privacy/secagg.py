"""SecAgg+ (Bell et al. 2020; Bonawitz et al. 2017): the server learns Σ x_i mod 2^b of the nodes that
survived, and nothing else about any x_i, as long as fewer than ``threshold`` neighbours of a node collude
with it.

Every primitive is a library's: X25519 key agreement, HKDF-SHA256 and AES-GCM from ``cryptography``;
the mask stream is AES-256-CTR (``cryptography``) keyed by an HKDF-derived seed; Shamir secret sharing is
Flower's (``flwr.common.secure_aggregation.crypto.shamir``, on PyCryptodome). Flower's own
``pseudo_rand_gen`` is not used: it folds the seed to 32 bits and draws from ``[0, range − 1)``, so its
masks are neither secret enough nor uniform.

The protocol, one instance per round (public: the node ids, the neighbour graph, the threshold):

1. **advertise keys** — node i publishes two X25519 public keys, c_i (to encrypt) and s_i (to mask);
2. **share keys** — node i draws a self-mask seed b_i and Shamir-shares b_i and its mask secret key
   s_i^sk among its neighbours and itself (degree + 1 shares, threshold t), each neighbour's share encrypted for its recipient with AES-GCM under
   HKDF(X25519(c_i^sk, c_j)), the pair (i, j) bound as associated data; the server relays ciphertexts;
3. **masked input** — node i sends y_i = x_i + PRG(b_i) + Σ_{j ∈ N(i)} ±PRG(s_ij) mod 2^b, with
   s_ij = HKDF(X25519(s_i^sk, s_j)) and + for j > i, − for j < i (the pairwise masks cancel in the sum);
4. **unmask** — the server names the survivors (nodes whose y arrived). Each surviving node reveals, for
   each neighbour, the share of b (if that neighbour survived) or of s^sk (if it dropped) — never both
   for one node — and its own share of its own b. With fewer than ``threshold`` survivors the round ends with nothing released; otherwise
   the server rebuilds every survivor's b and every dropped neighbour's s^sk, and removes their masks.

Nodes and the server are objects that exchange only bytes and integer vectors (what a message carries);
:func:`secure_sum` runs one round in process, with a declared set of nodes that drop after any stage.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares

STAGES = ("advertise", "share", "masked", "unmask")


class AggregationAborted(RuntimeError):
    """Too few nodes survived to unmask the sum: nothing is released."""


def _raw_public(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _raw_private(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def _kdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def agree(private: X25519PrivateKey, public: bytes, info: bytes) -> bytes:
    """A 32-byte key both ends derive: HKDF-SHA256 of the X25519 shared secret, bound to ``info``."""
    return _kdf(private.exchange(X25519PublicKey.from_public_bytes(public)), info)


def mask(seed: bytes, length: int, bits: int) -> np.ndarray:
    """``length`` values uniform in [0, 2^bits) from AES-256-CTR keyed by ``seed`` (bits ≤ 32: 2^bits
    divides 2^32, so reducing a uniform 32-bit word is exactly uniform)."""
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be in [1, 32]; got {bits}")
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    stream = encryptor.update(bytes(4 * length)) + encryptor.finalize()
    words = np.frombuffer(stream, dtype="<u4").astype(np.int64)
    return words & ((1 << bits) - 1)


def neighbour_graph(nodes: Sequence[int], degree: int, seed: int) -> dict[int, list[int]]:
    """A public graph of SecAgg+: the nodes in a seeded random order on a ring, each joined to the
    ``degree`` // 2 next on either side (all others when ``degree`` ≥ n − 1: plain SecAgg)."""
    order = list(nodes)
    random.Random(seed).shuffle(order)
    n = len(order)
    if degree >= n - 1:
        return {i: [j for j in order if j != i] for i in order}
    half = max(1, degree // 2)
    out: dict[int, set[int]] = {i: set() for i in order}
    for pos, i in enumerate(order):
        for step in range(1, half + 1):
            j = order[(pos + step) % n]
            out[i].add(j)
            out[j].add(i)
    return {i: sorted(v) for i, v in out.items()}


@dataclass
class SecAggNode:
    """One node's side of a round. Its secrets (x, the secret keys, b) never leave it except as Shamir
    shares encrypted for a neighbour and as the masked vector."""

    node: int
    neighbours: list[int]
    threshold: int
    bits: int
    round_tag: bytes
    _c_key: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)
    _s_key: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)
    _b: bytes = field(default_factory=lambda: os.urandom(32), repr=False)
    _keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict, repr=False)
    _held: dict[int, tuple[bytes, bytes]] = field(default_factory=dict, repr=False)

    def advertise(self) -> tuple[bytes, bytes]:
        """Stage 1: (encryption public key, mask public key)."""
        return _raw_public(self._c_key.public_key()), _raw_public(self._s_key.public_key())

    def _channel(self, other: int) -> AESGCM:
        lo, hi = sorted((self.node, other))
        info = b"fedpers-secagg-channel" + self.round_tag + lo.to_bytes(8, "little") + hi.to_bytes(8, "little")
        return AESGCM(agree(self._c_key, self._keys[other][0], info))

    def share(self, keys: Mapping[int, tuple[bytes, bytes]]) -> dict[int, bytes]:
        """Stage 2: given the neighbours' public keys, the encrypted shares of (s^sk, b) for each."""
        self._keys = {j: keys[j] for j in self.neighbours if j in keys}
        if len(self._keys) + 1 < self.threshold:
            raise AggregationAborted(f"node {self.node}: {len(self._keys)} neighbours advertised keys, below threshold")
        holders = sorted(self._keys)
        # degree + 1 shares: one per neighbour and one the node keeps (as Flower's secaggplus_mod does), so a
        # survivor's own share counts towards rebuilding its self mask
        s_shares = create_shares(_raw_private(self._s_key), self.threshold, len(holders) + 1)
        b_shares = create_shares(self._b, self.threshold, len(holders) + 1)
        self._held[self.node] = (s_shares[-1], b_shares[-1])
        out = {}
        for j, s_share, b_share in zip(holders, s_shares[:-1], b_shares[:-1], strict=True):
            nonce = os.urandom(12)
            plain = len(s_share).to_bytes(4, "little") + s_share + b_share
            aad = self.node.to_bytes(8, "little") + j.to_bytes(8, "little") + self.round_tag
            out[j] = nonce + self._channel(j).encrypt(nonce, plain, aad)
        return out

    def receive(self, ciphertexts: Mapping[int, bytes]) -> None:
        """Stage 2, receiving end: decrypt and keep each neighbour's shares (a forged one fails AES-GCM)."""
        for i, blob in ciphertexts.items():
            if i not in self._keys:
                continue
            aad = i.to_bytes(8, "little") + self.node.to_bytes(8, "little") + self.round_tag
            plain = self._channel(i).decrypt(blob[:12], blob[12:], aad)
            n = int.from_bytes(plain[:4], "little")
            self._held[i] = (plain[4 : 4 + n], plain[4 + n :])

    def _pair_seed(self, other: int) -> bytes:
        lo, hi = sorted((self.node, other))
        info = b"fedpers-secagg-mask" + self.round_tag + lo.to_bytes(8, "little") + hi.to_bytes(8, "little")
        return agree(self._s_key, self._keys[other][1], info)

    def masked(self, x: np.ndarray) -> np.ndarray:
        """Stage 3: y = x + PRG(b) + Σ ±PRG(s_ij) mod 2^b over the neighbours whose shares it holds
        (those the server can rebuild a mask key for, should they drop)."""
        m = 1 << self.bits
        y = np.remainder(np.asarray(x, dtype=np.int64), m)
        y = y + _self_mask(self._b, self.round_tag, y.size, self.bits)
        for j in sorted(j for j in self._held if j != self.node):
            pair = mask(self._pair_seed(j), y.size, self.bits)
            y = y + pair if j > self.node else y - pair
        return np.remainder(y, m)

    def unmask(self, survivors: Sequence[int]) -> dict[int, tuple[str, bytes]]:
        """Stage 4: for each neighbour whose shares it holds, the share of b (survived) or of s^sk
        (dropped); refuses a survivor list that would reveal both for one node."""
        alive = set(survivors)
        if self.node not in alive:
            raise AggregationAborted(f"node {self.node}: not among the survivors it was told")
        return {i: ("b", b) if i in alive else ("s", s) for i, (s, b) in self._held.items()}

    def export(self) -> dict[str, int | bytes | list[int] | list[bytes]]:
        """The node's whole state as flat values a message or node store can hold (ints, bytes and lists
        of them; the secrets included: it stays on the node, in its own state, between stages)."""
        keys, held = sorted(self._keys), sorted(self._held)
        return {
            "node": self.node,
            "neighbours": list(self.neighbours),
            "threshold": self.threshold,
            "bits": self.bits,
            "round-tag": self.round_tag,
            "c-sk": _raw_private(self._c_key),
            "s-sk": _raw_private(self._s_key),
            "b": self._b,
            "key-ids": keys,
            "c-pk": [self._keys[j][0] for j in keys],
            "s-pk": [self._keys[j][1] for j in keys],
            "held-ids": held,
            "held-s": [self._held[j][0] for j in held],
            "held-b": [self._held[j][1] for j in held],
        }

    @classmethod
    def restore(cls, state: Mapping[str, Any]) -> SecAggNode:
        """:meth:`export`'s inverse (a KeyError or TypeError for a state that is not one)."""

        def ints(key: str) -> list[int]:
            return [int(v) for v in state[key]]

        def blobs(key: str) -> list[bytes]:
            return [bytes(v) for v in state[key]]

        node = cls(
            int(state["node"]),
            ints("neighbours"),
            int(state["threshold"]),
            int(state["bits"]),
            bytes(state["round-tag"]),
            X25519PrivateKey.from_private_bytes(bytes(state["c-sk"])),
            X25519PrivateKey.from_private_bytes(bytes(state["s-sk"])),
            bytes(state["b"]),
        )
        node._keys = dict(zip(ints("key-ids"), zip(blobs("c-pk"), blobs("s-pk"), strict=True), strict=True))
        node._held = dict(zip(ints("held-ids"), zip(blobs("held-s"), blobs("held-b"), strict=True), strict=True))
        return node


def plus_degree(nodes: int) -> int:
    """Neighbours per node of SecAgg+ among ``nodes``: 2⌈log₂ n⌉ (Bell et al. 2020's logarithmic
    degree), all others when that is as many (plain SecAgg)."""
    return max(0, min(nodes - 1, 2 * math.ceil(math.log2(max(nodes, 2)))))


def _self_mask(b: bytes, round_tag: bytes, length: int, bits: int) -> np.ndarray:
    return mask(_kdf(b, b"fedpers-secagg-self" + round_tag), length, bits)


@dataclass
class SecAggServer:
    """The server's side: relays keys and ciphertexts, sums masked vectors, rebuilds the masks it may."""

    nodes: list[int]
    graph: dict[int, list[int]]
    threshold: int
    bits: int
    round_tag: bytes
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    sharers: set[int] = field(default_factory=set)

    def unmasked_sum(
        self, masked: Mapping[int, np.ndarray], revealed: Mapping[int, Mapping[int, tuple[str, bytes]]], length: int
    ) -> np.ndarray:
        """Σ of the survivors' inputs mod 2^b from their masked vectors and the revealed shares."""
        m = 1 << self.bits
        survivors = sorted(masked)
        if len(survivors) < self.threshold or len(revealed) < self.threshold:
            raise AggregationAborted(
                f"{len(survivors)} masked inputs and {len(revealed)} unmasking answers, below threshold {self.threshold}"
            )
        total = np.zeros(length, dtype=np.int64)
        for y in masked.values():
            total = np.remainder(total + y, m)
        for i in survivors:
            shares = [rev[i][1] for rev in revealed.values() if i in rev and rev[i][0] == "b"]
            if len(shares) < self.threshold:
                raise AggregationAborted(f"node {i}: {len(shares)} shares of its self mask, below threshold")
            total = np.remainder(
                total - _self_mask(combine_shares(shares[: self.threshold]), self.round_tag, length, self.bits), m
            )
        dropped = sorted(self.sharers - set(survivors))
        for i in dropped:
            shares = [rev[i][1] for rev in revealed.values() if i in rev and rev[i][0] == "s"]
            if len(shares) < self.threshold:
                raise AggregationAborted(f"dropped node {i}: {len(shares)} shares of its mask key, below threshold")
            key = X25519PrivateKey.from_private_bytes(combine_shares(shares[: self.threshold]))
            for j in self.graph[i]:
                if j not in masked or j not in self.keys:
                    continue
                lo, hi = sorted((i, j))
                info = b"fedpers-secagg-mask" + self.round_tag + lo.to_bytes(8, "little") + hi.to_bytes(8, "little")
                pair = mask(agree(key, self.keys[j][1], info), length, self.bits)
                # survivor j added +pair if i > j, −pair if i < j: remove exactly that
                total = np.remainder(total - pair if i > j else total + pair, m)
        return total


def default_threshold(degree: int) -> int:
    """t = ⌊degree/2⌋ + 1 of a node's degree + 1 holders: a majority of each neighbourhood."""
    return degree // 2 + 1


def secure_sum(
    inputs: Mapping[int, np.ndarray],
    bits: int,
    *,
    degree: int | None = None,
    threshold: int | None = None,
    seed: int = 0,
    round_tag: bytes = b"",
    drop_after: Mapping[int, str] | None = None,
    keep: dict[str, object] | None = None,
) -> np.ndarray:
    """One SecAgg+ round in process over ``inputs`` (node id → int64 vector, all one length).

    ``drop_after``: node → the stage after which it stops answering ("advertise", "share",
    "masked"). ``degree``: neighbours per node (default: all, plain SecAgg); ``threshold``: shares
    needed (default :func:`default_threshold`). Raises :class:`AggregationAborted` when too few
    survive; ``keep`` (a dict) receives the server's view (the masked vectors) for tests."""
    ids = sorted(inputs)
    lengths = {int(np.asarray(v).size) for v in inputs.values()}
    if len(lengths) != 1:
        raise ValueError(f"secure_sum: every input must have one length; got {sorted(lengths)}")
    length = lengths.pop()
    degree = len(ids) - 1 if degree is None else min(degree, len(ids) - 1)
    threshold = default_threshold(degree) if threshold is None else threshold
    if not 1 <= threshold <= degree + 1:
        raise ValueError(f"threshold must be in [1, degree + 1 = {degree + 1}]; got {threshold}")
    drop = dict(drop_after or {})
    tag = hashlib.sha256(round_tag).digest()[:16]
    graph = neighbour_graph(ids, degree, seed)
    nodes = {i: SecAggNode(i, graph[i], threshold, bits, tag) for i in ids}
    server = SecAggServer(ids, graph, threshold, bits, tag)

    def alive(i: int, stage: str) -> bool:
        """Whether node i answers ``stage`` (it drops after the stage it is declared to)."""
        return i not in drop or STAGES.index(stage) <= STAGES.index(drop[i])

    server.keys = {i: nodes[i].advertise() for i in ids if alive(i, "advertise")}
    relayed: dict[int, dict[int, bytes]] = {j: {} for j in ids}
    for i in server.keys:
        if not alive(i, "share"):
            continue
        for j, blob in nodes[i].share(server.keys).items():
            relayed[j][i] = blob
        server.sharers.add(i)
    for j in server.sharers:
        nodes[j].receive({i: b for i, b in relayed[j].items() if i in server.sharers})
    masked = {i: nodes[i].masked(inputs[i]) for i in sorted(server.sharers) if alive(i, "masked")}
    if keep is not None:
        keep["masked"] = masked
    revealed = {j: nodes[j].unmask(sorted(masked)) for j in masked if alive(j, "unmask")}
    return server.unmasked_sum(masked, revealed, length)
