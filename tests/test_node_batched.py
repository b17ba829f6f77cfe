"""The nodes' batched per-unit path (docs/privacy.md, "How a node encodes its units"): each unit's own
contribution computed for a chunk at once (``Protocol.unit_statistics``) equals ``client_update`` on that
unit alone bit for bit, whole runs included, for every algorithm that runs node-side; units whose data
takes another numeric branch alone, or is not finite, are handled as each would be alone; and worst-case
neighbours through the batched path move the integer sum by ≥ 0.99 of the Δ₂ the ledger records."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from fedpers import config
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import distributed as dist
from fedpers.protocols.base import unit_contributions
from fedpers.runner import resolve
from fedpers.runtime.distributed import run_local_nodes

NODE_SIDE = {
    "altmin": {"n_users": 300, "dim": 5, "rank": 2, "samples_per_user": 16, "rounds": 2},
    "noisygd": {"examples": 300, "feature_dim": 12, "classes": 4, "steps": 3, "cohorts": "cyclic", "cycle": 2},
    "noisyhead": {
        "prompts": 240,
        "dim": 3,
        "context": 4,
        "steps": 3,
        "mode": "rounds",
        "unit": "user",
        "prompts_per_user": 2,
        "cohorts": "cyclic",
        "cycle": 2,
    },
    "fedrep": {
        "n_users": 300,
        "dim": 5,
        "rank": 2,
        "samples_per_user": 8,
        "rounds": 3,
        "cohorts": "cyclic",
        "cycle": 2,
    },
}


def _plan(name: str, model: str, values: dict[str, Any] | None = None, **options: Any) -> Any:
    exp = EXPERIMENTS[name]
    cfg = config.build(exp.config_type, {"epsilon": 2.0, **NODE_SIDE[name], **(values or {})})
    return resolve(exp, cfg, config.build(RuntimeOptions, {"nodes": 3, "dp_model": model, **options}))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.mark.parametrize("model", ["distributed", "local"])
@pytest.mark.parametrize("name", sorted(NODE_SIDE))
def test_batched_runs_equal_the_per_unit_path_bit_for_bit(name, model):
    """Fixed seeds, float64: the whole run through the batched path (chunks of 64 units, so a node spans
    several) and through ``client_update`` on each unit alone give the same state, ledger and round
    records, bit for bit."""
    out = {}
    for batched in (True, False):
        p = _plan(name, model)
        state, records = run_local_nodes(
            p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, chunk_size=64, progress=False, batched=batched
        )
        out[batched] = (state, p.privatizer.ledger, [(r.units, r.zeroed, r.diagnostics) for r in records])
    assert out[True][1] == out[False][1] and len(out[True][1]) > 0
    assert _equal(out[True][0], out[False][0])
    assert out[True][2] == out[False][2]


@pytest.mark.parametrize("name", sorted(NODE_SIDE))
def test_every_node_side_algorithm_provides_the_batched_path(name):
    """The bit-for-bit test above is only worth something if the batched path is taken: each algorithm's
    ``unit_statistics`` answers (not None) for its first and a later round."""
    p = _plan(name, "distributed")
    units = p.experiment.units(p.cfg, torch.arange(64))
    U = torch.linalg.qr(torch.randn(p.cfg.dim, p.cfg.rank, dtype=torch.float64))[0] if hasattr(p.cfg, "rank") else None
    state = p.protocol.server_start(p.protocol.initial_state(), p.privatizer) if U is None else {"U": U}
    for round in (0, 1):
        broadcast = p.protocol.broadcast(state, round) if U is None else ({} if round == 0 else {"U": U})
        assert p.protocol.unit_statistics(round, broadcast, units) is not None, (name, round)


def _adversarial_altmin(p: Any) -> dict[str, torch.Tensor]:
    units = {k: v.clone() for k, v in p.experiment.units(p.cfg, torch.arange(40)).items()}
    units["x"][3] *= 1e200  # norms not trusted as computed: the exact branch, alone
    units["y"][5] *= 1e-300
    units["x"][7] = 0.0
    units["x"][11, 1] = math.nan  # not finite: zeroed and counted
    units["y"][13, 2] = math.inf
    units["x"][17] *= 1e300  # overflows a product: zeroed or the exact branch, as alone
    return units


@pytest.mark.parametrize("round", [0, 1, 2])
def test_units_that_take_another_branch_alone_are_computed_as_alone(round):
    p = _plan("altmin", "distributed")
    units = _adversarial_altmin(p)
    U = torch.linalg.qr(torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))[0]
    broadcast = {} if round == 0 else {"U": U}
    batched, zb = unit_contributions(p.protocol, round, broadcast, units, batched=True)
    alone, za = unit_contributions(p.protocol, round, broadcast, units, batched=False)
    assert torch.equal(batched.ids, alone.ids) and batched.ids.numel() > 0
    assert zb == za and (round == 0 or za >= 1)
    for name, value in alone.stats.items():
        assert torch.equal(batched.stats[name], value), name
        assert bool(torch.isfinite(value).all())


def test_worst_case_neighbours_reach_the_recorded_integer_sensitivity_through_the_batched_path():
    """The pairs that reach central's bounds (tests/test_privacy_e2e.py: A's orthogonal rank-one units, b's
    sign flip, W's label flip) through the nodes' batched encoding and the modular sum: each release's
    integer sum moves by ≤ its recorded Δ₂ and Δ₁ and by ≥ 0.99 of Δ₂ (each unit rounds from its own key
    and the nodes' shares are the same, so the move is that unit's alone)."""
    from fedpers.data.units import UnitSource
    from fedpers.runtime.distributed import node_round
    from tests.test_privacy_e2e import reach_units

    p = _plan("altmin", "distributed", {"n_users": 24, "dim": 4, "cohorts": "all", "rounds": 1}, bits=24)
    units = {k: v.clone() for k, v in p.experiment.units(p.cfg, torch.arange(24)).items()}
    U = torch.linalg.qr(torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))[0]
    j = 9
    reach: dict[str, float] = {}
    for label, (base, new) in {
        "A": (dict(q2_direction=0), dict(q2_direction=1)),
        "b": (dict(q2_direction=0), dict(q2_direction=0, y_sign_q2=-1.0)),
        "W": (dict(q2_direction=0), dict(q2_direction=0, y_sign_init=-1.0)),
    }.items():
        pair = []
        for which in (base, new):
            data = {k: v.clone() for k, v in units.items()}
            for k, v in reach_units(p.protocol, units, U, j, **which).items():
                data[k][j] = v
            round, broadcast = (0, {}) if label == "W" else (1, {"U": U})
            pair.append(node_round(p.protocol, round, broadcast, UnitSource.of(data), p.privatizer).modular[label])
        enc = p.privatizer.plan.encodings[label]
        diff = dist.centered(pair[1] - pair[0], enc.bits).double()
        l2, l1 = float(torch.linalg.vector_norm(diff)), float(diff.abs().sum())
        assert l2 <= enc.l2_sensitivity and l1 <= enc.l1_sensitivity, (label, l2, enc.l2_sensitivity)
        reach[label] = l2 / enc.l2_sensitivity
    assert min(reach.values()) >= 0.99, reach
