"""The cost of one secure-aggregation round against central aggregation, side by side in one run.

For each number of nodes, every node holds an integer vector of D coordinates (D = 1,024 by default:
AltMin's A at d = 20, k = 2 padded is 1,024) and the server wants their sum mod 2^b. Timed, all in
this process (the wall time of every node and the server together, no network):

- central: the server sums the nodes' float vectors (what --dp-model central aggregates);
- modular: the same as integers mod 2^b (what the local runtime simulates for --dp-model distributed);
- SecAgg+: fedpers.privacy.secagg.secure_sum — key agreement, Shamir shares of the two 16-byte seeds,
  AES-GCM share exchange, AES-CTR masks, the consistency round (Ed25519 signatures on the survivor set),
  unmasking — with each node joined to 2⌈log₂ n⌉ neighbours (all others when n is small: SecAgg),
  threshold more than half of each neighbourhood;
- SecAgg+ with 10 % of nodes silent after masking and signing (their self masks rebuilt from shares).

The ms/node column is the SecAgg+ round over n: every node's cryptography and its share of the server's.

    python benchmarks/secagg_round.py [--nodes 10,100,1000] [--dim 1024] [--bits 16] [--no-drop]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import numpy as np
import torch

from fedpers.privacy.secagg import default_threshold, secure_sum


def timed(fn: Callable[[], object], repeat: int = 1) -> float:
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="10,100,1000")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--bits", type=int, default=16)
    p.add_argument("--no-drop", action="store_true", help="skip the second round (10 %% silent after signing)")
    a = p.parse_args()
    torch.set_num_threads(1)  # a sum of small vectors: threads only add start-up on a shared machine
    rng = np.random.default_rng(0)
    secure_sum({i: np.zeros(4, dtype=np.int64) for i in range(3)}, a.bits)  # warm-up: the libraries' first calls
    print(f"D = {a.dim}, b = {a.bits}; seconds per round (best of 3 for the plain sums, 1 for SecAgg+)")
    print(
        f"{'nodes':>6} {'degree':>6} {'central':>10} {'modular':>10} {'SecAgg+':>10} {'ms/node':>8} {'+10% drop':>10} {'SecAgg+/central':>16}"
    )
    for n in [int(v) for v in a.nodes.split(",")]:
        ints = {i: rng.integers(0, 2**a.bits, a.dim) for i in range(n)}
        floats = torch.randn(n, a.dim, dtype=torch.float64)
        stacked = torch.from_numpy(np.stack(list(ints.values())))
        central = timed(lambda f=floats: f.sum(dim=0), 3)
        modular = timed(lambda s=stacked: torch.remainder(s.sum(dim=0), 2**a.bits), 3)
        degree = min(n - 1, 2 * math.ceil(math.log2(n)))
        threshold = default_threshold(degree)
        expect = np.remainder(sum(ints.values()), 2**a.bits)
        start = time.perf_counter()
        out = secure_sum(ints, a.bits, degree=degree, threshold=threshold)
        secure = time.perf_counter() - start
        assert np.array_equal(out, expect)
        dropped = math.nan
        if not a.no_drop:
            drop = {i: "consistency" for i in range(0, n, 10)}
            start = time.perf_counter()
            out = secure_sum(ints, a.bits, degree=degree, threshold=threshold, drop_after=drop)
            dropped = time.perf_counter() - start
            assert np.array_equal(out, expect)
        print(
            f"{n:>6} {degree:>6} {central:>10.2e} {modular:>10.2e} {secure:>10.3f} {1e3 * secure / n:>8.2f} {dropped:>10.3f} "
            f"{secure / central:>16.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
