"""The Flower runtime on an in-process Grid: discovery, gather, verification, faults (no Ray)."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from fedpers import config as config_lib
from fedpers.app import build_node, make_client_app, run_flower
from fedpers.data.files import save_altmin_npz
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import Privatizer
from fedpers.results.rundir import read_run
from fedpers.runner import Runtime, RuntimeOptions, execute, split_seed
from fedpers.runtime.driver import RoundFailed
from fedpers.runtime.flower import codec
from fedpers.runtime.flower.partition import unit_ranges
from fedpers.runtime.local import run_local
from tests.flower_support import InProcessGrid, faulty_client_app

EXP = EXPERIMENTS["altmin"]
SMALL = dict(n_users=80, dim=5, rank=2, samples_per_user=8, rounds=2, epsilon=4.0, seed=3)


def setup(**overrides):
    """(public config, protocol, noise seed); calibration is cached, it dominates these tests."""
    return _setup(tuple(sorted(overrides.items())))


@functools.cache
def _setup(overrides):
    cfg, noise_seed = split_seed(config_lib.build(EXP.config_type, {**SMALL, **dict(overrides)}))
    return cfg, EXP.protocol(cfg), noise_seed


def options(**kw) -> RuntimeOptions:
    return config_lib.build(RuntimeOptions, {"runtime": "flower", **kw})


def local_run(cfg, protocol, noise_seed, keep=None):
    units = EXP.units(cfg, torch.arange(EXP.num_units(cfg)))
    if keep is not None:
        units = {k: v[keep] for k, v in units.items()}
    privatizer = Privatizer(noise_seed)
    state, records = run_local(protocol, units, privatizer, progress=False)
    return state, records, privatizer.ledger


def flower_run(grid, cfg, protocol, noise_seed, **opts):
    privatizer = Privatizer(noise_seed)
    state, records = run_flower(EXP, cfg, protocol, privatizer, options(**opts), grid=grid, progress=False)
    return state, records, privatizer.ledger


def test_grid_run_equals_local_runtime():
    cfg, protocol, seed = setup()
    u_local, _, ledger_local = local_run(cfg, protocol, seed)
    state, records, ledger = flower_run(InProcessGrid(make_client_app(), 5), cfg, protocol, seed)
    torch.testing.assert_close(state["U"], u_local["U"], rtol=0, atol=1e-10)
    assert ledger == ledger_local
    assert [r.accepted for r in records] == [5] * protocol.num_rounds and not any(r.dropped for r in records)


def test_faulty_clients_are_dropped_reported_and_spend_no_extra_privacy():
    cfg, protocol, seed = setup()
    faults = {1: "raise", 2: "nan", 3: "huge", 4: "overclaim"}
    grid = InProcessGrid(faulty_client_app(faults), 8, silent={5})
    state, records, ledger = flower_run(grid, cfg, protocol, seed, min_fraction=0.3, round_timeout=0.5)
    expected = {
        "partition-1": "client error",
        "partition-2": "non-finite",
        "partition-3": "norm",
        "partition-4": "unit count",
        "partition-5": "no reply within",
    }
    for record in records:
        assert set(record.dropped) == set(expected)
        for client, why in expected.items():
            assert why in record.dropped[client], record.dropped[client]
        assert record.accepted == 3
    _, _, clean_ledger = local_run(cfg, protocol, seed)
    assert ledger == clean_ledger
    ranges = unit_ranges(EXP.num_units(cfg), 8)
    honest = torch.cat([torch.arange(ranges[p].start, ranges[p].stop) for p in (0, 6, 7)])
    u_honest, _, _ = local_run(cfg, protocol, seed, keep=honest)
    torch.testing.assert_close(state["U"], u_honest["U"], rtol=0, atol=1e-10)


def test_too_few_replies_stop_the_run_and_keep_the_rounds_so_far(tmp_path):
    cfg = config_lib.build(EXP.config_type, SMALL)
    grid = InProcessGrid(faulty_client_app({0: "raise", 1: "nan"}, from_round=1), 4)
    with pytest.raises(RoundFailed, match="round 1: 2 of 4 clients"):
        execute(EXP, cfg, options(min_fraction=0.75), out=tmp_path / "run", progress=False, grid=grid)
    run = read_run(tmp_path / "run")
    assert run["error"]["rounds_completed"] == 1 and "RoundFailed" in run["error"]["error"]
    assert [r["round"] for r in run["rounds"]] == [0]
    assert [r["name"] for r in json.loads(run["ledger_text"])] == ["init.W"]


def test_a_run_stopped_by_lost_nodes_resumes_when_they_are_back(tmp_path):
    """min_fraction = 1 and two nodes failing in round 1: the run stops with its checkpoint;
    resumed on a healthy grid it ends exactly where an uninterrupted run ends, same ledger."""
    from fedpers.runner import resume_run

    cfg = config_lib.build(EXP.config_type, SMALL)
    with pytest.raises(RoundFailed):
        execute(
            EXP,
            cfg,
            options(),
            out=tmp_path / "run",
            progress=False,
            grid=InProcessGrid(faulty_client_app({0: "raise", 1: "nan"}, from_round=1), 4),
        )
    resumed = resume_run(tmp_path / "run", progress=False, grid=InProcessGrid(make_client_app(), 4))
    clean = execute(
        EXP, cfg, options(), out=tmp_path / "clean", progress=False, grid=InProcessGrid(make_client_app(), 4)
    )
    torch.testing.assert_close(resumed["_state"]["U"], clean["_state"]["U"], rtol=0, atol=0)
    assert (tmp_path / "run" / "ledger.jsonl").read_text() == (tmp_path / "clean" / "ledger.jsonl").read_text()
    assert [r["round"] for r in read_run(tmp_path / "run")["rounds"]] == list(range(cfg.rounds + 1))


def test_clients_never_see_the_noise_seed():
    user_cfg = config_lib.build(EXP.config_type, SMALL)
    cfg, protocol, noise_seed = setup()
    grid = InProcessGrid(make_client_app(), 3)
    flower_run(grid, cfg, protocol, noise_seed)
    sent = [json.loads(m.content[codec.JOB][codec.CONFIG]) for m in grid.sent]
    assert sent and all(c["seed"] == cfg.seed != user_cfg.seed for c in sent)
    text = " ".join(str(m.content) for m in grid.sent)
    assert str(noise_seed) not in text and f'"seed": {user_cfg.seed},' not in text


def test_missing_partition_is_dropped_each_round():
    cfg, protocol, seed = setup()
    grid = InProcessGrid(make_client_app(), 4)
    del grid.contexts[list(grid.contexts)[2]]
    _, records, _ = flower_run(grid, cfg, protocol, seed, min_fraction=0.7, round_timeout=0.3)
    assert all("no node holds" in r.dropped["partition-2"] and r.accepted == 3 for r in records)


def test_two_nodes_claiming_one_partition_is_refused():
    cfg, protocol, seed = setup()
    with pytest.raises(ValueError, match="partition-id: nodes .* both claim partition 0"):
        flower_run(InProcessGrid(make_client_app(), 3, duplicate=True), cfg, protocol, seed)


def test_nodes_read_their_users_from_a_data_file(tmp_path):
    full = EXP.units(setup()[0], torch.arange(60))
    from fedpers.experiments.altmin import truth

    path = tmp_path / "users.npz"
    save_altmin_npz(path, x=full["x"], y=full["y"], u_star=truth(setup()[0]))
    node_copy = tmp_path / "node-copy.npz"
    shutil.copy(path, node_copy)
    cfg, protocol, seed = setup(data=str(path))
    u_local, _, _ = local_run(cfg, protocol, seed)
    grid = InProcessGrid(make_client_app(), 3, extra={codec.DATA_FILE: str(node_copy)})
    state, _, _ = flower_run(grid, cfg, protocol, seed)
    torch.testing.assert_close(state["U"], u_local["U"], rtol=0, atol=1e-10)


def test_a_node_with_other_data_is_refused_as_a_protocol_mismatch(tmp_path):
    cfg, protocol, seed = setup()
    other = EXP.units(setup(seed=9)[0], torch.arange(40))
    path = tmp_path / "other.npz"
    from fedpers.experiments.altmin import truth

    save_altmin_npz(path, x=other["x"], y=other["y"], u_star=truth(cfg))
    grid = InProcessGrid(make_client_app(), 2, extra={codec.DATA_FILE: str(path)})
    with pytest.raises(RoundFailed, match="protocol mismatch"):
        flower_run(grid, cfg, protocol, seed)


def test_flower_runtime_refuses_a_bad_split_before_starting():
    cfg, protocol, seed = setup()
    with pytest.raises(ValueError, match="users_per_node=30 with 80 units needs nodes=3"):
        run_flower(EXP, cfg, protocol, Privatizer(seed), options(nodes=4, users_per_node=30), progress=False)
    with pytest.raises(ValueError, match="runtime must be flower"):
        execute(
            EXP,
            config_lib.build(EXP.config_type, SMALL),
            RuntimeOptions(runtime=Runtime.LOCAL),
            write=False,
            grid=object(),
        )


def test_a_user_overflowing_float32_costs_its_node_nothing(tmp_path):
    """The issue's 2.07×: one bad user used to get its whole node dropped (all its honest users
    vanished from the sum). Now it enters as zero, on every node layout, at min-fraction 1."""
    from fedpers.experiments.altmin import truth

    full = EXP.units(setup()[0], torch.arange(60))
    y = full["y"].clone()
    y[17] = y[17] * 1e39  # finite in the float64 file, not finite in float32
    path = tmp_path / "users.npz"
    save_altmin_npz(path, x=full["x"], y=y, u_star=truth(setup()[0]))
    cfg, protocol, seed = setup(data=str(path), dtype="float32", cohorts="all")
    u_local, local_records, ledger_local = local_run(cfg, protocol, seed)
    state, records, ledger = flower_run(
        InProcessGrid(make_client_app(), 3, extra={codec.DATA_FILE: str(path)}), cfg, protocol, seed
    )
    torch.testing.assert_close(state["U"], u_local["U"], rtol=0, atol=1e-5)
    assert ledger == ledger_local
    for record in list(records) + list(local_records):
        assert not record.dropped and record.units == 60
        assert record.zeroed == (0 if record.round == 0 else 1)  # the init's label clip takes y = inf to ζ


def test_replayed_asymmetric_and_partition_sized_replies_are_dropped():
    """Malicious nodes: a replay of the previous round, an antisymmetric part added to A, and a
    unit count of the whole partition where the round's cohort holds a third of it."""
    cfg, protocol, seed = setup()
    grid = InProcessGrid(faulty_client_app({1: "replay", 2: "asymmetric", 3: "partition-count"}), 6)
    state, records, ledger = flower_run(grid, cfg, protocol, seed, min_fraction=0.3)
    assert (
        "replayed or stale" in records[1].dropped["partition-1"]
        and "replayed or stale" in records[2].dropped["partition-1"]
    )
    assert "partition-1" not in records[0].dropped  # nothing to replay yet: its first reply is honest
    for record in records:
        assert "not symmetric" in record.dropped["partition-2"]
    for record in records[1:]:
        assert "unit count" in record.dropped["partition-3"]
    ranges = unit_ranges(EXP.num_units(cfg), 6)
    cohort_sizes = [protocol.units_in_round(1, {"ids": torch.arange(r.start, r.stop)}) for r in ranges]
    assert all(size < len(r) for size, r in zip(cohort_sizes, ranges))
    assert records[1].units == sum(size for p, size in enumerate(cohort_sizes) if p not in (1, 2, 3))


def test_partitions_come_from_the_operator_map_not_from_what_nodes_claim():
    """`node-partitions` assigns partitions to (authenticated) node ids: an uninvited node that
    claims partition 0 — or every user, with num-partitions=1 — takes part in nothing, and the
    result is the honest run's."""
    cfg, protocol, seed = setup()
    honest = InProcessGrid(make_client_app(), 3)
    u_ref, _, ledger_ref = flower_run(honest, cfg, protocol, seed)
    grid = InProcessGrid(make_client_app(), 4, duplicate=True)  # the 4th node claims partition 0 too
    ids = list(grid.contexts)
    claims = {n: int(grid.contexts[n].node_config[codec.PARTITION_ID]) for n in ids}
    invited = [n for n in ids[:3]]
    mapping = " ".join(f"{n}={claims[n]}" for n in invited)
    for n in ids:  # everyone says there is one partition: a node-claimed split would give one node all users
        grid.contexts[n].node_config[codec.NUM_PARTITIONS] = 1
    state, records, ledger = flower_run(grid, cfg, protocol, seed, node_partitions=mapping)
    torch.testing.assert_close(state["U"], u_ref["U"], rtol=0, atol=1e-10)
    assert ledger == ledger_ref and all(r.clients == 3 and not r.dropped for r in records)
    sent_to = {m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "train"}
    assert ids[3] not in sent_to


@pytest.mark.parametrize(
    "text, match",
    [
        ("5=0 6=0", "each held by one node"),
        ("5=1", "partitions must be 0..0"),
        ("x=0", "NODE_ID=PARTITION"),
        ("5=0 5=1", "listed twice"),
    ],
)
def test_bad_node_partitions_are_refused(text, match):
    from fedpers.runtime.flower.server import parse_node_partitions

    with pytest.raises(ValueError, match=match):
        parse_node_partitions(text)


def test_nodes_rebuild_the_protocol_without_running_the_accountant(monkeypatch):
    """The job carries the server's calibrations (public noise multipliers): a node builds the
    same protocol (digest checked) without calling the accountant; a wrong one is refused."""
    import dataclasses

    from fedpers.privacy import accountant
    from fedpers.runtime.flower import client

    cfg, protocol, seed = setup()
    grid = InProcessGrid(make_client_app(), 3)
    calls = []
    real = accountant._calibrate
    client._jobs.clear()
    monkeypatch.setattr(accountant, "_calibrate", lambda *a, **k: calls.append("node or server") or real(*a, **k))
    sent = []
    real_node_job = client.node_job
    monkeypatch.setattr(
        client, "node_job", lambda job, data_file, build: sent.append(job) or real_node_job(job, data_file, build)
    )
    state, _, _ = flower_run(grid, cfg, protocol, seed)
    u_local, _, _ = local_run(cfg, protocol, seed)
    torch.testing.assert_close(state["U"], u_local["U"], rtol=0, atol=1e-10)
    assert len(calls) == 1  # the server's one recording pass; the nodes used the job's values
    assert json.loads(sent[0].calibrations_json) and all(
        v == protocol.noise_multiplier for v in json.loads(sent[0].calibrations_json).values()
    )
    client._jobs.clear()
    wrong = dataclasses.replace(
        sent[0], calibrations_json=json.dumps({k: v * 1.01 for k, v in json.loads(sent[0].calibrations_json).items()})
    )
    with pytest.raises(ValueError, match="protocol mismatch"):
        real_node_job(wrong, "", build_node)
    client._jobs.clear()


def test_a_node_error_reaches_the_server_as_its_type_alone(caplog):
    """Flower sends a ClientApp's exception text to the server, and an error's text may quote the node's data
    (a malformed row): the server's records name the type only, the node's own log keeps the text."""
    from fedpers.runtime.flower.client import make_client_app as runtime_client_app

    secret = "row 3 of users.csv: alice,9.75"

    def build(*args):
        raise ValueError(secret)

    cfg, protocol, seed = setup()
    grid = InProcessGrid(runtime_client_app(build), 3)
    reasons: list[str] = []
    pull = grid.pull_messages

    def spy(ids):
        got = pull(ids)
        reasons.extend(m.error.reason for m in got if m.has_error())
        return got

    grid.pull_messages = spy
    with caplog.at_level("ERROR", logger="fedpers.flower"), pytest.raises(RoundFailed) as failed:
        flower_run(grid, cfg, protocol, seed)
    assert len(reasons) == 3 and all("ValueError" in r and secret not in r for r in reasons), reasons
    assert secret not in str(failed.value)
    assert secret in caplog.text  # the node's operator still sees it
