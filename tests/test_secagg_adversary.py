"""SecAgg+ against an active server (fedpers.privacy.secagg): the node-side rules that keep a node's input
hidden whatever the server relays or tells, each tested at its boundary (off by one fails), and a search by
program over every neighbour graph, threshold and survivor split the Flower planner produces for up to 12
nodes that finds no schedule revealing both shares (of b and of s^sk) of one node."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from fedpers.privacy import secagg
from fedpers.privacy.secagg import ProtocolViolation, SecAggNode

TAG = b"adversary-round!"


def honest_round(
    n: int, round: int = 0, threshold: int | None = None
) -> tuple[dict[int, SecAggNode], Mapping[int, Sequence[int]]]:
    """n nodes of the planner's graph for ``round`` that advertised, shared and masked honestly."""
    graph = secagg.plus_graph(n, round)
    t = secagg.plus_threshold(n) if threshold is None else threshold
    nodes = {i: SecAggNode(i, graph[i], t, 16, TAG) for i in range(n)}
    keys = {i: node.advertise() for i, node in nodes.items()}
    relayed: dict[int, dict[int, bytes]] = {i: {} for i in nodes}
    for i, node in nodes.items():
        for j, blob in node.share(keys).items():
            relayed[j][i] = blob
    for j, node in nodes.items():
        node.receive(relayed[j])
        node.masked(np.zeros(4, dtype=np.int64))
    return nodes, graph


def signatures(nodes: Mapping[int, SecAggNode], view: Sequence[int]) -> dict[int, bytes]:
    """Every node's signature on ``view`` (the adversary's best case: as if each had signed it)."""
    message = secagg.survivors_message(TAG, view)
    return {i: node._g_key.sign(message) for i, node in nodes.items()}


def reveals(
    node: SecAggNode, view: Sequence[int], sigs: Mapping[int, bytes], min_nodes: int, graph: Mapping[int, Sequence[int]]
) -> dict[int, str]:
    """What ``node`` (a copy: a node reveals once a round) reveals on ``view``: id → 'b' or 's' ({} if it refuses)."""
    copy = SecAggNode.restore(node.export())
    copy._signed = sorted(view)  # it signed this view (the adversary told it this set)
    try:
        got = copy.unmask(view, sigs, min_nodes, graph)
    except ProtocolViolation:
        return {}
    with pytest.raises(ProtocolViolation, match="secagg-once"):  # and never again this round, whatever it is told
        copy.unmask(view, sigs, min_nodes, graph)
    return {i: kind for i, (kind, _) in got.items()}


def both_shares_schedule(
    n: int, round: int, min_nodes: int, threshold: int | None = None
) -> tuple[int, list[int]] | None:
    """A schedule revealing ≥ t shares of b_v and ≥ t of s_v^sk for some node v, or None.

    Each holder of v's shares (v's closed neighbourhood) answers one unmask a round, on one survivor set the
    server tells it: any set holding the holder (it refuses otherwise). Its answer for v is b if v is in that
    set, s if not, and whether it answers at all depends on its checks; the checks only pass more often on a
    larger set and a smaller min_nodes (each is a lower bound), so the most permissive set with v is every
    node, and without v every node but v. The search runs the real node code on both for every holder, then
    tries every split of the holders into the two groups."""
    nodes, graph = honest_round(n, round, threshold)
    t = next(iter(nodes.values())).threshold
    everyone = list(range(n))
    full = {j: reveals(nodes[j], everyone, signatures(nodes, everyone), min_nodes, graph) for j in everyone}
    for v in everyone:
        holders = sorted([v, *graph[v]])
        without_v = [i for i in everyone if i != v]
        sig_without = signatures(nodes, without_v)
        kinds: dict[int, set[str]] = {}
        for j in holders:
            kinds[j] = {"b"} if full[j].get(v) == "b" else set()
            if j != v and reveals(nodes[j], without_v, sig_without, min_nodes, graph).get(v) == "s":
                kinds[j].add("s")
        for size in range(len(holders) + 1):
            for told_alive in itertools.combinations(holders, size):
                b = sum("b" in kinds[j] for j in told_alive)
                s = sum("s" in kinds[j] for j in holders if j not in told_alive)
                if b >= t and s >= t:
                    return v, list(told_alive)
    return None


def planner_graphs(n: int, rounds: int = 3) -> list[int]:
    """Rounds whose planner graphs differ (each a relabelled ring lattice, or the complete graph)."""
    seen, out = set(), []
    for r in range(rounds):
        g = secagg.plus_graph(n, r)
        key = tuple(tuple(g[i]) for i in range(n))
        degree = secagg.plus_degree(n)
        assert all(len(g[i]) == degree for i in range(n))  # regular of the planner's degree: a relabelled lattice
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def test_no_schedule_reveals_both_shares_of_one_node_for_any_plan_up_to_12_nodes():
    """Every node count 1..12, the planner's graphs and threshold, every survivor split (at min_nodes = 1, the
    most permissive: every larger min_nodes only refuses more): no node's b and s^sk both reach their
    threshold, because t = ⌊(d+1)/2⌋ + 1 > (d+1)/2 of its d+1 holders and each holder answers once a round."""
    for n in range(1, 13):
        t, d = secagg.plus_threshold(n), secagg.plus_degree(n)
        assert 2 * t > d + 1 and t <= d + 1, (n, d, t)
        for round in planner_graphs(n):
            assert both_shares_schedule(n, round, 1) is None, (n, round)


def test_the_search_finds_the_schedule_the_old_threshold_allowed():
    """The search has power: with t = ⌊d/2⌋ + 1 (the threshold before, 2 of 4 holders at 4 nodes) it finds a
    split that reveals both shares of a node (two holders told it survived, two that it dropped)."""
    found = both_shares_schedule(4, 0, 1, threshold=2)
    assert found is not None
    v, told_alive = found
    assert v in told_alive and len(told_alive) == 2


def test_a_node_masks_only_with_the_shares_of_threshold_minus_one_neighbours():
    """The masking rule at its boundary: t − 1 relayed neighbours mask, t − 2 are refused (5 nodes, t = 3)."""
    graph = secagg.plus_graph(5, 0)
    nodes = {i: SecAggNode(i, graph[i], secagg.plus_threshold(5), 16, TAG) for i in range(5)}
    t = nodes[0].threshold
    assert t == 3
    keys = {i: node.advertise() for i, node in nodes.items()}
    relayed: dict[int, dict[int, bytes]] = {i: {} for i in nodes}
    for i, node in nodes.items():
        for j, blob in node.share(keys).items():
            relayed[j][i] = blob
    enough = SecAggNode.restore(nodes[0].export())
    enough.receive(dict(list(relayed[0].items())[: t - 1]))
    enough.masked(np.zeros(3, dtype=np.int64))
    short = SecAggNode.restore(nodes[0].export())
    short.receive(dict(list(relayed[0].items())[: t - 2]))
    with pytest.raises(ProtocolViolation, match="secagg-relays"):
        short.masked(np.zeros(3, dtype=np.int64))


def test_the_survivor_rules_at_their_boundaries():
    """A node signs and reveals on a survivor set with exactly min_nodes members and exactly t of its closed
    neighbourhood, and refuses one member fewer; it refuses a set naming a neighbour it did not mask with,
    and one where its connected survivors are fewer than min_nodes (6 nodes, complete graph, t = 4)."""
    nodes, graph = honest_round(6)
    t = nodes[0].threshold
    assert t == 4
    node = nodes[0]
    exactly = [0, 1, 2, 3]  # t of its closed neighbourhood (itself and 3 neighbours)
    node.check_view(exactly, 4, graph)
    with pytest.raises(ProtocolViolation, match="below threshold 4"):
        node.check_view(exactly[:-1], 1, graph)
    with pytest.raises(ProtocolViolation, match="below min_nodes=5"):
        node.check_view(exactly, 5, graph)
    with pytest.raises(ProtocolViolation, match="not among the survivors"):
        node.check_view([1, 2, 3, 4], 1, graph)
    partial = SecAggNode.restore(nodes[0].export())
    partial._masked_with = [1, 2, 3]  # the server relayed it only three neighbours' shares
    partial.check_view([0, 1, 2, 3], 1, graph)
    with pytest.raises(ProtocolViolation, match=r"survivors \[4\] are neighbours it did not mask with"):
        partial.check_view([0, 1, 2, 3, 4], 1, graph)
    # a sparse graph (12 nodes, degree 8): survivors in two groups joined through nobody
    sparse_nodes, sparse = honest_round(12)
    lattice = sparse_nodes[0]
    near = sorted({0, *lattice.neighbours})
    assert len(near) == 9 and secagg.component(sparse, set(near), 0) == set(near)
    lattice.check_view(near, 9, sparse)
    with pytest.raises(ProtocolViolation, match="below min_nodes=10"):
        lattice.check_view(near, 10, sparse)


def test_consistency_one_signed_set_every_surviving_neighbour_signed_it_once_a_round():
    """A node signs one survivor set a round; it reveals only on the set it signed, only with a valid
    signature of every surviving neighbour on it (a missing or forged one, or a signature on another set,
    refused), and only once."""
    nodes, graph = honest_round(5)
    view = [0, 1, 2, 3, 4]
    sigs = {i: node.sign(view, 1, graph) for i, node in nodes.items()}
    node = nodes[0]
    assert node.sign(view, 1, graph) == sigs[0]  # the same set again: the same signature
    with pytest.raises(ProtocolViolation, match="secagg-consistency.*signs no other"):
        node.sign([0, 1, 2, 3], 1, graph)
    with pytest.raises(ProtocolViolation, match="it signed"):
        SecAggNode.restore(node.export()).unmask([0, 1, 2, 3], sigs, 1, graph)
    missing = {i: s for i, s in sigs.items() if i != 3}
    with pytest.raises(ProtocolViolation, match="no valid signature of neighbour 3"):
        SecAggNode.restore(node.export()).unmask(view, missing, 1, graph)
    forged = {**sigs, 2: bytes(64)}
    with pytest.raises(ProtocolViolation, match="no valid signature of neighbour 2"):
        SecAggNode.restore(node.export()).unmask(view, forged, 1, graph)
    other = {**sigs, 4: nodes[4]._g_key.sign(secagg.survivors_message(TAG, [0, 1, 2, 4]))}
    with pytest.raises(ProtocolViolation, match="no valid signature of neighbour 4"):
        SecAggNode.restore(node.export()).unmask(view, other, 1, graph)
    got = node.unmask(view, sigs, 1, graph)
    assert {kind for kind, _ in got.values()} == {"b"}
    with pytest.raises(ProtocolViolation, match="secagg-once"):
        node.unmask(view, sigs, 1, graph)
