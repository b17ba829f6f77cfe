"""SecAgg+ (fedpers.privacy.secagg): masks cancel, dropouts are recovered from Shamir shares, too few
survivors release nothing, a masked vector is uniform, and a whole distributed-DP run summed by real
SecAgg+ equals the local runtime's simulated modular sum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cryptography.exceptions import InvalidTag
from scipy import stats

from fedpers.privacy import secagg
from fedpers.privacy.secagg import AggregationAborted, secure_sum


def inputs(n: int, length: int, bits: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i: rng.integers(0, 2**bits, length) for i in range(n)}


def plain(x: dict[int, np.ndarray], bits: int, without: tuple[int, ...] = ()) -> np.ndarray:
    return np.remainder(sum(v for i, v in x.items() if i not in without), 2**bits)


def test_masks_cancel_exactly_secagg_and_secagg_plus():
    x = inputs(7, 300, 20)
    assert np.array_equal(secure_sum(x, 20), plain(x, 20))
    assert np.array_equal(secure_sum(x, 20, degree=4, threshold=3), plain(x, 20))


def test_a_node_dropping_after_masking_is_unmasked_from_its_shares():
    x = inputs(6, 200, 16)
    # its masked input arrived and it signed the survivor set, then it went silent: its self mask is
    # rebuilt from its neighbours' shares
    assert np.array_equal(secure_sum(x, 16, drop_after={3: "consistency"}), plain(x, 16))
    # silent between its masked input and the consistency stage: no survivor may reveal on a set one of its
    # members did not sign, so the round ends with nothing released
    with pytest.raises(AggregationAborted, match="did not sign"):
        secure_sum(x, 16, drop_after={3: "masked"})


def test_a_node_dropping_before_masking_has_its_pair_masks_removed():
    x = inputs(6, 200, 16)
    out = secure_sum(x, 16, degree=4, threshold=3, drop_after={2: "share", 5: "advertise"})
    assert np.array_equal(out, plain(x, 16, without=(2, 5)))
    with pytest.raises(ValueError, match="threshold must be in"):  # 2 of 5 holders: two views could reach it
        secure_sum(x, 16, degree=4, threshold=2)


def test_fewer_survivors_than_the_threshold_release_nothing():
    x = inputs(6, 50, 16)
    with pytest.raises(AggregationAborted):
        secure_sum(x, 16, threshold=4, drop_after={0: "share", 1: "share", 2: "share"})
    with pytest.raises(AggregationAborted):  # inputs arrived, but too few stay to unmask them
        secure_sum(x, 16, threshold=4, drop_after={0: "masked", 1: "masked", 2: "masked"})


def test_one_masked_vector_is_uniform_chi_square():
    bits, length = 12, 40000
    x = {i: np.zeros(length, dtype=np.int64) for i in range(4)}  # all-zero inputs: only the masks are seen
    x[0][:] = 7
    keep: dict[str, object] = {}
    secure_sum(x, bits, keep=keep, round_tag=b"chi")
    masked = keep["masked"]
    assert isinstance(masked, dict)
    y = masked[0]
    counts = np.bincount(y >> (bits - 6), minlength=64)  # 64 equal bins of [0, 2^12)
    # OS entropy: no seed makes this repeatable, so the test fails falsely with probability 1e-7 (p is
    # uniform under uniform masks); unmasked inputs all land in bin 0 (p ≈ 0)
    assert stats.chisquare(counts).pvalue > 1e-7
    assert not np.array_equal(masked[0], masked[1])


def test_mask_stream_is_uniform_over_the_whole_range():
    m = secagg.mask(bytes(32), 2**16, 3)
    assert set(np.unique(m).tolist()) == set(range(8))  # 2^b − 1 included (Flower's own PRG excludes it)


def test_a_forged_share_fails_authentication():
    node = secagg.SecAggNode(0, [1], 1, 16, b"t")
    other = secagg.SecAggNode(1, [0], 1, 16, b"t")
    keys = {0: node.advertise(), 1: other.advertise()}
    blob = bytearray(node.share(keys)[1])
    other.share(keys)
    blob[-1] ^= 1
    with pytest.raises(InvalidTag):
        other.receive({0: bytes(blob)})


def test_distributed_run_with_real_secagg_equals_the_simulated_modular_sum():
    from fedpers import config
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.experiments.altmin import AltMinConfig, AltMinExperiment
    from fedpers.runner import resolve
    from fedpers.runtime.distributed import run_local_nodes, secagg_aggregate

    cfg = config.build(AltMinConfig, dict(n_users=60, dim=4, rank=2, samples_per_user=8, rounds=1, epsilon=2.0))
    opts = config.build(RuntimeOptions, {"nodes": 4, "dp_model": "distributed", "bits": 16})
    states = []
    for aggregate in (None, secagg_aggregate(degree=2, threshold=2)):
        p = resolve(AltMinExperiment(), cfg, opts)
        state, _ = run_local_nodes(
            p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, progress=False, aggregate=aggregate
        )
        states.append(state["U"])
    assert torch.equal(states[0], states[1])


def test_any_threshold_shares_rebuild_a_seed_and_fewer_or_malformed_ones_do_not():
    """The shared secrets are 16-byte seeds split by PyCryptodome's Shamir once each: every t-subset of the
    d + 1 shares rebuilds the seed, t − 1 shares give another value, a short or repeated share is refused."""
    import itertools
    import os

    seed = os.urandom(secagg.SEED_BYTES)
    t, holders = 3, 5
    shares = secagg.split_secret(seed, t, holders)
    assert len(shares) == holders and all(len(s) == secagg.SHARE_BYTES for s in shares)
    for subset in itertools.combinations(shares, t):
        assert secagg.combine_secret(list(subset)) == seed
    assert all(secagg.combine_secret(list(s)) != seed for s in itertools.combinations(shares, t - 1))
    with pytest.raises(AggregationAborted, match="20 bytes"):
        secagg.combine_secret([shares[0][:-1], shares[1], shares[2]])
    with pytest.raises(AggregationAborted, match="do not combine"):
        secagg.combine_secret([shares[0], shares[0], shares[1]])
    with pytest.raises(ValueError, match="16 bytes"):
        secagg.split_secret(seed + b"x", t, holders)
    # the mask key a dropped node's seed rebuilds is the one it masked with
    tag = b"round-tag-0123456"
    assert secagg.mask_key(seed, tag).private_bytes_raw() == secagg.mask_key(seed, tag).private_bytes_raw()
    assert secagg.mask_key(seed, tag).private_bytes_raw() != secagg.mask_key(seed, tag + b"!").private_bytes_raw()


def test_a_node_agrees_each_channel_once_a_round_across_its_stored_state(monkeypatch):
    """The channel keys a node agreed at *share* travel in its own state to the masked stage: restored from
    that state it decrypts its neighbours' relayed shares with no second X25519 agreement, and a forged
    ciphertext still fails AES-GCM (the same key, the same check)."""
    tag = b"round-tag-channel"
    graph = secagg.plus_graph(6, 0)
    t = secagg.plus_threshold(6)
    nodes = {i: secagg.SecAggNode(i, graph[i], t, 16, tag) for i in range(6)}
    keys = {i: node.advertise() for i, node in nodes.items()}
    relayed: dict[int, dict[int, bytes]] = {i: {} for i in nodes}
    for i, node in nodes.items():
        for j, blob in node.share(keys).items():
            relayed[j][i] = blob
    stored = {i: node.export() for i, node in nodes.items()}
    assert all(len(stored[i]["channel-keys"]) == secagg.KEY_BYTES * len(graph[i]) for i in nodes)
    agreed_again = {}
    for j in nodes:  # what each node decrypts when it agrees its channels anew
        fresh = secagg.SecAggNode.restore(stored[j])
        fresh._channel_keys = {}
        fresh.receive(relayed[j])
        agreed_again[j] = fresh._held

    def no_agreement(*args: object) -> bytes:
        raise AssertionError("a channel was agreed a second time this round")

    monkeypatch.setattr(secagg, "agree", no_agreement)
    for j in nodes:
        restored = secagg.SecAggNode.restore(stored[j])
        restored.receive(relayed[j])
        assert restored.relayed == sorted(relayed[j])
        assert restored._held == agreed_again[j] and len(restored._held) == len(relayed[j]) + 1
    forged = dict(relayed[0])
    i = next(iter(forged))
    forged[i] = forged[i][:-1] + bytes([forged[i][-1] ^ 1])
    with pytest.raises(InvalidTag):
        secagg.SecAggNode.restore(stored[0]).receive(forged)
