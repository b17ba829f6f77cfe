"""A million users: synthetic users are generated per chunk from (seed, id), never all at once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fedpers import config
from fedpers.data import synthetic
from fedpers.experiments.altmin import AltMinConfig, AltMinExperiment, load_units, unit_source


def test_users_generated_in_any_order_and_chunking_equal_the_whole_population():
    u = synthetic.subspace(0, 6, 2)
    whole = synthetic.altmin_users(7, torch.arange(3000), u, 8, 0.1)
    order = torch.randperm(3000, generator=torch.Generator().manual_seed(1))
    for chunk in (1, 333, 1024, 2999):
        for start in range(0, 3000, chunk):
            ids = order[start : start + chunk]
            part = synthetic.altmin_users(7, ids, u, 8, 0.1)
            for key in ("x", "y", "v_star"):
                assert torch.equal(part[key], whole[key][ids]), (chunk, key)


def test_the_unit_source_streams_the_same_users_as_direct_loading():
    cfg = config.build(AltMinConfig, dict(n_users=1000, dim=5, rank=2, samples_per_user=8))
    source = AltMinExperiment().unit_source(cfg)
    streamed = torch.cat([c["x"] for c in source.chunks(97)])
    assert torch.equal(streamed, load_units(cfg, torch.arange(1000))["x"])
    assert set(next(unit_source(cfg).chunks(10))) >= {"ids", "x", "y", "v_star"}


PEAK = """
import json, sys
from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.runner import execute
exp = EXPERIMENTS["altmin"]
cfg = config.build(exp.config_type, dict(n_users=int(sys.argv[1]), dim=20, rank=2, samples_per_user=40, chunk_size=2048))
result = execute(exp, cfg, write=False, progress=False)
hwm = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024  # ru_maxrss would start at the parent's RSS
print(json.dumps({"peak": hwm, "error": result["subspace_error"], "baselines": sorted(result["baselines"]),
                  "baselines_error": result.get("baselines_error", "")}))
"""


def peak_bytes(n: int) -> dict:
    out = subprocess.run([sys.executable, "-c", PEAK, str(n)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_number_of_users():
    """n and 4n users (d = 20, m = 40), every baseline (clipped-no-noise in the private run's passes,
    the non-private AltMin's rounds, the evaluation): materialised, the extra 3n users' samples alone
    are 0.5 GB."""
    small, large = peak_bytes(25_000), peak_bytes(100_000)
    for run in (small, large):
        assert len(run["baselines"]) == 5 and not run["baselines_error"], run
    extra_data = 75_000 * 40 * 21 * 8
    assert large["peak"] - small["peak"] < 0.25 * extra_data, (small, large)
    assert large["error"] < small["error"]  # more users, a better subspace: the run did its work


def test_chunk_size_auto_is_decided_from_memory_and_said():
    cfg = config.build(AltMinConfig, dict(n_users=300_000, dim=50, rank=2, samples_per_user=40, chunk_size="auto"))
    exp = AltMinExperiment()
    chosen = exp.chunk_size(cfg)
    assert cfg.chunk_size == 0 and 64 <= chosen <= 65536
    assert exp.chunk_size(cfg) == chosen  # decided once: every pass of a run chunks alike
    assert f"{chosen} users per chunk" in exp.plan(cfg)[0]
    with pytest.raises(ValueError, match="chunk_size must be of type int"):
        config.build(AltMinConfig, dict(chunk_size="big"))


def test_users_asked_for_in_part_come_from_a_kept_block_with_the_same_values() -> None:
    """A Flower node of one user slices a kept block instead of generating 1,024 users again;
    the values equal the whole-block generation, and what is kept stays bounded."""
    from fedpers.data import synthetic

    synthetic._BLOCKS.clear()
    u = synthetic.subspace(3, 6, 2)
    whole = synthetic.altmin_users(3, torch.arange(0, 2 * synthetic.BLOCK), u, 8, 0.1)
    assert not synthetic._BLOCKS  # whole blocks (the local runtime's chunks) are not kept
    for i in (5, 7, synthetic.BLOCK + 3, 5):
        one = synthetic.altmin_users(3, torch.tensor([i]), u, 8, 0.1)
        for key in ("x", "y", "v_star"):
            assert torch.equal(one[key][0], whole[key][i])
    assert len(synthetic._BLOCKS) == 2
    before = synthetic.BLOCK_CACHE_BYTES
    try:
        synthetic.BLOCK_CACHE_BYTES = synthetic.BLOCK * 8 * 6 * 8 + 1  # room for one block's x
        synthetic._BLOCKS.clear()
        for blk in range(3):
            synthetic.altmin_users(3, torch.tensor([blk * synthetic.BLOCK]), u, 8, 0.1)
        assert len(synthetic._BLOCKS) <= 1
    finally:
        synthetic.BLOCK_CACHE_BYTES = before
        synthetic._BLOCKS.clear()


def _peak_rss_mib(data: str, out: str) -> float:
    code = (
        "import sys; from fedpers.commands.cli import main; "
        f"main(['run', 'altmin', '--data', {data!r}, '--rank', '2', '--rounds', '1', '--chunk-size', '512', '--baselines', 'none', '--quiet', '--json', '--out', {out!r}]); "
        # VmHWM, not ru_maxrss: after fork+exec ru_maxrss starts at the parent's (this test's) RSS
        "print(int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) / 1024, file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(proc.stderr.strip().splitlines()[-1])


@pytest.mark.slow  # > 10 s with its fixture; in CI's slow run
def test_file_data_is_read_per_chunk_so_memory_does_not_grow_with_the_file(tmp_path) -> None:
    """A run over a 4× larger file (96 MiB more of x) peaks at nearly the same memory."""
    import numpy as np

    from fedpers.data.files import save_altmin_npz
    from fedpers.data.synthetic import altmin_users, subspace

    u = subspace(0, 40, 2)
    peaks = {}
    for n in (10_000, 40_000):
        g = np.random.default_rng(n)
        users = altmin_users(0, torch.arange(n), u, 8, 0.1)
        path = tmp_path / f"d{n}.npz"
        save_altmin_npz(path, x=users["x"].numpy(), y=users["y"].numpy(), u_star=np.ascontiguousarray(u.numpy()))
        del users, g
        peaks[n] = _peak_rss_mib(str(path), str(tmp_path / f"run{n}"))
    grown = peaks[40_000] - peaks[10_000]
    assert grown < 40, f"peak RSS grew by {grown:.0f} MiB for 3× more users (x alone is 73 MiB more): {peaks}"
