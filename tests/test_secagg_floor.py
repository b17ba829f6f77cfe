"""The SecAgg+ floor benchmarks measure what they claim: the three-exchange round regroups the five-exchange
round's cryptography (it saves none of it), and the call groups are made at the protocol's degree and threshold."""

from __future__ import annotations

from collections import Counter

from benchmarks.secagg_flower import NULL_STAGES, STAGE_CALLS, Floor
from fedpers.privacy import secagg


def calls(exchanges: str) -> Counter[str]:
    return Counter(name for stage in NULL_STAGES[exchanges] for name in STAGE_CALLS[stage])


def test_three_exchanges_make_every_call_of_five_once_and_every_node_group_of_the_floor():
    floor = Floor(nodes=40, length=16)
    node_groups = {call.__name__ for who, call in floor.groups().values() if who == "node"}
    assert calls("3") == calls("5")
    assert set(calls("5")) == node_groups
    assert max(calls("5").values()) == 1


def test_the_floor_uses_the_protocols_degree_and_threshold_at_1000_nodes():
    floor = Floor(nodes=1000, length=16)
    assert (floor.degree, floor.threshold) == (secagg.plus_degree(1000), secagg.plus_threshold(1000)) == (20, 11)
    # the server's combine rebuilds a secret from exactly t shares, as the shipped server does
    assert len(floor._shares) == floor.threshold
