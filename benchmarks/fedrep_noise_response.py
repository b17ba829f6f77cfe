"""What Private FedRep's final error depends on, and which correlated-noise workload matches it.

Runs FedRep's gradient rounds (its own clipped gradients, cohorts and step) from a fixed start
U_0 = orth(U* + 0.3·N(0, 1)) on the first ``--users`` synthetic users of a K-cycle, and adds to
each round's clipped sum a chosen noise sequence instead of the Privatizer's, so that the same
standard normals z (common random numbers) drive every mechanism. Prints, side by side:

1. the objective each strategy minimises, per unit z·clip: σ² (the participation's s²/P),
   σ²·‖A C⁻¹‖_F² (prefix sums), σ²·‖A_λ C⁻¹‖_F² and the per-round noise variance σ²·‖C⁻¹‖_F²/T;
2. the impulse response: the excess final squared subspace error from independent noise
   (σ of the run) in round t only — how fast FedRep forgets a perturbation;
3. the excess final squared subspace error of each mechanism at its own σ, and its ratio to
   independent noise.

This is a diagnostic, not a privacy run: nothing here is released or accounted (the σ are the
calibrated ones of ``--epsilon``). docs/fedrep.md quotes it.

    PYTHONPATH=$PWD python benchmarks/fedrep_noise_response.py [--eta 2.5] [--reps 16] [--rounds 16]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from fedpers import linalg, metrics
from fedpers.experiments.fedrep import FedRepConfig, load_all, make_protocol, truth
from fedpers.privacy import correlated as cr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--cycle", type=int, default=4)
    ap.add_argument("--epsilon", type=float, default=4.0)
    ap.add_argument("--eta", type=float, nargs="+", default=[2.5])
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--decays", type=float, nargs="+", default=[0.7, 0.4])
    ap.add_argument("--impulse", action="store_true", help="also the impulse response (T·reps more runs)")
    args = ap.parse_args()
    T, K = args.rounds, args.cycle
    cfg = FedRepConfig(
        n_users=args.users, dim=10, rank=2, samples_per_user=5, refit_samples=5, test_samples=20, noise_std=0.01,
        delta=1e-6, rounds=T, learning_rate=2.5, clip=0.5, epsilon=args.epsilon, cohorts="cyclic", cycle=K,
        baselines="none",
    )  # fmt: skip
    p0 = make_protocol(cfg)
    data = load_all(cfg, torch.arange(cfg.n_users), test=False)
    u_star = truth(cfg)
    g = torch.Generator().manual_seed(1)
    U0 = linalg.orthonormal_basis(u_star + 0.3 * torch.randn(u_star.shape, generator=g, dtype=u_star.dtype))
    shape = (T, cfg.dim, cfg.rank)

    def final_error(p, noise: torch.Tensor) -> float:
        U = U0.clone()
        for r in range(1, T + 1):
            a, b = p.cohort_range(p.round_cohort(r))
            G = p.clipped_gradients(U, data["x"][a:b], data["y"][a:b]).sum(0) + noise[r - 1]
            U = linalg.orthonormal_basis(U - p.learning_rate * G / (b - a))
        return metrics.subspace_error(U, u_star) ** 2

    kinds = [("independent", 1.0), ("banded", 1.0), ("optimised", 1.0), ("blt", 1.0)]
    kinds += [(k, lam) for lam in args.decays for k in ("optimised", "blt")]
    mechs = {k: cr.mechanism(k[0], T, 4 if k[0] == "blt" else K, K, k[1]) for k in kinds}
    print(f"FedRep n={args.users} d=10 k=2 T={T} K={K} ε={args.epsilon} z={p0.noise_multiplier:.4f} (shared machine)")
    print("\n1. objective per unit (z·clip)²: σ², prefix-sum error, A_λ error, per-round noise variance")
    A = cr.decay_workload(T, 1.0)
    for (kind, lam), m in mechs.items():
        Ci = torch.linalg.inv(m.strategy.matrix(T))
        s2 = (m.sensitivity.value / m.sensitivity.participations**0.5) ** 2
        own = float((cr.decay_workload(T, lam) @ Ci).square().sum())
        print(
            f"  {kind:>11} λ={lam:<4} σ²={s2:.3f}  prefix {s2 * float((A @ Ci).square().sum()):8.2f}  "
            f"A_λ {s2 * own:8.2f}  per-round {s2 * float(Ci.square().sum()) / T:.3f}  ({m.sensitivity.rule})"
        )
    Z = [torch.randn(T, cfg.dim * cfg.rank, generator=g, dtype=torch.float64) for _ in range(args.reps)]
    for eta in args.eta:
        start = time.perf_counter()
        p = replace(p0, learning_rate=eta)
        base = final_error(p, torch.zeros(shape, dtype=torch.float64))
        sigma = p.round_noise_std()
        print(f"\nη = {eta}: non-private final error² {base:.3e}; independent σ = {sigma:.4f}")
        if args.impulse:
            resp = []
            for t in range(T):
                e = 0.0
                for z in Z:
                    n = torch.zeros(shape, dtype=torch.float64)
                    n[t] = sigma * z[t].reshape(shape[1:])
                    e += final_error(p, n) - base
                resp.append(e / len(Z))
            total = sum(resp)
            print("2. impulse response (excess error² from round t's noise only), t = 1..T:")
            print("   " + " ".join(f"{x:.1e}" for x in resp))
            print(f"   last round's share of the sum: {resp[-1] / total:.2f}")
        print("3. excess final error² at each mechanism's own σ (mean over reps; ratio to independent):")
        ref = None
        for (kind, lam), m in mechs.items():
            s = m.noise_std(p.noise_multiplier, p.clip)
            Ci = torch.linalg.inv(m.strategy.matrix(T))
            e = sum(final_error(p, (s * (Ci @ z)).reshape(shape)) - base for z in Z) / len(Z)
            ref = e if ref is None else ref
            print(f"  {kind:>11} λ={lam:<4} {e:.3e}  ×{e / ref:.2f}")
        print(f"  ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
