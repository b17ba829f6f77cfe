"""The local runtime on a GPU reads its messages' finiteness checks once per round, not per chunk,
and still never sums a non-finite contribution: a round with one is made again under the per-unit rule."""
from __future__ import annotations

import pytest
import torch

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments import altmin as am
from fedpers.privacy import Privatizer
from fedpers.runtime.local import run_local
from tests.fake_cuda import fake_cuda

EXP = EXPERIMENTS["altmin"]
VALUES = dict(n_users=500, dim=4, rank=2, samples_per_user=8, cohorts="all", dtype="float32", calibration="paper")


def _units(bad: bool) -> dict[str, torch.Tensor]:
    cfg = am.resolve(config.build(EXP.config_type, VALUES))
    units = am.load_units(cfg, torch.arange(cfg.n_users))
    units = {k: units[k] for k in ("ids", "x", "y")}
    if bad:
        units["x"][5, 6] = float("nan")  # round 0's half
        units["y"][300, 1] = float("inf")  # the rounds' half
    return units


@pytest.mark.parametrize("bad", [False, True])
def test_deferred_checks_sum_what_the_per_chunk_checks_sum(bad):
    proto = am.make_protocol(am.resolve(config.build(EXP.config_type, VALUES)))
    out = {}
    for defer in (False, True):
        state, records = run_local(proto, _units(bad), Privatizer(3), chunk_size=128, progress=False, defer_checks=defer)
        out[defer] = (state["U"], [(r.units, r.zeroed) for r in records])
    assert torch.equal(out[False][0], out[True][0]) and out[False][1] == out[True][1]
    assert [z for _, z in out[True][1]] == ([1, 1, 1] if bad else [0, 0, 0])


def test_a_cuda_run_reads_its_message_checks_once_a_round():
    """Under the fake device: chunks of 50 or 250 users, the same number of host reads by the
    message checks (the runtime's one per round, 3, and the server's verification of the one summed
    reply), where the per-chunk checks read each chunk's."""
    sites = {}
    for chunk in (250, 50):
        with fake_cuda() as fc:
            cfg = am.resolve(config.build(EXP.config_type, {**VALUES, "device": "cuda", "chunk_size": chunk, "baselines": "none"}))
            run_local(am.make_protocol(cfg), EXP.unit_source(cfg), Privatizer(3), chunk_size=chunk, progress=False)
        sites[chunk] = {site: c for (_, site), c in fc.traffic.sites.items() if "base.py" in site or "local.py" in site}
    assert sites[250] == sites[50], sites
    assert sum(c for site, c in sites[50].items() if "local.py" in site) == 3
