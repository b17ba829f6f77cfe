"""One private AltMin round over a cohort of 100,000 users (d=100, k=5, m=40, float32, CPU).

Times, in one run: the client statistics in Kronecker form (what fedpers uses: Gram matrices
fused per block into one GEMM with the products v_a v_b), the previous form (every user's
Gram matrix first, then the Kronecker GEMM), a plain torch GEMM of the tight flop count
(2·n·(|Q2|·d² + k²·d²): X_jᵀX_j plus the Kronecker accumulation) in float32 and float64,
the same statistics from per-sample vectors w_ij (one big GEMM), and the naive per-sample
outer products w_ij w_ijᵀ (on a subset, extrapolated); then the whole round (local solves,
statistics, noise, PSD floor, solve, QR). Prints ratios and the process's peak memory.

    python benchmarks/altmin_round.py [--users 100000] [--naive-users 200]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from fedpers import linalg
from fedpers.data import synthetic
from fedpers.privacy import Privatizer
from fedpers.protocols.altmin import AltMinProtocol, Cohorts
from fedpers.protocols.base import Message


def per_sample_vectors(p: AltMinProtocol, U, x, y):
    """w_ij = clip(vec(x v_jᵀ); η) materialised per sample, A = WᵀW, b = Wᵀỹ."""
    q = p.quarter
    v = p.local_solve(U, x[:, :q], y[:, :q])
    x2, y2 = x[:, q : 2 * q], y[:, q : 2 * q]
    w = (v.unsqueeze(1).unsqueeze(-1) * x2.unsqueeze(2)).reshape(x.shape[0] * q, -1)  # v ⊗ x
    w = linalg.clip_vectors(w, p.eta)
    return w.T @ w, w.T @ linalg.clip_scalar(y2.reshape(-1), p.zeta)


def naive_outer(p: AltMinProtocol, U, x, y, batch: int = 64):
    """Σ w wᵀ with every per-sample dk×dk outer product formed explicitly."""
    q = p.quarter
    v = p.local_solve(U, x[:, :q], y[:, :q])
    x2, y2 = x[:, q : 2 * q], y[:, q : 2 * q]
    w = linalg.clip_vectors((v.unsqueeze(1).unsqueeze(-1) * x2.unsqueeze(2)).reshape(x.shape[0] * q, -1), p.eta)
    yt = linalg.clip_scalar(y2.reshape(-1), p.zeta)
    A = torch.zeros(w.shape[1], w.shape[1], dtype=w.dtype)
    for s in range(0, w.shape[0], batch):
        A += torch.einsum("si,sj->sij", w[s : s + batch], w[s : s + batch]).sum(0)
    return A, (yt.unsqueeze(-1) * w).sum(0)


def gram_then_kronecker(p: AltMinProtocol, U, x, y):
    """The previous form: all users' X_jᵀX_j (n, d, d) first, then one (k², n)·(n, d²) GEMM."""
    q = p.quarter
    v_hat, log_v = linalg.directions(p.local_solve(U, x[:, :q], y[:, :q]))
    x_hat, log_x = linalg.directions(x[:, q : 2 * q])
    xc = x_hat * linalg.clipped_magnitude(log_v.unsqueeze(-1) + log_x, p.eta).to(x.dtype).unsqueeze(-1)
    return linalg.kron_vvT_sum(v_hat, xc.transpose(1, 2) @ xc)


def gemm_seconds(flops: float, dtype: torch.dtype, size: int = 2048, reps: int = 3) -> float:
    """Seconds a plain square GEMM takes for ``flops`` (best of ``reps``, scaled from one size)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    best = min(timed(torch.matmul, a, b)[1] for _ in range(reps))
    return best * flops / (2 * size**3)


def statistics_vs_gemm(
    n: int, d: int, k: int, m: int, chunk: int, dtype: torch.dtype, reps: int = 5
) -> tuple[float, float, float]:
    """(fused, previous form, GEMM of the tight flop count) seconds for n users, best of ``reps`` interleaved."""
    u = synthetic.subspace(0, d, k, dtype)
    units = synthetic.altmin_users(0, torch.arange(n), u, m, 0.1, dtype)
    p = AltMinProtocol(
        n_users=n,
        dim=d,
        rank=k,
        samples_per_user=m,
        rounds=1,
        eta=0.7 * (d * k) ** 0.5,
        zeta=2.0 * (k + 0.01) ** 0.5,
        noise_multiplier=3.0,
        cohorts=Cohorts.ALL,
        dtype_name=str(dtype).split(".")[-1],
    )
    U = linalg.orthonormal_basis(u + 0.1 * torch.randn(d, k, generator=torch.Generator().manual_seed(1), dtype=dtype))

    def over_chunks(fn):
        def go():
            for s in range(0, n, chunk):
                fn(p, U, units["x"][s : s + chunk], units["y"][s : s + chunk])

        return timed(go)[1]

    flops = 2.0 * n * (p.quarter * d * d + k * k * d * d)
    fused, previous, gemm = [], [], []
    for _ in range(reps):  # interleaved, minimum of each: a noisy shared machine slows all alike
        fused.append(over_chunks(lambda p_, U_, x, y: p_.round_statistics(U_, x, y)))
        previous.append(over_chunks(gram_then_kronecker))
        gemm.append(gemm_seconds(flops, dtype, reps=1))
    return min(fused), min(previous), min(gemm)


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=100)
    ap.add_argument("--rank", type=int, default=5)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--naive-users", type=int, default=200)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--gemm-users", type=int, default=20_000, help="users for the statistics-vs-GEMM comparison")
    args = ap.parse_args()
    n, d, k, m = args.users, args.dim, args.rank, args.samples
    torch.set_num_threads(torch.get_num_threads())
    for dtype in (torch.float32, torch.float64):
        fused, previous, gemm = statistics_vs_gemm(args.gemm_users, d, k, m, args.chunk, dtype)
        print(
            f"{str(dtype)[6:]}: client statistics {fused:.3f} s (previous form {previous:.3f} s), GEMM of the tight flop count "
            f"{gemm:.3f} s -> statistics/GEMM {fused / gemm:.2f}x (previous form {previous / gemm:.2f}x; target <= 3x)"
        )
    u = synthetic.subspace(0, d, k, torch.float32)
    t0 = time.perf_counter()
    units = synthetic.altmin_users(0, torch.arange(n), u, m, 0.1, torch.float32)
    print(
        f"data: {n} users × {m} samples × d={d} (float32, {units['x'].numel() * 4 / 2**30:.2f} GiB) generated in {time.perf_counter() - t0:.1f} s"
    )
    p = AltMinProtocol(
        n_users=n,
        dim=d,
        rank=k,
        samples_per_user=m,
        rounds=1,
        eta=0.7 * (d * k) ** 0.5,
        zeta=2.0 * (k + 0.01) ** 0.5,
        noise_multiplier=3.0,
        cohorts=Cohorts.ALL,
        dtype_name="float32",
    )
    U = linalg.orthonormal_basis(u + 0.1 * torch.randn(d, k, generator=torch.Generator().manual_seed(1)))

    def kron_all():
        A = b = None
        for s in range(0, n, args.chunk):
            a_, b_ = p.round_statistics(U, units["x"][s : s + args.chunk], units["y"][s : s + args.chunk])
            A, b = (a_, b_) if A is None else (A + a_, b + b_)
        return A, b

    (A_k, b_k), t_kron = timed(kron_all)
    sub = slice(0, args.naive_users)
    (A_v, _), t_vec_sub = timed(per_sample_vectors, p, U, units["x"][:2000], units["y"][:2000])
    (A_n, _), t_naive_sub = timed(naive_outer, p, U, units["x"][sub], units["y"][sub])
    A_k_sub, _ = p.round_statistics(U, units["x"][sub], units["y"][sub])
    rel = float(torch.linalg.matrix_norm(A_k_sub.double() - A_n.double()) / torch.linalg.matrix_norm(A_n.double()))
    t_naive = t_naive_sub * n / args.naive_users
    t_vec = t_vec_sub * n / 2000

    def whole_round():
        msg = None
        for s in range(0, n, args.chunk):
            part = p.client_update(1, {"U": U}, {k_: v[s : s + args.chunk] for k_, v in units.items()})
            msg = part if msg is None else msg + part
        return p.server_update(1, {"U": U}, Message(msg.stats, msg.count), Privatizer(0))

    (_, info), t_round = timed(whole_round)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"client statistics, Kronecker form     : {t_kron:8.2f} s for {n} users")
    print(f"per-sample vectors WᵀW (from {2000:>5} users): {t_vec:8.2f} s projected")
    print(
        f"naive per-sample outer products (from {args.naive_users} users): {t_naive:8.1f} s projected (rel. diff to Kronecker {rel:.1e})"
    )
    print(f"ratio naive / Kronecker               : {t_naive / t_kron:8.1f}x   (target >= 5x)")
    print(f"ratio per-sample GEMM / Kronecker     : {t_vec / t_kron:8.1f}x")
    print(f"whole round (solves + stats + noise + PSD floor + solve + QR): {t_round:.2f} s   (target < 10 s)")
    print(
        f"peak resident memory of this process  : {peak:.2f} GiB   (target < 4 GiB; data alone {units['x'].numel() * 4 / 2**30:.2f} GiB)"
    )
    print(f"threads: {torch.get_num_threads()}, eigenvalues raised by the PSD floor: {info['eigenvalues_raised']:.0f}")


if __name__ == "__main__":
    main()
