"""Synthetic users generated only where needed, on a pool, in the working dtype (docs/benchmarks.md)."""

from __future__ import annotations

import time

import pytest
import torch

from fedpers import config
from fedpers.data import synthetic
from fedpers.experiments.altmin import (
    AltMinConfig,
    load_units,
    make_protocol,
    unit_source,
)
from fedpers.privacy import Privatizer
from fedpers.runtime.local import UnitSource, run_local
from tests.synthetic_support import forbid_host_generation


def _full_source(cfg: AltMinConfig) -> UnitSource:
    """Every user and both halves in every pass: what a run did before cohort-only generation."""
    return UnitSource(
        cfg.n_users,
        lambda a, b: {k: v for k, v in load_units(cfg, torch.arange(a, b)).items() if k in ("ids", "x", "y")},
    )


def _stats(proto, source: UnitSource, chunk: int) -> tuple[dict, list]:
    stats: list = []
    original = proto.server_update

    def record(round, state, summed, privatizer):  # the summed statistics each round releases
        stats.append({k: v.clone() for k, v in summed.stats.items()} | {"count": summed.count})
        return original(round, state, summed, privatizer)

    object.__setattr__(proto, "server_update", record)
    state, _ = run_local(proto, source, Privatizer(5), chunk_size=chunk, progress=False)
    return state, stats


@pytest.mark.parametrize(  # poisson and all: 20-50 s on a busy machine; disjoint keeps the default suite covered
    "cohorts",
    ["disjoint", pytest.param("poisson", marks=pytest.mark.slow), pytest.param("all", marks=pytest.mark.slow)],
)
def test_cohort_only_generation_gives_the_statistics_and_result_of_full_generation(cohorts):
    extra = {"sampling_rate": 0.4} if cohorts == "poisson" else {}
    cfg = config.build(
        AltMinConfig,
        dict(n_users=2600, dim=6, rank=2, samples_per_user=8, rounds=3, cohorts=cohorts, epsilon=8.0, **extra),
    )
    synthetic._BLOCKS.clear()
    synthetic.reset_counts()
    full_state, full = _stats(make_protocol(cfg), _full_source(cfg), 1000)
    full_drawn = synthetic.passes(cfg.n_users)
    for chunk in (1000, 333):
        synthetic._BLOCKS.clear()
        synthetic.reset_counts()
        state, needed = _stats(make_protocol(cfg), unit_source(cfg, ("ids", "x", "y")), chunk)
        for a, b in zip(full, needed):
            assert a["count"] == b["count"]
            for key in a:
                if key != "count":
                    torch.testing.assert_close(a[key], b[key], rtol=1e-10, atol=1e-9)  # summation order only
        torch.testing.assert_close(state["U"], full_state["U"], rtol=1e-9, atol=1e-9)
        drawn = synthetic.passes(cfg.n_users)
        # float64 blocks are drawn whole, each at most once per pass (init, rounds)
        assert drawn <= 1 + cfg.rounds * 3072 / 2600 and drawn <= full_drawn


def test_a_round_makes_only_the_half_it_reads():
    cfg = config.build(
        AltMinConfig,
        dict(n_users=3000, dim=6, rank=2, samples_per_user=8, rounds=2, dtype="float32", cohort_block=1024),
    )
    proto = make_protocol(cfg)
    source = unit_source(cfg, ("ids", "x", "y"))
    ids, samples = proto.units_needed(1, {})
    assert samples == (0, 4) and set(proto.cohort_of(ids).tolist()) == {1}
    synthetic.reset_counts()
    got = torch.cat([c["ids"] for c in source.needed_chunks(700, ids, samples)])
    assert torch.equal(got, ids.sort().values)
    # float32 draws per (block, half): one half of the blocks holding the cohort (whole blocks
    # but for the one the cut falls in: 2 of 3), nothing else
    assert synthetic.DRAWN["float32"] == 2 * synthetic.BLOCK
    chunk = next(source.needed_chunks(5000, ids, samples))
    whole = load_units(cfg, chunk["ids"])
    # the chunk holds only that half (nothing zero-filled), and says where it starts
    assert chunk["x"].shape[1] == 4 and chunk["y"].shape[1] == 4 and set(chunk["first_sample"].tolist()) == {0}
    assert torch.equal(chunk["x"], whole["x"][:, :4]) and torch.equal(chunk["y"], whole["y"][:, :4])
    evaluation = next(unit_source(cfg, samples=(4, 8)).chunks(5000))
    assert set(evaluation["first_sample"].tolist()) == {4}
    assert torch.equal(evaluation["x"], load_units(cfg, evaluation["ids"])["x"][:, 4:])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_half_drawn_compact_equals_that_half_of_the_whole_users(dtype):
    """Whole blocks of sorted ids are drawn straight into place, others gathered: same values."""
    u = synthetic.subspace(0, 7, 2)
    ids = torch.cat([torch.arange(0, 3000), torch.tensor([5000, 4000, 7])])
    whole = synthetic.altmin_users(9, ids, u, 12, 0.1, dtype)
    for half in (0, 1):
        a, b = synthetic.half_range(12, half)
        for order in (
            torch.arange(ids.numel()),
            torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(half)),
        ):
            part = synthetic.altmin_users(9, ids[order], u, 12, 0.1, dtype, halves=(half,), compact=True)
            assert part["x"].shape == (ids.numel(), 6, 7)
            for key in ("x", "y"):
                assert torch.equal(part[key], whole[key][order, a:b]), (half, key)
            assert torch.equal(part["v_star"], whole["v_star"][order])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pool_generation_equals_single_thread_bit_for_bit(dtype):
    u = synthetic.subspace(0, 12, 3)
    ids = torch.randperm(6000, generator=torch.Generator().manual_seed(2))[:4500]
    threads = torch.get_num_threads()
    pooled = synthetic.altmin_users(3, ids, u, 8, 0.1, dtype, workers=4)
    single = synthetic.altmin_users(3, ids, u, 8, 0.1, dtype, workers=1)
    torch.set_num_threads(1)
    try:
        one_thread = synthetic.altmin_users(3, ids, u, 8, 0.1, dtype)
    finally:
        torch.set_num_threads(threads)
    for key in ("x", "y", "v_star"):
        assert torch.equal(pooled[key], single[key]) and torch.equal(pooled[key], one_thread[key]), key
    assert pooled["x"].dtype == dtype


@pytest.mark.slow
def test_float32_users_are_the_same_for_any_chunking_order_and_halves():
    u = synthetic.subspace(0, 7, 2)
    whole = synthetic.altmin_users(9, torch.arange(3000), u, 12, 0.1, torch.float32)
    order = torch.randperm(3000, generator=torch.Generator().manual_seed(1))
    for chunk in (1, 333, 1024, 2999):
        for start in range(0, 3000, chunk):
            ids = order[start : start + chunk]
            part = synthetic.altmin_users(9, ids, u, 12, 0.1, torch.float32, halves=(1,) if chunk == 333 else (0, 1))
            lo = 6 if chunk == 333 else 0
            assert torch.equal(part["x"][:, lo:], whole["x"][ids, lo:]), chunk
            assert torch.equal(part["y"][:, lo:], whole["y"][ids, lo:]), chunk
            assert torch.equal(part["v_star"], whole["v_star"][ids]), chunk
    # the model holds: y = <U*ᵀx, v*> + σ z in float32, z ~ N(0, 1)
    resid = whole["y"] - ((whole["x"] @ u.float()) @ whole["v_star"].unsqueeze(-1)).squeeze(-1)
    assert abs(float(resid.std()) / 0.1 - 1) < 0.05
    assert abs(float(whole["x"].std()) - 1) < 0.01


def test_float64_users_are_unchanged_by_halves():
    u = synthetic.subspace(0, 7, 2)
    ids = torch.tensor([3, 2000, 1, 1024, 5000])
    whole = synthetic.altmin_users(9, ids, u, 12, 0.1)
    second = synthetic.altmin_users(9, ids, u, 12, 0.1, halves=(1,))
    assert torch.equal(second["x"][:, 6:], whole["x"][:, 6:]) and torch.equal(second["y"][:, 6:], whole["y"][:, 6:])
    assert torch.equal(second["v_star"], whole["v_star"]) and not second["x"][:, :6].any()
    with pytest.raises(ValueError, match="halves"):
        synthetic.altmin_users(9, ids, u, 12, 0.1, halves=(2,))


def test_a_run_counts_its_passes_over_the_users():
    """init (second half of all) + each round its cohort's first half + evaluation (second half)."""
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runner import execute

    exp = EXPERIMENTS["altmin"]
    cfg = config.build(
        exp.config_type,
        dict(
            n_users=8192,
            dim=6,
            rank=2,
            samples_per_user=8,
            rounds=4,
            baselines="none",
            dtype="float32",
            cohort_block=1024,
        ),
    )
    synthetic.reset_counts()
    execute(exp, cfg, write=False, progress=False)
    # float32 draws halves: init ½ + 4 rounds of their own cohort's blocks' first half (⅛ each:
    # cohorts are whole blocks) + evaluation ½: 1.5 passes, the floor's count
    assert synthetic.passes(cfg.n_users) == pytest.approx(0.5 + 4 * 0.5 / 4 + 0.5)


def test_the_device_scheme_never_touches_the_host_generator(monkeypatch):
    """float32 (the scheme a CUDA run uses on its own device) draws every user from generators on
    the tensors' device keyed by (seed, block, part): no float64 host block is ever made."""
    devices = forbid_host_generation(monkeypatch)
    u = synthetic.subspace(0, 8, 2)
    out = synthetic.altmin_users(4, torch.arange(2500), u, 8, 0.1, torch.float32, device="cpu")
    assert out["x"].dtype == torch.float32 and devices and all(d.type == "cpu" for d in devices)
    assert synthetic.uses_parts_scheme(torch.float64, "cuda") and not synthetic.uses_parts_scheme(torch.float64, "cpu")


def test_block_cohorts_are_a_public_partition_of_whole_generation_blocks():
    """Disjoint cohorts of synthetic users: a permutation of runs of 1,024 ids, from the seed alone;
    every cohort is whole blocks but for the block a cut falls in, and sizes are as with users."""
    from fedpers.protocols.altmin import cohort_permutation

    n, rounds = 10_000, 3
    cfg = config.build(
        AltMinConfig, dict(n_users=n, dim=6, rank=2, samples_per_user=8, rounds=rounds, cohort_block=1024)
    )
    proto = make_protocol(cfg)
    perm = proto.permutation()
    assert proto.cohort_block == synthetic.BLOCK and torch.equal(perm.sort().values, torch.arange(n))
    assert torch.equal(perm, cohort_permutation(proto.cohort_seed, n, synthetic.BLOCK))
    cohort = proto.cohort_of(torch.arange(n))
    assert torch.bincount(cohort)[1:].tolist() == [n // rounds + (1 if r < n % rounds else 0) for r in range(rounds)]
    split = [
        b
        for b in range(-(-n // synthetic.BLOCK))
        if cohort[b * synthetic.BLOCK : (b + 1) * synthetic.BLOCK].unique().numel() > 1
    ]
    assert len(split) <= rounds - 1  # only the blocks a cut falls in are shared
    assert not torch.equal(perm, cohort_permutation(proto.cohort_seed + 1, n, synthetic.BLOCK))
    assert torch.equal(cohort_permutation(5, 300, 1), torch.randperm(300, generator=torch.Generator().manual_seed(5)))


def test_a_chunk_of_one_half_refuses_the_other_half():
    from fedpers.protocols.altmin import samples_of

    cfg = config.build(AltMinConfig, dict(n_users=100, dim=6, rank=2, samples_per_user=8, rounds=2))
    chunk = next(unit_source(cfg, samples=(4, 8)).chunks(100))
    x, y = samples_of(chunk, 4, 8)
    assert x.shape == (100, 4, 6) and y.shape == (100, 4)
    with pytest.raises(ValueError, match="not in this chunk"):
        samples_of(chunk, 0, 4)


def test_cohort_blocks_are_whole_generation_blocks_only_for_large_synthetic_populations():
    """auto (0): 1,024 for synthetic users from 65,536 up, single users below and for files;
    an explicit value is kept; the choice is a function of public config alone."""
    from fedpers.experiments.altmin import BLOCK_COHORTS_FROM, cohort_block

    def block(**kw):
        return cohort_block(config.build(AltMinConfig, kw))

    assert BLOCK_COHORTS_FROM == 64 * synthetic.BLOCK
    assert block(n_users=BLOCK_COHORTS_FROM - 1) == 1 and block(n_users=BLOCK_COHORTS_FROM) == synthetic.BLOCK
    assert block(n_users=80, cohort_block=7) == 7
    with pytest.raises(ValueError, match="cohort_block"):
        config.build(AltMinConfig, dict(cohort_block=-1))


@pytest.mark.parametrize(("m", "d"), [(40, 100), (16, 10), (9, 16), (12, 7), (8, 6)])
def test_a_float64_half_drawn_alone_is_that_half_of_one_whole_draw(m, d):
    """The float64 host scheme skips the Box–Muller transform of the half a pass does not read
    (user by user: randn for the half it reads, rand for the other): the same values and the same
    generator state as one randn of the block, for halves on the transform's 16-value runs
    ((16, 10), (9, 16), (40, 100)) and for shapes where it draws the block whole ((12, 7), (8, 6))."""
    for half in (0, 1):
        whole_g, half_g = synthetic._generator(5, 2, 3), synthetic._generator(5, 2, 3)
        whole = torch.randn(synthetic.BLOCK, m, d, generator=whole_g, dtype=torch.float64)
        drawn = synthetic._draw_x(half_g, m, d, (half,), keep=False)
        a, b = synthetic.half_range(m, half)
        assert torch.equal(drawn[half], whole[:, a:b])
        assert torch.equal(half_g.get_state(), whole_g.get_state())
        assert ("whole" in drawn) == ((m // 2) * d % synthetic.NORMAL_GROUP != 0)
    none_g, whole_g = synthetic._generator(5, 2, 3), synthetic._generator(5, 2, 3)
    torch.randn(synthetic.BLOCK, m, d, generator=whole_g, dtype=torch.float64)
    assert synthetic._draw_x(none_g, m, d, (), keep=False) == {}  # v* alone: the generator still moves past x
    assert torch.equal(none_g.get_state(), whole_g.get_state())


def test_a_pass_stopped_early_leaves_no_draw_running(monkeypatch):
    """A caller that takes one chunk and stops leaves nothing drawing in the background: the pass
    counts and the block cache stay as it left them (the next chunk's draw is slowed down so that
    it would still be running)."""
    from fedpers.experiments import altmin

    take = altmin.AltMinSource.take

    def slow(self, *args, **kwargs):
        time.sleep(0.3)
        return take(self, *args, **kwargs)

    monkeypatch.setattr(altmin.AltMinSource, "take", slow)
    cfg = config.build(AltMinConfig, dict(n_users=5000, dim=6, rank=2, samples_per_user=8, dtype="float64"))
    chunks = unit_source(cfg, samples=(4, 8)).chunks(1500)
    synthetic.reset_counts()
    next(chunks)
    chunks.close()
    drawn = dict(synthetic.DRAWN)
    time.sleep(0.6)
    assert dict(synthetic.DRAWN) == drawn
