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

NODE_SIDE: dict[str, dict[str, Any]] = {
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
    # round 0 (private centre, head items) and two ALS rounds with user offsets: every branch of its inputs
    "dpals": {"n_users": 300, "n_items": 30, "rank": 3, "true_rank": 3, "steps": 2, "head_items": 20},
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


def _broadcasts(p: Any) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """(round, broadcast) of the protocol's first and a later round, the later one from a public U."""
    if p.experiment.name == "dpals":
        head = torch.ones(p.cfg.n_items, dtype=torch.float64)
        head[::3] = 0.0
        U = p.protocol.initial_U.to(torch.float64)
        return [(0, {}), (1, {"U": U, "mu": torch.tensor(0.25, dtype=torch.float64), "head": head})]
    if hasattr(p.cfg, "rank"):
        U = torch.linalg.qr(torch.randn(p.cfg.dim, p.cfg.rank, dtype=torch.float64))[0]
        return [(0, {}), (1, {"U": U})]
    state = p.protocol.server_start(p.protocol.initial_state(), p.privatizer)
    return [(r, p.protocol.broadcast(state, r)) for r in (0, 1)]


@pytest.mark.parametrize("name", sorted(NODE_SIDE))
def test_every_node_side_algorithm_provides_the_batched_path(name):
    """The bit-for-bit test above is only worth something if the batched path is taken: each algorithm's
    ``unit_statistics`` answers for its first and a later round, and leaves none of these (ordinary) units
    to be computed alone."""
    p = _plan(name, "distributed")
    units = p.experiment.units(p.cfg, torch.arange(64))
    for round, broadcast in _broadcasts(p):
        got = p.protocol.unit_statistics(round, broadcast, units)
        assert got is not None, (name, round)
        assert got.alone is None or got.alone.numel() == 0, (name, round)
        assert got.ids.numel() > 0 or round > 0, name  # (a later round's cohort may hold none of these units)


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


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_noisygd_examples_on_every_numeric_branch_are_computed_batched_as_alone(dtype):
    """A saturated softmax leaves residuals below 2⁻⁴⁰ (most examples late in training): each example
    takes directions()' exact branch alone, so a batch of them must too. The examples are computed in
    groups by branch, none left to be computed one at a time, each bit for bit as alone — huge, zero,
    tiny and non-finite features included."""
    p = _plan("noisygd", "distributed", {"dtype": dtype})
    units = {k: v.clone() for k, v in p.experiment.units(p.cfg, torch.arange(48)).items()}
    units["x"][3] *= 1e30  # features not trusted as computed
    units["x"][5] *= 1e-30
    units["x"][7] = 0.0
    units["x"][11, 1] = math.nan  # not finite: zeroed and counted
    units["x"][13, 2] = math.inf
    state = p.protocol.server_start(p.protocol.initial_state(), p.privatizer)
    broadcast = dict(p.protocol.broadcast(state, 0))
    W = torch.eye(*broadcast["W"].shape, dtype=broadcast["W"].dtype)  # logit c is feature c
    broadcast["W"] = W
    margins = torch.linspace(1.0, 60.0, 32, dtype=units["x"].dtype)  # the true class ahead by up to 60
    units["x"][16:] = 0.0
    units["x"][torch.arange(16, 48), units["y"][16:]] = margins  # residuals from O(1) down to e⁻⁶⁰
    got = p.protocol.unit_statistics(0, broadcast, units)
    assert got is not None and (got.alone is None or got.alone.numel() == 0)
    batched, zb = unit_contributions(p.protocol, 0, broadcast, units, batched=True)
    alone, za = unit_contributions(p.protocol, 0, broadcast, units, batched=False)
    assert torch.equal(batched.ids, alone.ids) and zb == za >= 2
    assert torch.equal(batched.stats["grad"], alone.stats["grad"])
    x = units["x"].to(W.dtype)
    r = torch.softmax(x @ W.T, -1) - torch.nn.functional.one_hot(units["y"], W.shape[0]).to(W.dtype)
    tiny = torch.linalg.vector_norm(r, dim=-1)
    assert bool(((tiny > 0) & (tiny < 2.0**-40)).any())  # the exact branch is really exercised


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


def _adversarial_dpals(p: Any) -> dict[str, torch.Tensor]:
    units = {k: v.clone() for k, v in p.experiment.units(p.cfg, torch.arange(48)).items()}
    units["ratings"][3] *= 1e200  # norms not trusted as computed: the exact branch, alone
    units["ratings"][5] *= 1e-300
    units["ratings"][7] = 0.0
    units["mask"][9] = False  # no ratings: a zero contribution
    units["ratings"][11, 1] = math.nan  # not finite: zeroed and counted (where it is selected)
    units["ratings"][13, 0] = math.inf
    units["items"][17, 1] = units["items"][17, 0]  # an item twice: its CSR sum's own order, alone
    return units


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "values",
    [
        {"rank": 3, "user_bias": 0.0, "private_center": False},
        {"rank": 4, "head_items": 20},
        {"rank": 9, "private_center": False},
        {"rank": 10},
    ],
    ids=["k3-plain", "k4-head", "k9-solved-alone", "k10-solved-alone"],
)
def test_dpals_users_equal_their_own_client_update_bit_for_bit(values, dtype):
    """Every user's batched (s, c) and (G, b) rows equal ``client_update`` on that user alone, at ranks whose
    k×k solves run batched (k ≤ 8, or every block on a 64-byte boundary) and one at a time (k = 9, 10), with
    users that take another branch alone, are not finite, or select an item twice."""
    p = _plan("dpals", "distributed", {**values, "true_rank": 3, "dtype": dtype})
    units = _adversarial_dpals(p)
    dt = getattr(torch, dtype)
    U = torch.randn(p.cfg.n_items, p.cfg.rank, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    head = torch.ones(p.cfg.n_items, dtype=torch.float64)
    head[::4] = 0.0
    later = {"U": U.to(dt)}
    if p.protocol.prelude:
        later.update(mu=torch.tensor(0.25, dtype=dt), head=head)
    for round in range(p.protocol.num_rounds):
        broadcast = {} if p.protocol.is_prelude(round) else later
        taken = p.protocol.unit_statistics(round, broadcast, units)
        assert taken is not None and taken.ids.numel() >= 42  # the others (the ones above) alone
        batched, zb = unit_contributions(p.protocol, round, broadcast, units, batched=True)
        alone, za = unit_contributions(p.protocol, round, broadcast, units, batched=False)
        assert torch.equal(batched.ids, alone.ids) and batched.ids.numel() == 48
        assert zb == za >= 1
        for name, value in alone.stats.items():
            assert torch.equal(batched.stats[name], value), (round, name)
            assert bool(torch.isfinite(value).all())


def test_dpals_worst_case_neighbours_reach_the_recorded_integer_sensitivity_through_the_batched_path():
    """DPALS's pairs through the nodes' batched encoding and the modular sum: each release's integer sum moves
    by ≤ its recorded Δ₂ and Δ₁, and by what the central sum reaches of it. User j's first B ratings (the
    selected ones) sit on items whose rows of U are 0 and its next B on items along e₁, so v̂ = e₁ is set by the
    unselected ratings alone. Negating the selected ratings flips round 0's item sums s and a round's b (≥ 0.99
    of Δ₂ = 2c̃); the counts c and G cannot be negated (indicators; v̂v̂ᵀ triangles have non-negative inner
    products): moving the selected items elsewhere (c) or the unselected ones onto e₂'s items (v̂ = e₂, G)
    reaches ≥ 0.99 of the 1/2 and 1/√2 of Δ₂ they can."""
    from fedpers.data.units import UnitSource
    from fedpers.runtime.distributed import node_round

    B = 5
    values = {"n_users": 24, "n_items": 4 * B, "rank": 2, "true_rank": 2, "items_per_user": B, "max_count": 12}
    p = _plan("dpals", "distributed", {**values, "steps": 1, "user_bias": 0.0}, bits=24)
    units = {k: v.clone() for k, v in p.experiment.units(p.cfg, torch.arange(24)).items()}
    j = 9
    units["items"][j] = torch.arange(12)
    units["mask"][j] = False
    units["mask"][j, : 2 * B] = True
    units["test"][j] = False
    units["ratings"][j] = 0.0
    units["ratings"][j, : 2 * B] = 1e6
    U = torch.zeros(4 * B, 2, dtype=torch.float64)
    U[B : 2 * B, 0] = 1.0
    U[2 * B : 3 * B, 1] = 1.0
    later = {"U": U, "mu": torch.tensor(0.0, dtype=torch.float64), "head": torch.ones(4 * B, dtype=torch.float64)}
    slots = torch.arange(12)
    flipped = {"ratings": torch.where(slots < B, -1.0, 1.0).double() * units["ratings"][j]}
    pairs = {
        0: {"flipped": flipped, "moved": {"items": torch.where(slots < B, slots + 3 * B, slots)}},
        1: {"flipped": flipped, "turned": {"items": torch.where((slots >= B) & (slots < 2 * B), slots + B, slots)}},
    }
    reach: dict[tuple[int, str, str], float] = {}
    for round, broadcast in ((0, {}), (1, later)):
        taken = p.protocol.unit_statistics(round, broadcast, {k: v[j : j + 1] for k, v in units.items()})
        assert taken is not None and taken.ids.tolist() == [j]  # the batched path, not alone
        base = node_round(p.protocol, round, broadcast, UnitSource.of(units), p.privatizer).modular
        for label, new in pairs[round].items():
            data = {k: v.clone() for k, v in units.items()}
            for k, v in new.items():
                data[k][j] = v
            after = node_round(p.protocol, round, broadcast, UnitSource.of(data), p.privatizer).modular
            for name, before in base.items():
                enc = p.privatizer.plan.encodings[name]
                diff = dist.centered(after[name] - before, enc.bits).double()
                l2, l1 = float(torch.linalg.vector_norm(diff)), float(diff.abs().sum())
                assert l2 <= enc.l2_sensitivity and l1 <= enc.l1_sensitivity, (round, label, name, l2)
                reach[(round, label, name)] = l2 / enc.l2_sensitivity
    assert reach[(0, "flipped", "s")] >= 0.99 and reach[(1, "flipped", "b")] >= 0.99, reach
    assert reach[(0, "moved", "c")] >= 0.99 / 2 and reach[(1, "turned", "G")] >= 0.99 / math.sqrt(2), reach


def test_a_node_holds_at_most_its_byte_budget_of_dense_rows_and_the_sum_is_unchanged(monkeypatch):
    """A DPALS user's encoded vector is items × (k(k+1)/2 + k) coordinates: a node encodes at most
    NODE_CHUNK_BYTES of such rows at once (here 10 users' rows of an ALS round) and, its integer sums being
    exact, ends the run with the same state as in chunks of 64."""
    from fedpers.runtime import distributed

    p = _plan("dpals", "distributed")
    reference, _ = run_local_nodes(
        p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, chunk_size=64, progress=False
    )
    encodings = p.privatizer.plan.encodings
    budget = 8 * sum(encodings[s.name].padded for s in p.protocol.stat_specs(1)) * 10
    monkeypatch.setattr(distributed, "NODE_CHUNK_BYTES", budget)
    held: list[tuple[int, int]] = []  # (units, bytes of their rows) per batch
    rows = distributed.unit_rows

    def recorded(*a: Any, **k: Any) -> Any:
        units = int(a[3]["ids"].shape[0])
        held.append((units, 8 * units * sum(encodings[s.name].padded for s in a[5])))
        return rows(*a, **k)

    monkeypatch.setattr(distributed, "unit_rows", recorded)
    p = _plan("dpals", "distributed")
    state, _ = run_local_nodes(p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, chunk_size=64, progress=False)
    assert max(b for _, b in held) == budget  # reached (10 users of an ALS round), never passed
    assert _equal(state, reference)


@pytest.mark.parametrize("model", ["distributed", "local"])
def test_a_node_encodes_in_blocks_without_changing_a_bit(model, monkeypatch):
    """A node rotates and rounds (distributed) or noises (local) its units a block at a time; each unit draws
    from its own key, so a chunk's encoded sum is the same bits in blocks of 7 as in one block."""
    from fedpers.runtime import distributed

    p = _plan("dpals", model)
    specs = p.protocol.stat_specs(1)
    ids = torch.arange(50, 150)
    g = torch.Generator().manual_seed(2)
    rows = {
        s.name: torch.randn(100, dist.flat_dim(s.shape, s.symmetric), dtype=torch.float64, generator=g) for s in specs
    }
    whole = distributed.encode_rows(rows, ids, specs, p.privatizer, 1)
    monkeypatch.setattr(dist, "UNIT_BLOCK", 7)
    blocked = distributed.encode_rows(rows, ids, specs, p.privatizer, 1)
    assert _equal(blocked, whole) and len(whole) == 2
