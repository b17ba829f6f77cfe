"""A dishonest server's broadcasts, schedules and jobs against the nodes of a distributed or local DP run.

Under distributed and local DP a node derives each round's broadcast from the releases its task carries
(:func:`fedpers.runtime.flower.nodeside.derive_broadcast`), but those releases are the server's word: a
server can make the node's state any value ``server_update`` reaches from sums of its choosing (a U of
its choosing, or nan, 1e300, zero). So each node-side algorithm is attacked here with broadcasts the
protocol would never produce, and with the worst-case units of :func:`tests.neighbours.adversaries`:
whatever the broadcast, each unit moves its node's vector by at most what the plan records (its
distance from absent: c̃, B under local DP; between two units: Δ₂), and a node's round completes for
every data set (a failure decided by one unit's data would tell the server about that unit). Then the
schedule (a round asked again, before and after others) and the job's own noise calibration.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict

from fedpers.app import build_node, make_client_app
from fedpers.privacy import distributed as dist
from fedpers.privacy.accountant import Calibrations, meets_target
from fedpers.runtime.distributed import encode_node
from fedpers.runtime.flower import codec, nodeside
from fedpers.runtime.flower.nodeplan import NODE_STORE_ENV, NodeLedger
from tests.neighbours import adversaries
from tests.test_dishonest_server import POLICY_ENV, SMALL, RecordingGrid, first_task, on_flower, plan, policy_text, send
from tests.test_node_batched import NODE_SIDE, _broadcasts, _plan

NODE_UNITS = 24


FAST = ("nan", "huge", "random")
"""The hostile kinds the default suite plays (each of the findings below fails on one of them); the slow
suite plays them all."""


def hostile(
    broadcast: dict[str, torch.Tensor], kinds: tuple[str, ...] | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """Broadcasts no honest release leads to: each floating entry nan, ±inf, zero, huge, tiny, a random
    matrix (not orthonormal, not projected), one entry nan (``kinds``: only those; None: all)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in broadcast.items():
        if not value.is_floating_point():
            continue
        noise = torch.randn(value.shape, dtype=value.dtype, generator=torch.Generator().manual_seed(5))
        huge = 1e30 if value.dtype == torch.float32 else 1e300
        one_nan = value.clone().contiguous()
        one_nan.view(-1)[:1] = math.nan
        for what, new in {
            "nan": torch.full_like(value, math.nan),
            "inf": torch.full_like(value, math.inf),
            "-inf": torch.full_like(value, -math.inf),
            "zero": torch.zeros_like(value),
            "huge": noise * huge,
            "tiny": noise * 1e-300,
            "random": noise * 1e3,
            "one nan": one_nan,
        }.items():
            if kinds is None or what in kinds:
                out[f"{key} {what}"] = {**broadcast, key: new}
    return out


def replacements(units: dict[str, torch.Tensor], j: int) -> dict[str, dict[str, torch.Tensor]]:
    """Unit j's worst-case replacements: :func:`tests.neighbours.adversaries` for (x, y) units; for rating
    units (DPALS) huge, overflowing, alternating and zero ratings and an item selected twice."""
    if "x" in units:
        x, y = units["x"][j], units["y"][j]
        out = adversaries(x, y if y.is_floating_point() else None, x.dtype)
    else:
        r = units["ratings"][j]
        sign = torch.ones_like(r)
        sign[1::2] = -1
        repeated = units["items"][j].clone()
        first, second = units["mask"][j].nonzero().squeeze(1)[:2].tolist()  # two rated training entries
        repeated[first] = repeated[second] = 1  # one item (a head item of the honest broadcast), twice
        pair = torch.zeros_like(r)
        pair[[first, second]] = 1e6  # its two products add in one row: √2 of one
        out = {
            "huge ratings": {"ratings": r * 1e300},
            "overflowing ratings": {"ratings": r.double() * 1e308 * 10},
            "alternating ratings": {"ratings": 1e300 * sign},
            "zero ratings": {"ratings": torch.zeros_like(r)},
            "an item twice, its ratings large": {"items": repeated, "ratings": pair},
        }
    key = "x" if "x" in units else "ratings"
    out["absent"] = {key: torch.full_like(units[key][j], math.nan)}  # not finite: zeroed, contributes nothing
    return out


def replaced(units: dict[str, torch.Tensor], j: int, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in units.items()}
    for k, v in new.items():
        out[k][j] = v.to(out[k].dtype)
    return out


@pytest.mark.parametrize("kinds", [FAST, pytest.param(None, marks=pytest.mark.slow)], ids=["fast", "all"])
@pytest.mark.parametrize("model", ["distributed", "local"])
@pytest.mark.parametrize("name", sorted(NODE_SIDE))
def test_no_broadcast_moves_a_node_by_more_than_one_unit_s_recorded_sensitivity(
    name: str, model: str, kinds: tuple[str, ...] | None
) -> None:
    """For every node-side algorithm, round and hostile broadcast: the node's round completes for its data
    and for each worst-case replacement of one of its units, and the unit moves the node's vector (same
    noise keys) by at most c̃ from its absence (its contribution zeroed: nan data) and by at most the
    recorded Δ₂ between any two replacements. Before the nodes re-clipped under local DP, a NoisyGD unit
    moved it by 1.00000005·B (float32's clip) and a DPALS user with an item twice by √2·B; before DPALS's
    batch kept its shape, a node whose every user took the one-by-one branch (a nan U) raised."""
    p = _plan(name, model)
    units = p.experiment.units(p.cfg, torch.arange(NODE_UNITS))
    rounds = _broadcasts(p) + ([] if name == "dpals" else [(2, _broadcasts(p)[1][1])])
    privatizer: dist.NodeSidePrivatizer = p.privatizer
    checked = 0
    for round, honest in rounds:
        needed, _ = p.protocol.units_needed(round, honest)
        members = torch.arange(NODE_UNITS)
        if needed is not None:
            members = members[torch.isin(members, needed)]
        taking_part = [
            int(i) for i in members if p.protocol.units_in_round(round, {k: v[i : i + 1] for k, v in units.items()})
        ]
        if not taking_part:
            continue
        j = taking_part[0]
        specs = p.protocol.stat_specs(round)
        for label, broadcast in hostile(honest, kinds).items():
            vectors = {
                what: encode_node(p.protocol, round, broadcast, [replaced(units, j, new)], members, privatizer, 0).stats
                for what, new in {"as is": {}, **replacements(units, j)}.items()
            }  # raises, failing the test, if a data set makes the round fail
            for s in specs:
                enc = privatizer.plan.encodings[s.name]
                absent = vectors["absent"][s.name].double()
                for what, got in vectors.items():
                    moved = float(torch.linalg.vector_norm(got[s.name].double() - absent))
                    assert moved <= enc.rounded_bound * (1 + 1e-9), (
                        label,
                        round,
                        s.name,
                        what,
                        moved,
                        enc.rounded_bound,
                    )
                stacked = torch.stack([v[s.name].double() for v in vectors.values()])
                widest = float(torch.cdist(stacked, stacked).max())
                assert widest <= enc.l2_sensitivity * (1 + 1e-9), (label, round, s.name, widest, enc.l2_sensitivity)
            checked += 1
    assert checked >= (8 if kinds is None else 3)


def test_a_dpals_node_whose_every_user_takes_the_one_by_one_branch_completes() -> None:
    """One DPALS user on its node (one user per node), an item selected twice (the loaders drop such repeats;
    a unit may still carry one): it is computed alone and the node's round completes, as for a neighbour
    without the repeat (before, the batch of no users failed to take its shape and the node raised)."""
    p = _plan("dpals", "local")
    units = {k: v[:1].clone() for k, v in p.experiment.units(p.cfg, torch.arange(1)).items()}
    _, broadcast = _broadcasts(p)[1]
    plain = encode_node(p.protocol, 1, broadcast, [units], torch.arange(1), p.privatizer, 0)
    first, second = units["mask"][0].nonzero().squeeze(1)[:2].tolist()  # two rated training entries
    units["items"][0, second] = units["items"][0, first]
    twice = encode_node(p.protocol, 1, broadcast, [units], torch.arange(1), p.privatizer, 0)
    assert plain.count == twice.count == 1


# ----- the schedule: a round asked again ----------------------------------------------------------
@pytest.mark.parametrize("model", ["local", "distributed"])
def test_without_a_store_a_node_computes_each_round_once(model: str) -> None:
    """No lab policy (no node store): after an honest run, the server asks node 0 round 0 again with the
    very task it sent, and the run's last round again. Before, a local-DP node answered each with fresh
    noise on the same statistic (two releases of one round, charged once); now each is refused (rule
    ``plan-once``) before anything is computed. Under distributed DP SecAgg+'s order refused it already."""
    p = plan(3, dp_model=model, bits=0) if model == "local" else plan(3, min_nodes=2)
    grid = RecordingGrid(make_client_app(), 3)
    on_flower(p, grid)
    context = grid.context(0)  # the run's own Context of node 0
    for round in (0, 1):
        assert send(grid, 0, first_task(grid, 0, round).content, context) == "plan-once"


def test_without_a_store_a_node_computes_no_round_past_the_plan() -> None:
    """No lab policy, local DP, every user in every round (rounds 0..1): after the honest run the server asks
    node 0 round 2, carrying a release of round 1 of its choosing (the node derives round 2's U from it).
    Before, the node answered it: its 40 users' statistics once more, a release past the plan that no ledger
    charges; now it is refused (rule ``plan-round``) before anything is derived or computed."""
    p = plan(3, cfg={**SMALL, "cohorts": "all"}, dp_model="local", bits=0)
    grid = RecordingGrid(make_client_app(), 3)
    on_flower(p, grid)
    context = grid.context(0)
    task = codec.decode_task(first_task(grid, 0, 1).content)
    side = build_node(task.job).node_side(task.job.trust)
    stats = {
        s.name: torch.eye(s.shape[0], dtype=torch.float64) if s.symmetric else torch.ones(s.shape, dtype=torch.float64)
        for s in side.server_protocol.stat_specs(1)
    }
    extra = dict(nodeside.task_record(p.privatizer, 0, None, nodeside.Released(1, stats, 120, 3)))
    content = codec.encode_task(task.job, 2, range(task.start, task.stop), codec.broadcast_record({}))
    for key, value in extra.items():
        content[key] = value
    trial = Context(
        run_id=context.run_id,
        node_id=context.node_id,
        node_config=context.node_config,
        state=copy.deepcopy(context.state),
        run_config={},
    )
    derived = nodeside.derive_broadcast(trial, task.job, side, 2, content.config_records[nodeside.NODE_SIDE], content)
    content = codec.encode_task(task.job, 2, range(task.start, task.stop), codec.broadcast_record(derived))
    for key, value in extra.items():
        content[key] = value
    assert send(grid, 0, content, context) == "plan-round"


# ----- the job: its noise calibration is the server's word ----------------------------------------
def forged_job(job: codec.Job, factor: float) -> codec.Job:
    """``job`` with every noise multiplier of its calibration table times ``factor`` (and the protocol
    digest the node will compute for it, so the node's digest check passes)."""
    table = {k: v * factor for k, v in json.loads(job.calibrations_json).items()}
    forged = dataclasses.replace(job, calibrations_json=json.dumps(table, sort_keys=True))
    return dataclasses.replace(forged, digest=codec.protocol_digest(build_node(forged).protocol))


def test_a_local_dp_node_refuses_a_calibration_below_the_run_s_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under local DP the nodes add the job's z itself. The server sends node 0 the run's job with its
    calibration table at z/100 (and z·0.999): before, the node answered with 1/100 of the noise while its
    policy charged the config's ε = 2; now it refuses (rule ``plan-noise``) before any computation or charge,
    and the honest job's z is accepted (it meets its target by the node's own accountant)."""
    (tmp_path / "policy.toml").write_text(policy_text("local"))
    monkeypatch.setenv(POLICY_ENV, str(tmp_path / "policy.toml"))
    monkeypatch.setenv(NODE_STORE_ENV, str(tmp_path / "store"))
    store = tmp_path / "store"
    p = plan(3, dp_model="local", bits=0)
    grid = RecordingGrid(make_client_app(), 3)
    on_flower(p, grid)
    honest = first_task(grid).content
    task = codec.decode_task(honest)
    for factor in (0.01, 0.999):
        forged = codec.encode_task(
            forged_job(task.job, factor), 0, range(task.start, task.stop), codec.broadcast_record(task.broadcast)
        )
        forged[nodeside.NODE_SIDE] = honest.config_records[nodeside.NODE_SIDE].copy()
        weaker = dataclasses.replace(p.privatizer.plan, noise_multiplier=p.privatizer.plan.noise_multiplier * factor)
        forged[nodeside.NODE_SIDE][nodeside.PLAN] = nodeside.plan_json(weaker)  # the plan the forged job gives
        fresh = Context(
            run_id=9, node_id=grid.node(0), node_config=grid.context(0).node_config, state=RecordDict(), run_config={}
        )
        assert send(grid, 0, forged, fresh) == "plan-noise"
    assert "9/partition-0" not in json.loads((store / "lab-node-ledger.json").read_text())["runs"]
    assert NodeLedger(store, "lab").spent((0, 40))[0] == 2.0  # the honest run's charge only
    node = build_node(task.job)
    z = node.protocol.noise_multiplier  # type: ignore[attr-defined]
    side = node.node_side(task.job.trust)
    assert side.plan.noise_multiplier == z and z > 0


def test_a_distributed_node_solves_its_noise_whatever_the_calibration_table_says() -> None:
    """Under distributed DP the nodes' Skellam variance is solved by each node's own accountant from the
    job's target; the table's z only seeds the solve. At z/100 and 2z the node's plan has the honest plan's
    noise multiplier (to the solver's precision), which meets the target."""
    p = plan(3, min_nodes=2)
    from fedpers.app import flower_job

    job = flower_job(p.experiment, p.cfg, p.protocol, p.calibrations.table, p.options)
    honest = build_node(job).node_side(job.trust).plan
    for factor in (0.01, 2.0):
        forged = forged_job(job, factor)
        got = build_node(forged).node_side(forged.trust).plan
        assert got.noise_multiplier == pytest.approx(honest.noise_multiplier, rel=1e-6)
        assert got.noise_multiplier >= honest.noise_multiplier * (1 - 1e-12)


def test_meets_target_at_the_calibrated_multiplier_and_not_below() -> None:
    """The node's check: the accountant's calibrated z meets its target; 0.999·z does not."""
    from dp_accounting import GaussianDpEvent

    calibrations = Calibrations()
    z = calibrations(lambda z: GaussianDpEvent(z), 2.0, 1e-5)
    assert meets_target(lambda z: GaussianDpEvent(z), z, 2.0, 1e-5, "pld")
    assert not meets_target(lambda z: GaussianDpEvent(z), z * 0.999, 2.0, 1e-5, "pld")
