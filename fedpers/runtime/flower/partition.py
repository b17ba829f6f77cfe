"""Which units each Flower node holds: a deterministic function of its partition id.

Flower node ids are random; the stable index of a node is the ``partition-id`` in its node
config. The server learns (node id → partition id) in a discovery round and then maps
partitions to contiguous ranges of unit ids, so every run with the same config gives every
partition the same users whichever node holds it.
"""

from __future__ import annotations


def unit_ranges(num_units: int, partitions: int, users_per_node: int = 0) -> list[range]:
    """Contiguous unit-id ranges, one per partition.

    ``users_per_node = 0`` splits the units evenly (sizes differ by at most one); ``Q > 0``
    gives Q units to each partition (the last one the remainder) and needs exactly
    ``ceil(num_units / Q)`` partitions. Every partition holds at least one unit.
    """
    if num_units < 1:
        raise ValueError(f"num_units must be >= 1; got {num_units}")
    if partitions < 1:
        raise ValueError(f"nodes must be >= 1; got {partitions}")
    if users_per_node < 0:
        raise ValueError(f"users_per_node must be >= 0; got {users_per_node}")
    if users_per_node:
        needed = -(-num_units // users_per_node)
        if partitions != needed:
            raise ValueError(
                f"users_per_node={users_per_node} with {num_units} units needs nodes={needed}; got nodes={partitions}"
            )
        return [range(i * users_per_node, min((i + 1) * users_per_node, num_units)) for i in range(partitions)]
    if partitions > num_units:
        raise ValueError(f"nodes={partitions} exceeds the {num_units} units: every node must hold at least one unit")
    return [range(i * num_units // partitions, (i + 1) * num_units // partitions) for i in range(partitions)]
