"""The cryptography a SecAgg+ round cannot avoid, one library call group at a time, summed over n nodes.

Whatever the number of Message exchanges, a round of SecAgg+ against a dishonest server (Bell et al.
2020, with the consistency round) makes these calls, each through the function fedpers ships in
``fedpers/privacy/secagg.py`` (a thin wrapper over PyCryptodome's ``Shamir`` and ``cryptography``'s
X25519, HKDF, AES-GCM, AES-CTR and Ed25519); degree 2⌈log₂ n⌉ and threshold t as the protocol's:

- per node: its three round keys (two X25519, the mask key by HKDF from its seed, one Ed25519); two
  ``Shamir.split`` of its 16-byte seeds to its degree + 1 holders; a channel key to each neighbour
  (X25519 + HKDF) and AES-GCM of the shares it sends and of those relayed to it; a pair-mask key to each
  neighbour (X25519 + HKDF); the mask expansion (AES-CTR, one self mask and one per neighbour, D words);
  one Ed25519 signature on the survivor set and a verification of each neighbour's;
- at the server, per survivor: one ``Shamir.combine`` of t shares (its self-mask seed) and the self
  mask's expansion.

Nothing else (no encoding, no messages, no state): each group is timed as a whole over all n nodes, in
this one process, by its CPU time (the wall time beside it). The floor a round's wall time cannot go below on a machine of ``--cores`` cores is
printed two ways: everything spread over the cores, and the nodes' work spread over them with the
server's combines after it (they need the unmask replies, and the next round's task needs the sum).

    python benchmarks/secagg_floor.py [--nodes 1000] [--length L] [--bits 16] [--cores 2]

``--length`` defaults to the D of ``benchmarks/secagg_flower.py``'s tiny AltMin (its masked vector).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.secagg_flower import Floor, masked_length


def measure(floor: Floor) -> dict[str, tuple[str, float, float]]:
    """Name → (who, CPU seconds, wall seconds) of that group's calls for all ``floor.nodes`` nodes, one after
    the other. The CPU seconds are the floor's figure: on a shared machine the wall time also counts the
    other processes' turns."""
    out: dict[str, tuple[str, float, float]] = {}
    for name, (who, call) in floor.groups().items():
        call()  # the library's first call (tables, imports) is not a round's
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(floor.nodes):
            call()
        out[name] = (who, time.process_time() - cpu, time.perf_counter() - wall)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1000")
    p.add_argument("--length", type=int, default=0, help="D, the masked vector's length (0: secagg_flower's)")
    p.add_argument("--bits", type=int, default=16)
    p.add_argument("--cores", type=int, default=2)
    a = p.parse_args()
    length = a.length or masked_length()
    for n in [int(v) for v in a.nodes.split(",")]:
        f = Floor(n, length, a.bits)
        print(f"{n} nodes, degree {f.degree}, t = {f.threshold}, D = {length}, b = {a.bits}: seconds for all nodes")
        got = measure(f)
        for name, (who, cpu, wall) in got.items():
            print(f"  {who:<6} {name:<42} {cpu:>8.3f} s CPU {1e3 * cpu / n:>7.3f} ms/node  ({wall:.3f} s wall)")
        node = sum(cpu for who, cpu, _ in got.values() if who == "node")
        server = sum(cpu for who, cpu, _ in got.values() if who == "server")
        print(f"  CPU: nodes {node:.2f} s, server {server:.2f} s, all {node + server:.2f} s")
        print(
            f"  floor on {a.cores} cores: {(node + server) / a.cores:.2f} s spread, "
            f"{node / a.cores + server:.2f} s with the server's work after the nodes'",
            flush=True,
        )


if __name__ == "__main__":
    main()
