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
        cfg = config_lib.build(AltMinConfig, {"n_users": 4000, "dim": 10, "rank": 2, "epsilon": 4.0, "baselines": "none", "dtype": dtype})
        units = {k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v) for k, v in users.items() if k in ("ids", "x", "y")}
        state, _ = run_local(make_protocol(cfg), units, Privatizer(3), progress=False)
        U[dtype], errors[dtype] = state["U"], metrics.subspace_error(state["U"], truth(cfg))
    assert U["float32"].dtype == torch.float32 and U["float64"].dtype == torch.float64
    torch.testing.assert_close(U["float32"].double(), U["float64"], rtol=0, atol=1e-4)
    assert errors["float32"] == pytest.approx(errors["float64"], rel=1e-3)
