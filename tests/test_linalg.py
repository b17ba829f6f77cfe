"""The fast paths of the scale-safe linear algebra agree with the exact ones and know their limits."""

from __future__ import annotations

import pytest
import torch

from fedpers import linalg


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_safe_norms_trusts_only_norms_computed_without_overflow_or_underflow(dtype: torch.dtype) -> None:
    x = torch.randn(6, 5, dtype=dtype)
    x[2] = 0.0
    assert torch.equal(linalg.safe_norms(x), torch.linalg.vector_norm(x, dim=-1))
    for bad in (1e30, 1e-30, 2.0**-43, float("inf")):
        y = x.clone()
        y[4] = bad  # a vector of huge (float32 overflow), tiny (squares underflow to 0) or below-range entries
        assert linalg.safe_norms(y) is None  # the exact power-of-two path takes it
    z = x.clone()
    z[4, 0] = 1e-30  # one tiny entry beside normal ones: the norm is exact, nothing to fear
    assert linalg.safe_norms(z) is not None


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30])
def test_directions_fast_and_exact_paths_agree(scale: float) -> None:
    x = torch.randn(50, 7, dtype=torch.float64) * scale
    unit, log_norm = linalg.directions(x.float())
    exact = x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    torch.testing.assert_close(unit.double(), exact, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(log_norm, torch.linalg.vector_norm(x, dim=-1).log(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1, 47, 97, 1000])
def test_kron_gram_sum_threads_split_equals_the_reference(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    v, x = torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(n, 4, 6, generator=g, dtype=torch.float64)
    reference = linalg.kron_vvT_sum(v, x.transpose(1, 2) @ x)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            torch.testing.assert_close(linalg.kron_gram_sum(v, x, block=8), reference, rtol=1e-12, atol=1e-12)
            assert torch.get_num_threads() == t  # restored after the split
    finally:
        torch.set_num_threads(threads)


def test_float32_sums_with_float64_solves_track_the_float64_run() -> None:
    """--dtype float32 (what a GPU run uses) sums in float32 but solves in float64: on the same
    users (a float32 run draws its own, docs/benchmarks.md) the released subspace stays within
    float32 rounding of the float64 run's, same noise."""
    from fedpers import config as config_lib
    from fedpers import metrics
    from fedpers.experiments.altmin import (
        AltMinConfig,
        load_units,
        make_protocol,
        truth,
    )
    from fedpers.privacy import Privatizer
    from fedpers.runtime.local import run_local

    users = load_units(config_lib.build(AltMinConfig, {"n_users": 4000, "dim": 10, "rank": 2}), torch.arange(4000))
    U, errors = {}, {}
    for dtype in ("float32", "float64"):
        cfg = config_lib.build(
            AltMinConfig, {"n_users": 4000, "dim": 10, "rank": 2, "epsilon": 4.0, "baselines": "none", "dtype": dtype}
        )
        units = {
            k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v)
            for k, v in users.items()
            if k in ("ids", "x", "y")
        }
        state, _ = run_local(make_protocol(cfg), units, Privatizer(3), progress=False)
        U[dtype], errors[dtype] = state["U"], metrics.subspace_error(state["U"], truth(cfg))
    assert U["float32"].dtype == torch.float32 and U["float64"].dtype == torch.float64
    torch.testing.assert_close(U["float32"].double(), U["float64"], rtol=0, atol=1e-4)
    assert errors["float32"] == pytest.approx(errors["float64"], rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cache_sized_kron_blocks_equal_the_old_48_user_blocks(dtype: torch.dtype) -> None:
    """At d = 100 the Gram matrices of 48 users spill out of L2, so blocks are smaller (24 float32, 12
    float64): the clipped A and b equal the 48-user blocks' to float rounding and the exact per-sample
    sums (float64) to 1e-12; below the cache bound nothing changes (d = 50, float32: 48)."""
    assert (linalg.kron_block(100, 4), linalg.kron_block(100, 8), linalg.kron_block(50, 4)) == (32, 16, 48)
    g = torch.Generator().manual_seed(7)
    n, q, d, k = 150, 3, 100, 2
    v = torch.randn(n, k, generator=g, dtype=torch.float64)
    x = torch.randn(n, q, d, generator=g, dtype=torch.float64)
    y = torch.randn(n, q, generator=g, dtype=torch.float64)
    v_hat, log_v = linalg.directions(v)
    eta = 8.0
    new = linalg.kron_statistics(v_hat.to(dtype), x.to(dtype), log_v, eta, label=y.to(dtype))
    old = linalg.kron_statistics(v_hat.to(dtype), x.to(dtype), log_v, eta, label=y.to(dtype), block=48)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for a, b in zip(new, old):
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol * float(b.abs().max()))
    w = linalg.clip_vectors((v[:, None, :, None] * x[:, :, None, :]).reshape(n * q, k * d), eta)  # v ⊗ x per sample
    exact = (w.T @ w, w.T @ y.reshape(-1))
    for a, b in zip(new, exact):
        torch.testing.assert_close(a.double(), b, rtol=tol * 10, atol=tol * 10 * float(b.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_round_statistics_with_small_ops_on_one_thread_are_the_same_bits_at_every_thread_count(
    dtype: torch.dtype,
) -> None:
    """Inside serial_small_ops the float64 round statistics are the same bits whatever torch's thread
    count (the property a Ray worker, a resumed run and the local runtime rely on; float64 is the
    default). float32 ones agree to float rounding only: float32 shares run concurrently on two pool
    threads were seen to differ in the last bit between two calls on the same input (float64 never).
    Both equal the threaded path to rounding (CI's CPU orders a threaded float32 reduction otherwise),
    and torch's thread count and the budget are restored."""
    from fedpers.protocols.altmin import AltMinProtocol, Cohorts

    g = torch.Generator().manual_seed(1)
    n, d, k, m = 600, 30, 3, 8
    x, y = torch.randn(n, m, d, generator=g, dtype=dtype), torch.randn(n, m, generator=g, dtype=dtype)
    p = AltMinProtocol(
        n_users=n,
        dim=d,
        rank=k,
        samples_per_user=m,
        rounds=1,
        eta=4.0,
        zeta=2.0,
        noise_multiplier=1.0,
        cohorts=Cohorts.ALL,
        dtype_name=str(dtype).removeprefix("torch."),
    )
    U = linalg.orthonormal_basis(torch.randn(d, k, generator=g, dtype=dtype))
    threads = torch.get_num_threads()
    serial: dict[int, tuple[torch.Tensor, ...]] = {}
    try:
        torch.set_num_threads(2)
        reference = p._round_statistics(U, x, y)  # the threaded path, without the context
        for outer in (1, 2, 4):
            torch.set_num_threads(outer)
            assert linalg.thread_budget() == outer
            with linalg.serial_small_ops("cpu"):
                assert torch.get_num_threads() == 1 and linalg.thread_budget() == outer
                with linalg.serial_small_ops("cpu"):
                    assert linalg.thread_budget() == outer
                serial[outer] = p._round_statistics(U, x, y)
            assert torch.get_num_threads() == outer and linalg.thread_budget() == outer
    finally:
        torch.set_num_threads(threads)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for outer in (2, 4):
        for a, b in zip(serial[outer], serial[1]):
            if dtype == torch.float64:
                assert torch.equal(a, b), f"{outer} threads changed the bits"
            else:
                torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
    for a, b in zip(serial[1], reference):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))


@pytest.mark.parametrize(("d", "dtype"), [(1, torch.float64), (7, torch.float32), (7, torch.float64)])
def test_the_host_gram_halves_equal_the_full_gram_loop_and_the_exact_sums(d: int, dtype: torch.dtype) -> None:
    """On the host only the Gram rows [:d//2] and the lower-right block are formed, the label sums
    are one product per share, and a share with untrusted norms (here: entries of 1e30, whose
    squares overflow float32) takes per-block factors: A and b equal the device path's full-Gram
    loop and the exact clipped per-sample sums to float rounding, with and without the clip, and
    are the same bits at every thread count (the shares depend on n alone)."""
    g = torch.Generator().manual_seed(d)
    n, q, k, eta = 300, 3, 3, 2.0
    v = torch.randn(n, k, generator=g, dtype=torch.float64)
    x = torch.randn(n, q, d, generator=g, dtype=torch.float64)
    x[:6] *= 1e30  # the first share's norms are not trusted in float32
    y = torch.randn(n, q, generator=g, dtype=torch.float64)
    v_hat, log_v = linalg.directions(v)
    w = linalg.clip_vectors((v[:, None, :, None] * x[:, :, None, :]).reshape(n * q, k * d), eta)  # v ⊗ x per sample
    raw = (v[:, None, :, None] * x[:, :, None, :]).reshape(n * q, k * d)[6 * q :]
    cases = {
        "clipped": ((v_hat.to(dtype), x.to(dtype), log_v, eta), (w.T @ w, w.T @ y.reshape(-1))),
        "plain": ((v.to(dtype), x[6:].to(dtype), None), (raw.T @ raw, raw.T @ y[6:].reshape(-1))),
    }
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    threads = torch.get_num_threads()
    try:
        for args, exact in cases.values():
            label = y.to(dtype) if args[2] is not None else y[6:].to(dtype)
            args = args if args[2] is not None else (args[0][6:], args[1])
            runs = []
            for t in (1, 2):
                torch.set_num_threads(t)
                runs.append(linalg.kron_statistics(*args, label=label, block=8))
            full = linalg.kron_statistics(*args, label=label, block=8, device_kernels=True)
            for a, b in zip(runs[0], runs[1]):  # float64: the same bits; float32: rounding (see the test above)
                if dtype == torch.float64:
                    assert torch.equal(a, b)
                else:
                    torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
            for a, f, e in zip(runs[0], full, exact):
                torch.testing.assert_close(a.double(), f.double(), rtol=tol, atol=tol * float(e.abs().max()))
                torch.testing.assert_close(a.double(), e, rtol=tol * 10, atol=tol * 10 * float(e.abs().max()))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 1e-25, 1e25])
def test_one_unit_statistics_equal_the_blocked_path_and_the_per_sample_sums(
    dtype: torch.dtype, scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node of one user takes kron_statistics' one-unit path every round: A and b equal the
    blocked path's (the same user beside an all-zero one, which adds exact zeros) to float rounding,
    b to the bit, and the per-sample clipped sums; norms it cannot trust (1e±25 overflow or
    underflow float32 squares) still take the exact directions, and a non-finite user gives what
    the blocked path gives."""
    g = torch.Generator().manual_seed(3)
    q, d, k, eta = 20, 50, 3, 1.5
    v = torch.randn(1, k, generator=g, dtype=torch.float64)
    x = torch.randn(1, q, d, generator=g, dtype=torch.float64) * scale
    x[0, 4] = 0.0  # a zero sample: clip factor 0
    y = torch.randn(1, q, generator=g, dtype=torch.float64)
    v_hat, log_v = linalg.directions(v)
    args = (v_hat.to(dtype), x.to(dtype), log_v, eta)
    taken: list[bool] = []
    one_unit = linalg._one_unit_statistics
    monkeypatch.setattr(linalg, "_one_unit_statistics", lambda *a: taken.append(True) or one_unit(*a))
    one = linalg.kron_statistics(*args, label=y.to(dtype))
    assert taken == [True]  # n = 1 on the host: the one-unit path (it may hand back to the blocked one)
    pair = linalg.kron_statistics(
        *(torch.cat([a, torch.zeros_like(a)]) for a in args[:3]), eta, label=torch.cat([y, y]).to(dtype)
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(one[0], pair[0], rtol=tol, atol=tol * float(pair[0].abs().max()))
    if scale == 1.0:  # on the fast path: the label sum is formed exactly as the blocked path forms it
        assert torch.equal(one[1], pair[1])
    w = linalg.clip_vectors((v[:, None, :, None] * x[:, :, None, :]).reshape(q, k * d), eta)
    for got, exact in zip(one, (w.T @ w, w.T @ y.reshape(-1))):
        if dtype == torch.float32 and scale < 1:  # products of 1e-25 entries underflow float32 on every path
            break
        torch.testing.assert_close(got.double(), exact, rtol=tol * 10, atol=tol * 10 * float(exact.abs().max()))
    bad = x.clone()
    bad[0, 2, 1] = float("nan")
    nan_one = linalg.kron_statistics(v_hat, bad, log_v, eta, label=y)
    nan_pair = linalg.kron_statistics(
        torch.cat([v_hat, v_hat * 0]),
        torch.cat([bad, bad * 0]),
        torch.cat([log_v, log_v]),
        eta,
        label=torch.cat([y, y]),
    )
    for a, b in zip(nan_one, nan_pair):
        assert torch.equal(a.isnan(), b.isnan())


def test_ridge_solve_equals_the_normal_equations_and_a_non_finite_problem_spoils_only_itself() -> None:
    """batched_ridge_solve: (FᵀF + ridge·mean(diag)·I) v = Fᵀy per problem (float64), a problem with
    a NaN or inf gets a NaN solution while its batch-mates' solutions are the bits they get alone,
    and a rank-deficient one (Cholesky refuses it) still gets its least-squares solution."""
    g = torch.Generator().manual_seed(5)
    f, y = torch.randn(4, 20, 3, generator=g, dtype=torch.float64), torch.randn(4, 20, generator=g, dtype=torch.float64)
    ridge = 1e-3
    gram = f.transpose(1, 2) @ f
    scale = gram.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1.0)
    want = torch.linalg.solve(
        gram + (ridge * scale)[:, None, None] * torch.eye(3), (f.transpose(1, 2) @ y[..., None])[..., 0]
    )
    torch.testing.assert_close(linalg.batched_ridge_solve(f, y, ridge), want, rtol=1e-12, atol=1e-12)
    alone = [linalg.batched_ridge_solve(f[i : i + 1], y[i : i + 1], ridge) for i in range(4)]
    bad_f, bad_y = f.clone(), y.clone()
    bad_f[1, 2, 0], bad_y[2, 5] = float("nan"), float("inf")
    got = linalg.batched_ridge_solve(bad_f, bad_y, ridge)
    assert got[1].isnan().all() and got[2].isnan().all()
    assert torch.equal(got[0], alone[0][0]) and torch.equal(got[3], alone[3][0])
    flat = torch.zeros(1, 20, 3, dtype=torch.float64)
    flat[0, :, 0] = 1.0  # rank one: FᵀF + ridge·I is singular only without the ridge; zero ridge forces lstsq
    v = linalg.batched_ridge_solve(flat, torch.ones(1, 20, dtype=torch.float64), 0.0)
    torch.testing.assert_close(v, torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_block_norms_and_safe_norms_make_the_same_decision_on_zero_tiny_huge_and_non_finite_vectors(
    dtype: torch.dtype,
) -> None:
    """Both read the norms' minimum and maximum once and look closer only below 2⁻⁴⁰: a zero vector
    is trusted (its norm is exactly 0), a vector whose squares underflow, a huge one, NaN and inf
    are not, in every dtype (float16 cannot hold 2⁻⁴⁰: its comparison is the dtype's own)."""
    base = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(2)).to(dtype)
    cases = {
        "plain": base.clone(),
        "zero": base.clone(),
        "nan": base.clone(),
        "inf": base.clone(),
        "huge": base.clone(),
    }
    cases["zero"][1, 2] = 0
    cases["nan"][0, 1, 1] = float("nan")
    cases["inf"][2, 0, 4] = float("inf")
    cases["huge"][3, 1] = 2.0**60 if dtype != torch.float16 else float("inf")
    if dtype in (torch.float32, torch.float64, torch.bfloat16):
        cases["tiny"] = base.clone()
        cases["tiny"][1, 1] = 2.0**-70  # squares underflow (float32, bfloat16) or the norm is below 2⁻⁴⁰
    for name, x in cases.items():
        trusted = name in ("plain", "zero")
        for f in (linalg.safe_norms, linalg._block_norms):
            got = f(x)
            assert (got is not None) == trusted, (name, f.__name__)
            if got is not None:
                assert torch.equal(got, torch.linalg.vector_norm(x, dim=-1))


def test_lstsq_gives_the_same_bits_on_every_call_and_the_minimum_norm_solution_of_a_rank_one_system() -> None:
    """torch's CPU default (gelsy) gave other bits on most repeated calls with the same input and,
    in about 2 % of calls, the zero vector for a rank-one system, as the process's memory changed
    between calls (the rank-one case of the ridge test above failed two fresh-clone suites)."""
    g = torch.Generator().manual_seed(0)
    a, b = (
        torch.randn(50, 40, 5, generator=g, dtype=torch.float64),
        torch.randn(50, 40, 1, generator=g, dtype=torch.float64),
    )
    rank_one = torch.zeros(1, 3, 3, dtype=torch.float64)
    rank_one[0, 0, 0] = 20.0
    rhs = torch.zeros(1, 3, 1, dtype=torch.float64)
    rhs[0, 0, 0] = 20.0
    first = linalg.lstsq(a, b)
    held = []
    for i in range(200):
        held.append(torch.empty(1 + (i * 7919) % 5000, dtype=torch.float64))  # the heap moves between calls
        assert torch.equal(linalg.lstsq(a, b), first)
        assert torch.equal(linalg.lstsq(rank_one, rhs)[0, :, 0], torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
