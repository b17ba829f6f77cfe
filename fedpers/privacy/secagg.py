"""SecAgg+ (Bell et al. 2020; Bonawitz et al. 2017) against an active server: the server learns Σ x_i
mod 2^b of one set S of surviving nodes that every one of them signed, and nothing else about any x_i, as
long as fewer than ``threshold`` neighbours of a node collude with it and the server relays public keys
unaltered (it is trusted to deliver keys, not to follow the rest of the protocol).

Every primitive is a library's: X25519 key agreement, Ed25519 signatures, HKDF-SHA256 and AES-GCM from
``cryptography``; the mask stream is AES-256-CTR (``cryptography``) keyed by an HKDF-derived seed; Shamir
secret sharing is PyCryptodome's (``Crypto.Protocol.SecretSharing.Shamir``, over GF(2^128), the scheme
Flower's ``secure_aggregation.crypto.shamir`` wraps), called once per secret: both shared secrets are
16-byte seeds (one field element), the self-mask seed b_i and the seed the mask key s_i^sk is derived
from by HKDF, so a node splits two field elements a round and the server combines one per survivor or
dropped node (Flower's wrapper pads a 32-byte key to three elements and starts a thread pool on every
call). Flower's own ``pseudo_rand_gen`` is not used: it folds the seed to 32 bits and draws from
``[0, range − 1)``, so its masks are neither secret enough nor uniform.

The protocol, one instance per round (public: the node ids, the neighbour graph, the threshold
t = ⌊(d + 1)/2⌋ + 1 of a degree-d neighbourhood, so that 2t > d + 1):

1. **advertise keys** — node i publishes three public keys: X25519 c_i (to encrypt), X25519 s_i (to mask)
   and Ed25519 g_i (to sign);
2. **share keys** — node i draws a self-mask seed b_i and Shamir-shares b_i and the seed of its mask
   secret key s_i^sk among its neighbours and itself (degree + 1 shares, threshold t), each neighbour's share encrypted
   for its recipient with AES-GCM under HKDF(X25519(c_i^sk, c_j)), the pair (i, j) bound as associated
   data; the server relays ciphertexts;
3. **masked input** — node i masks only if it holds the shares of at least t − 1 neighbours (H_i, the
   ones the server relayed): y_i = x_i + PRG(b_i) + Σ_{j ∈ H_i} ±PRG(s_ij) mod 2^b, with
   s_ij = HKDF(X25519(s_i^sk, s_j)) and + for j > i, − for j < i (the pairwise masks cancel in the sum);
4. **consistency** — the server names the survivors S (nodes whose y arrived). Node i signs S with g_i
   only if i ∈ S, |S| ≥ min_nodes, S ∩ N(i) ⊆ H_i (it masked with every neighbour said to survive),
   |S ∩ N[i]| ≥ t, and i's connected component in the public graph restricted to S has at least min_nodes
   nodes (the server can unmask no sum over fewer); it signs one set per round;
5. **unmask** — node i, given S and its neighbours' signatures, reveals only if S is the set it signed and
   every neighbour in S signed S too; then, for each neighbour whose shares it holds, the share of b (that
   neighbour in S) or of s^sk (not in S) — never both for one node, once per round — and its own share of
   b_i. Since 2t > d + 1, no two views of who survived can each reach t holders of one node's shares.

Nodes and the server are objects that exchange only bytes and integer vectors (what a message carries);
:func:`secure_sum` runs one round in process, with a declared set of nodes that drop after any stage.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

STAGES = ("advertise", "share", "masked", "consistency", "unmask")


class AggregationAborted(RuntimeError):
    """The round cannot be unmasked (too few survivors or shares): nothing is released."""


class ProtocolViolation(AggregationAborted):
    """A node refuses a stage because what the server sent breaks a rule that protects its input (too few
    relayed shares, a survivor set it must not sign or reveal on, a missing or forged signature, a stage
    repeated). ``rule`` names the rule; nothing of the node's secrets is revealed."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"secagg rule {rule!r}: {message}")
        self.rule = rule


def _raw_public(key: X25519PublicKey | Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _raw_private(key: X25519PrivateKey | Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def survivors_message(round_tag: bytes, survivors: Sequence[int]) -> bytes:
    """What a node signs in the consistency stage: the round's tag and the sorted survivor set."""
    given = np.asarray(survivors)
    if given.size and given.dtype.kind not in "iu":
        raise ValueError(f"survivor ids are integers; got {given.dtype}")
    ids = np.unique(given.astype(np.int64))  # sorted, each once
    if ids.size and int(ids[0]) < 0:
        raise ValueError(f"survivor ids are non-negative; got {int(ids[0])}")
    return b"fedpers-secagg-survivors" + round_tag + ids.astype("<u8").tobytes()


def component(graph: Mapping[int, Sequence[int]], inside: set[int], start: int, enough: int | None = None) -> set[int]:
    """``start``'s connected component in ``graph`` restricted to the nodes ``inside``; with ``enough``, the
    search stops once it holds that many nodes (what a size check needs: O(enough · degree), not O(n))."""
    seen, todo = {start}, [start]
    while todo:
        for j in graph.get(todo.pop(), ()):
            if j in inside and j not in seen:
                seen.add(j)
                if enough is not None and len(seen) >= enough:
                    return seen
                todo.append(j)
    return seen


def _kdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


SEED_BYTES = 16
"""Length of each Shamir-shared secret (b_i and the seed of s_i^sk): one element of PyCryptodome's GF(2^128)."""
SHARE_BYTES = 4 + SEED_BYTES
"""A share as sent: the holder's 1-based index (4 bytes, little-endian), then its field element."""


def split_secret(secret: bytes, threshold: int, holders: int) -> list[bytes]:
    """``holders`` Shamir shares of a 16-byte ``secret``, any ``threshold`` of which rebuild it (one call to
    PyCryptodome's ``Shamir.split``; share k is for holder k, 1-based)."""
    if len(secret) != SEED_BYTES:
        raise ValueError(f"a shared secret must be {SEED_BYTES} bytes; got {len(secret)}")
    return [
        index.to_bytes(4, "little") + share for index, share in Shamir.split(threshold, holders, secret, ssss=False)
    ]


def combine_secret(shares: Sequence[bytes]) -> bytes:
    """The secret ``threshold`` shares of :func:`split_secret` rebuild (pass exactly that many: PyCryptodome
    interpolates through every share it is given). A share of the wrong length, or two with one index, is
    refused (:class:`AggregationAborted`); a wrong share of the right form rebuilds a wrong secret."""
    points = []
    for share in shares:
        if len(share) != SHARE_BYTES:
            raise AggregationAborted(f"a Shamir share must be {SHARE_BYTES} bytes; got {len(share)}")
        points.append((int.from_bytes(share[:4], "little"), bytes(share[4:])))
    try:
        return bytes(Shamir.combine(points, ssss=False))
    except ValueError as e:  # a repeated index
        raise AggregationAborted(f"Shamir shares do not combine: {e}") from None


def mask_key(seed: bytes, round_tag: bytes) -> X25519PrivateKey:
    """The mask secret key s^sk a node derives from its 16-byte seed (HKDF-SHA256, bound to the round): the
    seed is what it Shamir-shares, so the server rebuilds a dropped node's key from one field element."""
    return X25519PrivateKey.from_private_bytes(_kdf(seed, b"fedpers-secagg-mask-key" + round_tag))


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
    shares encrypted for a neighbour and as the masked vector; every rule that protects them is checked
    here, before anything is revealed (:class:`ProtocolViolation`)."""

    node: int
    neighbours: Sequence[int]
    threshold: int
    bits: int
    round_tag: bytes
    _c_key: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)
    _s_seed: bytes = field(default_factory=lambda: os.urandom(SEED_BYTES), repr=False)
    """The seed of the mask secret key s^sk (:func:`mask_key`): what the node Shamir-shares for it."""
    _b: bytes = field(default_factory=lambda: os.urandom(SEED_BYTES), repr=False)
    _g_key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate, repr=False)
    _keys: dict[int, tuple[bytes, ...]] = field(default_factory=dict, repr=False)
    _held: dict[int, tuple[bytes, bytes]] = field(default_factory=dict, repr=False)
    _masked_with: list[int] | None = field(default=None, repr=False)
    """H_i: the neighbours whose pair masks the masked vector holds (None: not masked yet)."""
    _signed: list[int] | None = field(default=None, repr=False)
    """The survivor set this node signed (None: none yet)."""
    _revealed: bool = field(default=False, repr=False)
    _s_key: X25519PrivateKey = field(init=False, repr=False)
    _channel_keys: dict[int, bytes] = field(default_factory=dict, repr=False)
    """The AES-GCM key of the channel to each neighbour, agreed once a round (sending the shares at *share*
    and receiving the relayed ones at the masked stage use one key; kept in the node's state between them)."""
    _channels: dict[int, AESGCM] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._s_key = mask_key(self._s_seed, self.round_tag)

    def advertise(self) -> tuple[bytes, bytes, bytes]:
        """Stage 1: (encryption public key, mask public key, signing public key)."""
        return (
            _raw_public(self._c_key.public_key()),
            _raw_public(self._s_key.public_key()),
            _raw_public(self._g_key.public_key()),
        )

    def _channel(self, other: int) -> AESGCM:
        channel = self._channels.get(other)
        if channel is None:
            key = self._channel_keys.get(other)
            if key is None:
                lo, hi = sorted((self.node, other))
                info = b"fedpers-secagg-channel" + self.round_tag + lo.to_bytes(8, "little") + hi.to_bytes(8, "little")
                key = self._channel_keys[other] = agree(self._c_key, self._keys[other][0], info)
            channel = self._channels[other] = AESGCM(key)
        return channel

    def share(self, keys: Mapping[int, Sequence[bytes]]) -> dict[int, bytes]:
        """Stage 2: given the neighbours' public keys, the encrypted shares of (s^sk, b) for each."""
        if self._keys or self._held:
            raise ProtocolViolation("secagg-once", f"node {self.node}: keys were already shared this round")
        self._keys = {j: tuple(keys[j]) for j in self.neighbours if j in keys}
        if len(self._keys) + 1 < self.threshold:
            raise AggregationAborted(f"node {self.node}: {len(self._keys)} neighbours advertised keys, below threshold")
        holders = sorted(self._keys)
        # degree + 1 shares: one per neighbour and one the node keeps (as Flower's secaggplus_mod does), so a
        # survivor's own share counts towards rebuilding its self mask
        s_shares = split_secret(self._s_seed, self.threshold, len(holders) + 1)
        b_shares = split_secret(self._b, self.threshold, len(holders) + 1)
        self._held[self.node] = (s_shares[-1], b_shares[-1])
        out = {}
        for j, s_share, b_share in zip(holders, s_shares[:-1], b_shares[:-1], strict=True):
            nonce = os.urandom(12)
            plain = s_share + b_share
            aad = self.node.to_bytes(8, "little") + j.to_bytes(8, "little") + self.round_tag
            out[j] = nonce + self._channel(j).encrypt(nonce, plain, aad)
        return out

    def receive(self, ciphertexts: Mapping[int, bytes]) -> None:
        """Stage 2, receiving end: decrypt and keep each neighbour's shares (a forged one fails AES-GCM)."""
        if self._masked_with is not None:
            raise ProtocolViolation("secagg-once", f"node {self.node}: its input was already masked this round")
        for i, blob in ciphertexts.items():
            if i not in self._keys or i == self.node:
                continue
            aad = i.to_bytes(8, "little") + self.node.to_bytes(8, "little") + self.round_tag
            plain = self._channel(i).decrypt(blob[:12], blob[12:], aad)
            if len(plain) != 2 * SHARE_BYTES:
                raise ValueError(
                    f"node {self.node}: the shares from node {i} are {len(plain)} bytes, not {2 * SHARE_BYTES}"
                )
            self._held[i] = (plain[:SHARE_BYTES], plain[SHARE_BYTES:])

    @property
    def relayed(self) -> list[int]:
        """The neighbours whose shares this node holds."""
        return sorted(j for j in self._held if j != self.node)

    def check_relays(self) -> None:
        """The masking rule: at least threshold − 1 neighbours' shares held, or the node masks nothing (with
        fewer, the survivors' shares of b and the dropped ones' of s^sk could unmask x alone)."""
        if len(self.relayed) + 1 < self.threshold:
            raise ProtocolViolation(
                "secagg-relays",
                f"node {self.node}: the server relayed the shares of {len(self.relayed)} neighbours; masking needs "
                f"threshold - 1 = {self.threshold - 1}",
            )

    def _pair_seed(self, other: int) -> bytes:
        lo, hi = sorted((self.node, other))
        info = b"fedpers-secagg-mask" + self.round_tag + lo.to_bytes(8, "little") + hi.to_bytes(8, "little")
        return agree(self._s_key, self._keys[other][1], info)

    def masked(self, x: np.ndarray) -> np.ndarray:
        """Stage 3: y = x + PRG(b) + Σ ±PRG(s_ij) mod 2^b over the neighbours whose shares it holds (those the
        server can rebuild a mask key for, should they drop); refused below the masking rule, or twice."""
        if self._masked_with is not None:
            raise ProtocolViolation("secagg-once", f"node {self.node}: its input was already masked this round")
        self.check_relays()
        m = 1 << self.bits
        y = np.remainder(np.asarray(x, dtype=np.int64), m)
        y = y + _self_mask(self._b, self.round_tag, y.size, self.bits)
        for j in self.relayed:
            pair = mask(self._pair_seed(j), y.size, self.bits)
            y = y + pair if j > self.node else y - pair
        self._masked_with = self.relayed
        return np.remainder(y, m)

    def check_view(self, survivors: Sequence[int], min_nodes: int, graph: Mapping[int, Sequence[int]]) -> list[int]:
        """The survivor set ``survivors`` as this node may sign or reveal on it (sorted), or a
        :class:`ProtocolViolation`: it must hold this node, have at least ``min_nodes`` nodes, name among
        this node's neighbours only ones it masked with, hold ``threshold`` of its closed neighbourhood, and
        leave its component of the public ``graph`` at least ``min_nodes`` nodes."""
        alive = set(map(int, survivors))
        if self._masked_with is None:
            raise ProtocolViolation("secagg-order", f"node {self.node}: no masked input this round")
        if self.node not in alive:
            raise ProtocolViolation("secagg-survivors", f"node {self.node}: not among the survivors it was told")
        if len(alive) < min_nodes:
            raise ProtocolViolation(
                "secagg-survivors", f"{len(alive)} survivors, below min_nodes={min_nodes}; nothing is revealed"
            )
        unmasked = sorted(alive.intersection(self.neighbours) - set(self._masked_with))
        if unmasked:
            raise ProtocolViolation(
                "secagg-survivors",
                f"node {self.node}: survivors {unmasked} are neighbours it did not mask with (their shares were not "
                "relayed to it); revealing would unmask its input alone",
            )
        closed = len(alive.intersection([*self.neighbours, self.node]))
        if closed < self.threshold:
            raise ProtocolViolation(
                "secagg-survivors",
                f"node {self.node}: {closed} survivors in its neighbourhood, below threshold {self.threshold}",
            )
        reach = component(graph, alive, self.node, enough=min_nodes)
        if len(reach) < min_nodes:
            raise ProtocolViolation(
                "secagg-survivors",
                f"node {self.node}: the survivors connected to it are {len(reach)}, below min_nodes={min_nodes} (a "
                "separate sum over them could be unmasked)",
            )
        return sorted(alive)

    def sign(self, survivors: Sequence[int], min_nodes: int, graph: Mapping[int, Sequence[int]]) -> bytes:
        """Stage 4: this node's Ed25519 signature on the survivor set it was told, after :meth:`check_view`;
        one set per round (asked again for the same set it signs it again, for another it refuses)."""
        view = self.check_view(survivors, min_nodes, graph)
        if self._signed is not None and self._signed != view:
            raise ProtocolViolation(
                "secagg-consistency",
                f"node {self.node}: it signed the survivor set {self._signed} this round; it signs no other ({view})",
            )
        self._signed = view
        return self._g_key.sign(survivors_message(self.round_tag, view))

    def unmask(
        self,
        survivors: Sequence[int],
        signatures: Mapping[int, bytes],
        min_nodes: int,
        graph: Mapping[int, Sequence[int]],
    ) -> dict[int, tuple[str, bytes]]:
        """Stage 5: for each neighbour whose shares it holds, the share of b (survived) or of s^sk (dropped),
        once per round, and only on the set it signed with every surviving neighbour's valid signature on it
        (the consistency check: a server that told nodes different survivor sets gets nothing)."""
        if self._revealed:
            raise ProtocolViolation("secagg-once", f"node {self.node}: it already revealed its shares this round")
        view = self.check_view(survivors, min_nodes, graph)
        if self._signed != view:
            raise ProtocolViolation(
                "secagg-consistency",
                f"node {self.node}: asked to reveal on survivors {view}, it signed {self._signed}",
            )
        message = survivors_message(self.round_tag, view)
        for j in sorted(set(view).intersection(self.neighbours)):
            try:
                Ed25519PublicKey.from_public_bytes(self._keys[j][2]).verify(bytes(signatures[j]), message)
            except (KeyError, IndexError, TypeError, ValueError, InvalidSignature):
                raise ProtocolViolation(
                    "secagg-consistency",
                    f"node {self.node}: no valid signature of neighbour {j} on the survivor set {view}",
                ) from None
        self._revealed = True
        alive = set(view)
        return {i: ("b", b) if i in alive else ("s", s) for i, (s, b) in self._held.items()}

    def export(self) -> dict[str, int | bytes]:
        """The node's whole state as flat values a message or node store can hold (ints and bytes: id lists
        packed as little-endian int64, keys and shares as their fixed-size concatenation, so a store checks a
        few values a stage, not one per neighbour or survivor; the secrets included: it stays on the node, in
        its own state, between stages)."""
        keys, held, channels = sorted(self._keys), sorted(self._held), sorted(self._channel_keys)
        return {
            "node": self.node,
            "neighbours": _pack_ids(self.neighbours),
            "threshold": self.threshold,
            "bits": self.bits,
            "round-tag": self.round_tag,
            "c-sk": _raw_private(self._c_key),
            "s-seed": self._s_seed,
            "g-sk": _raw_private(self._g_key),
            "b": self._b,
            "key-ids": _pack_ids(keys),
            "c-pk": b"".join(self._keys[j][0] for j in keys),
            "s-pk": b"".join(self._keys[j][1] for j in keys),
            "g-pk": b"".join(self._keys[j][2] for j in keys),
            "held-ids": _pack_ids(held),
            "held-s": b"".join(self._held[j][0] for j in held),
            "held-b": b"".join(self._held[j][1] for j in held),
            "channel-ids": _pack_ids(channels),
            "channel-keys": b"".join(self._channel_keys[j] for j in channels),
            "masked-with": _pack_ids([] if self._masked_with is None else self._masked_with),
            "masked": int(self._masked_with is not None),
            "signed": _pack_ids([] if self._signed is None else self._signed),
            "has-signed": int(self._signed is not None),
            "revealed": int(self._revealed),
        }

    @classmethod
    def restore(cls, state: Mapping[str, Any]) -> SecAggNode:
        """:meth:`export`'s inverse (a KeyError, TypeError or ValueError for a state that is not one)."""

        def ints(key: str) -> list[int]:
            return _unpack_ids(bytes(state[key]))

        def blobs(key: str, size: int) -> list[bytes]:
            return _chunks(bytes(state[key]), size)

        node = cls(
            int(state["node"]),
            ints("neighbours"),
            int(state["threshold"]),
            int(state["bits"]),
            bytes(state["round-tag"]),
            X25519PrivateKey.from_private_bytes(bytes(state["c-sk"])),
            bytes(state["s-seed"]),
            bytes(state["b"]),
            Ed25519PrivateKey.from_private_bytes(bytes(state["g-sk"])),
        )
        keys = zip(blobs("c-pk", KEY_BYTES), blobs("s-pk", KEY_BYTES), blobs("g-pk", KEY_BYTES), strict=True)
        node._keys = dict(zip(ints("key-ids"), keys, strict=True))
        shares = zip(blobs("held-s", SHARE_BYTES), blobs("held-b", SHARE_BYTES), strict=True)
        node._held = dict(zip(ints("held-ids"), shares, strict=True))
        channels = dict(zip(ints("channel-ids"), blobs("channel-keys", KEY_BYTES), strict=True))
        if set(channels) - set(node._keys):
            raise ValueError("a channel key for a node whose public keys this node does not hold")
        node._channel_keys = channels
        node._masked_with = ints("masked-with") if int(state["masked"]) else None
        node._signed = ints("signed") if int(state["has-signed"]) else None
        node._revealed = bool(int(state["revealed"]))
        return node


KEY_BYTES = 32
"""Raw length of an X25519 or Ed25519 public key."""


def _pack_ids(ids: Sequence[int]) -> bytes:
    return np.asarray(list(ids), dtype="<i8").tobytes()


def _unpack_ids(blob: bytes) -> list[int]:
    if len(blob) % 8:
        raise ValueError(f"a packed id list is a multiple of 8 bytes; got {len(blob)}")
    return [int(v) for v in np.frombuffer(blob, dtype="<i8")]


def _chunks(blob: bytes, size: int) -> list[bytes]:
    if len(blob) % size:
        raise ValueError(f"packed values of {size} bytes each; got {len(blob)} bytes")
    return [blob[k : k + size] for k in range(0, len(blob), size)]


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
    graph: Mapping[int, Sequence[int]]
    threshold: int
    bits: int
    round_tag: bytes
    keys: dict[int, tuple[bytes, ...]] = field(default_factory=dict)
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
        # each node's revealed shares by kind, in the holders' answering order: one pass, not one per node
        by_kind: dict[tuple[str, int], list[bytes]] = {}
        for rev in revealed.values():
            for i, (kind, share) in rev.items():
                by_kind.setdefault((kind, i), []).append(share)
        for i in survivors:
            shares = by_kind.get(("b", i), [])
            if len(shares) < self.threshold:
                raise AggregationAborted(f"node {i}: {len(shares)} shares of its self mask, below threshold")
            total = np.remainder(
                total - _self_mask(combine_secret(shares[: self.threshold]), self.round_tag, length, self.bits), m
            )
        dropped = sorted(self.sharers - set(survivors))
        for i in dropped:
            shares = by_kind.get(("s", i), [])
            if len(shares) < self.threshold:
                raise AggregationAborted(f"dropped node {i}: {len(shares)} shares of its mask key, below threshold")
            key = mask_key(combine_secret(shares[: self.threshold]), self.round_tag)
            for j in self.graph[i]:
                if j not in masked or j not in self.keys:
                    continue
                lo, hi = sorted((i, j))
                info = b"fedpers-secagg-mask" + self.round_tag + lo.to_bytes(8, "little") + hi.to_bytes(8, "little")
                pair = mask(agree(key, self.keys[j][1], info), length, self.bits)
                # survivor j added +pair if i > j, −pair if i < j: remove exactly that
                total = np.remainder(total - pair if i > j else total + pair, m)
        return total


def plus_graph(nodes: int, round: int) -> Mapping[int, Sequence[int]]:
    """The public SecAgg+ neighbour graph of a round over nodes 0..nodes−1 (every party derives it). Read
    only, and built once per (nodes, round) in a process: every stage of every node of a simulation asks."""
    return _plus_graph(int(nodes), int(round))


@functools.lru_cache(maxsize=4)
def _plus_graph(nodes: int, round: int) -> Mapping[int, Sequence[int]]:
    graph = neighbour_graph(list(range(nodes)), plus_degree(nodes), seed=round)
    return MappingProxyType({i: tuple(v) for i, v in graph.items()})


def plus_threshold(nodes: int) -> int:
    """The SecAgg+ threshold among ``nodes``: :func:`default_threshold` of :func:`plus_degree`."""
    return default_threshold(plus_degree(nodes))


def unmaskable(
    survivors: Sequence[int], graph: Mapping[int, Sequence[int]], threshold: int, min_nodes: int
) -> str | None:
    """Why honest nodes would refuse to unmask a sum over ``survivors`` (None: they would not), by the
    survivor-set rules of :meth:`SecAggNode.check_view` every survivor applies: at least ``min_nodes`` of
    them, ``threshold`` in each survivor's closed neighbourhood, each survivor's component of the graph
    restricted to them at least ``min_nodes``. What the local runtime simulates of SecAgg+'s dropouts."""
    alive = set(survivors)
    if len(alive) < min_nodes:
        return f"{len(alive)} survivors, below min_nodes={min_nodes}"
    for i in sorted(alive):
        closed = len(alive.intersection([*graph[i], i]))
        if closed < threshold:
            return f"node {i} has {closed} survivors in its neighbourhood, below the SecAgg+ threshold {threshold}"
        if len(component(graph, alive, i, enough=min_nodes)) < min_nodes:
            return f"node {i}'s survivors connected to it are fewer than min_nodes={min_nodes}"
    return None


def default_threshold(degree: int) -> int:
    """t = ⌊(degree + 1)/2⌋ + 1 of a node's degree + 1 share holders: more than half of them, so two disjoint
    groups of holders (one told the node survived, one told it dropped) cannot both reach t."""
    return (degree + 1) // 2 + 1 if degree > 0 else 1


def safe_threshold(degree: int, threshold: int) -> bool:
    """Whether ``threshold`` of ``degree`` + 1 holders makes revealing both shares of one node impossible:
    2t > degree + 1 (each holder reveals one kind of share per node and round), and t ≤ degree + 1."""
    return degree + 1 < 2 * threshold <= 2 * (degree + 1)


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
    min_nodes: int = 1,
) -> np.ndarray:
    """One SecAgg+ round in process over ``inputs`` (node id → int64 vector, all one length).

    ``drop_after``: node → the stage after which it stops answering (one of :data:`STAGES` but the last).
    ``degree``: neighbours per node (default: all, plain SecAgg); ``threshold``: shares needed (default
    :func:`default_threshold`; refused unless :func:`safe_threshold`). Raises :class:`AggregationAborted` when
    too few survive, or when a node whose input arrived did not sign the survivor set (every survivor signs
    it before any share is revealed); ``keep`` (a dict) receives the server's view (the masked vectors)."""
    ids = sorted(inputs)
    lengths = {int(np.asarray(v).size) for v in inputs.values()}
    if len(lengths) != 1:
        raise ValueError(f"secure_sum: every input must have one length; got {sorted(lengths)}")
    length = lengths.pop()
    degree = len(ids) - 1 if degree is None else min(degree, len(ids) - 1)
    threshold = default_threshold(degree) if threshold is None else threshold
    if not safe_threshold(degree, threshold):
        raise ValueError(
            f"threshold must be in ((degree + 1)/2, degree + 1] = ({(degree + 1) / 2:g}, {degree + 1}] so that no "
            f"two views of who survived both reach it; got {threshold}"
        )
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
    survivors = sorted(masked)
    signatures = {i: nodes[i].sign(survivors, min_nodes, graph) for i in survivors if alive(i, "consistency")}
    if set(signatures) != set(survivors):
        raise AggregationAborted(
            f"nodes {sorted(set(survivors) - set(signatures))} sent masked inputs but did not sign the survivor set"
        )
    revealed = {j: nodes[j].unmask(survivors, signatures, min_nodes, graph) for j in masked if alive(j, "unmask")}
    return server.unmasked_sum(masked, revealed, length)
