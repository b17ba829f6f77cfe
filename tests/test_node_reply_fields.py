"""What reaches the server under distributed and local DP: each node's encoded (masked or noised) vectors and
values the public plan fixes, nothing else the data decides. A node's own counts (its units taking part, under
Poisson cohorts its sampled users; its units zeroed because their contribution was not finite) stay with its
operator: on Flower in the node's log (and node store), on the local runtime in the simulated nodes'
:class:`~fedpers.runtime.distributed.NodeSummary`.

Each neighbour pair differs in one user of node 1: ordinary data, or float32 features of 1e39 (past float32's
range: they overflow to inf, so the unit's contribution is not finite and its node zeroes it; 1e38 is clipped to
its bound instead, tests/test_skellam_sampled.py)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from fedpers import config
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments.altmin import AltMinConfig, AltMinExperiment
from fedpers.privacy import distributed as dist
from fedpers.runner import execute, resolve
from fedpers.runtime import distributed as local_nodes
from fedpers.runtime.flower import client, codec
from tests.test_dishonest_server import RecordingGrid
from tests.test_distributed_flower import lab_app, on_flower

VALUES = dict(
    n_users=120, dim=5, rank=2, samples_per_user=16, rounds=2, baselines="none", epsilon=2.0, dtype="float32"
)  # fmt: skip
CASES = [
    ("distributed", {"cohorts": "disjoint"}),
    ("local", {"cohorts": "disjoint"}),
    ("distributed", {"cohorts": "poisson", "sampling_rate": 0.25}),
]
IDS = ["distributed-disjoint", "local-disjoint", "distributed-poisson"]
USER = 45
"""The user whose data differs: in node 1's range (30..59 of 120 users over 4 nodes)."""


def _plan(runtime: str, model: str, cohorts: dict[str, Any]) -> Any:
    cfg = config.build(AltMinConfig, {**VALUES, **cohorts})
    opts = {"nodes": 4, "runtime": runtime, "dp_model": model, **({"bits": 16} if model == "distributed" else {})}
    return resolve(AltMinExperiment(), cfg, config.build(RuntimeOptions, opts))


def _overflowing(units: dict[str, torch.Tensor], start: int = 0) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in units.items()}
    out["x"][USER - start] = torch.tensor(1e39).to(out["x"].dtype)  # past float32's range: inf, as a read gives
    return out


def _server_side(records: list[Any]) -> list[dict[str, Any]]:
    """The round records as the server writes them, less what is computed from the released (noised) sums."""
    return [
        {"round": r.round, "clients": r.clients, "accepted": r.accepted, "units": r.units, "zeroed": r.zeroed,
         "dropped": r.dropped, "diagnostics": sorted(r.diagnostics)}
        for r in records
    ]  # fmt: skip


def _clear_fields(grid: RecordingGrid) -> tuple[dict[tuple[int, int], Any], list[str]]:
    """Every reply the server received: the train replies by (round, partition), each tag field but the encoded
    vectors' bytes and the digest of the broadcast the server itself sent; the other replies (discovery, SecAgg+
    stages: fresh keys and masks each run) as the sorted names of their records, by partition."""
    train: dict[tuple[int, int], Any] = {}
    other: list[str] = []
    for m in grid.received:
        part = int(grid.contexts[m.metadata.src_node_id].node_config[codec.PARTITION_ID])
        content = m.content
        if m.metadata.message_type == "train":
            tag = dict(content.config_records[codec.TAG])
            keep = {k: v for k, v in tag.items() if k not in (codec.BLOB, codec.DIGEST_OF_BROADCAST)}
            train[(int(tag[codec.ROUND]), part)] = (keep, sorted(content.array_records))
        else:
            names = {name: sorted(rec) for name, rec in content.config_records.items()}
            other.append(json.dumps([m.metadata.message_type, part, names, sorted(content.metric_records)]))
    return train, sorted(other)


def _sampled_sizes(p: Any, rounds: int) -> list[int]:
    """|S| of each sampled round, drawn as the nodes draw it (each unit's key; no node split enters)."""
    n, q = p.cfg.n_users, p.cfg.sampling_rate
    return [
        int(dist.node_membership(p.privatizer.noise_seed, r, torch.arange(n), q, secure=False).sum()) for r in rounds
    ]


def _holds(text: str, number: int) -> bool:
    """Whether ``number`` is written in ``text`` as a number of its own (42 or 42.0; not inside 0.42 or 142)."""
    return re.search(rf"(?<![\w.]){number}(\.0+)?(?![\w.])", text) is not None


@pytest.mark.parametrize(("model", "cohorts"), CASES, ids=IDS)
def test_a_neighbour_whose_data_overflows_changes_nothing_the_local_server_receives_but_the_sums(
    model: str, cohorts: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Local runtime: the pair's round records (units, zeroed, clients, diagnostics named) and ledgers are equal, the
    records say "not released" (None) for zeroed and hold the plan's units; the simulated nodes' summary (the
    operator's) counts the zeroed unit in round 0, where every user takes part, and the run ends with a warning
    saying so to the operator (none for the clean data)."""
    got = []
    for overflow in (False, True):
        p = _plan("local", model, cohorts)
        units = p.experiment.units(p.cfg, torch.arange(120))
        summary = local_nodes.NodeSummary()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedpers.nodes"):
            _, records = local_nodes.run_local_nodes(
                p.protocol, _overflowing(units) if overflow else units, p.privatizer, progress=False, summary=summary
            )
        warned = [r.getMessage() for r in caplog.records if r.name == "fedpers.nodes"]
        got.append((_server_side(records), p.privatizer.ledger, summary, warned))
    (records, ledger, clean, quiet), (records_n, ledger_n, bad, warned) = got
    assert not quiet and len(warned) == 1 and "not released" in warned[0]
    assert records == records_n and ledger == ledger_n
    assert all(r["zeroed"] is None for r in records) and records[0]["units"] == 120
    assert clean.zeroed[0] == 0 and bad.zeroed[0] == 1  # the operator sees its zeroed unit
    assert clean.taking_part == bad.taking_part and clean.taking_part[0] == 120


@pytest.mark.parametrize(("model", "cohorts"), CASES, ids=IDS)
def test_a_neighbour_whose_data_overflows_changes_nothing_a_flower_server_receives_but_the_vectors(
    model: str, cohorts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Flower: every reply's clear fields (round, units 0, zeroed 0, the vectors' names, dtypes and shapes; the
    SecAgg+ stages' record names), the round records and the ledger are equal across the pair; only the encoded
    vectors differ. Node 1's log (its operator's) shows the zeroed unit, and no reply, record or ledger entry does.
    Under Poisson cohorts no round record holds a round's |S|."""
    loaded = client.node_units
    state: dict[str, bool] = {"overflow": False}

    def node_units(job: Any, data_file: str, node: Any, start: int, stop: int) -> dict[str, torch.Tensor]:
        units = loaded(job, data_file, node, start, stop)
        return _overflowing(units, start) if state["overflow"] and start <= USER < stop else units

    monkeypatch.setattr(client, "node_units", node_units)
    got = []
    for overflow in (False, True):
        state["overflow"] = overflow
        p = _plan("flower", model, cohorts)
        grid = RecordingGrid(lab_app({**VALUES, **cohorts}), 4)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fedpers.flower"):
            _, records = on_flower(p, grid)
        own = [r.getMessage() for r in caplog.records if "units zeroed" in r.getMessage()]
        got.append((_clear_fields(grid), _server_side(records), p.privatizer.ledger, own, records))
    (fields, records, ledger, own, raw), (fields_n, records_n, ledger_n, own_n, _) = got
    assert fields == fields_n and records == records_n and ledger == ledger_n
    train = list(fields[0].values())
    assert len(train) == 4 * len(records) and all((v[0][codec.UNITS], v[0][codec.ZEROED]) == (0, 0) for v in train)
    assert all(r["zeroed"] is None for r in records)
    assert any(line.startswith("round 0 ") and "units zeroed 1" in line for line in own_n)  # every user takes part
    assert not any("units zeroed 1" in line for line in own)
    if cohorts["cohorts"] == "poisson":
        p = _plan("flower", model, cohorts)
        sizes = _sampled_sizes(p, range(1, len(raw)))
        for record, size in zip(raw[1:], sizes, strict=True):
            assert size not in (0, 1, 2, 4, 30, 120) and size != 0.25 * 120  # public numbers a record holds
            assert not _holds(json.dumps(record.to_dict()), size), (size, record.to_dict())


def test_a_poisson_run_directory_holds_no_cohort_size(tmp_path: Path) -> None:
    """A local distributed-DP run with Poisson cohorts, written to its run directory: no file holds any sampled
    round's |S| (the old records' ``units`` and ``sampled_users`` did), while the operator's node summary of the
    same draw shows it; the rounds record the plan's eligible units and the public expected q·n, so labelled."""
    cfg = config.build(
        AltMinConfig, {**VALUES, "n_users": 160, "rounds": 3, "cohorts": "poisson", "sampling_rate": 0.25}
    )
    options = config.build(RuntimeOptions, {"nodes": 4, "dp_model": "distributed", "bits": 16})
    p = resolve(AltMinExperiment(), cfg, options)
    sizes = _sampled_sizes(p, range(1, 4))
    summary = local_nodes.NodeSummary()
    local_nodes.run_local_nodes(
        p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, progress=False, summary=summary
    )
    assert [summary.taking_part[r] for r in (1, 2, 3)] == sizes  # the draw the test reads is the nodes' own
    execute(AltMinExperiment(), cfg, options, out=tmp_path / "run", progress=False)
    rounds = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [r["units"] for r in rounds] == [160] * 4 and all(r["units_zeroed"] is None for r in rounds)
    assert all(r["expected_sampled_users"] == 40.0 and "sampled_users" not in r for r in rounds[1:])
    for size in sizes:
        assert size not in (0, 1, 2, 3, 4, 16, 40, 160)  # numbers the plan writes (a false alarm otherwise)
        for path in sorted((tmp_path / "run").rglob("*.json*")):
            if path.name != "provenance.json":  # versions and clock times, nothing of the run's data
                assert not _holds(path.read_text(), size), (path.name, size)


def test_a_node_with_a_lab_policy_keeps_its_own_counts_in_its_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployment's node (lab policy, OS-entropy noise) keeps each round's own counts in its run's entry of its
    node store, labelled as not released: node 1, holding the overflowing user, records it zeroed in round 0,
    while its replies carry counts 0."""
    from fedpers.app import make_client_app
    from fedpers.runtime.flower.nodeplan import NODE_STORE_ENV
    from fedpers.runtime.flower.policy import POLICY_ENV
    from tests.test_dishonest_server import on_flower as on_lab_flower
    from tests.test_dishonest_server import plan, policy_text

    (tmp_path / "policy.toml").write_text(policy_text())
    monkeypatch.setenv(POLICY_ENV, str(tmp_path / "policy.toml"))
    monkeypatch.setenv(NODE_STORE_ENV, str(tmp_path / "store"))
    loaded = client.node_units

    def node_units(job: Any, data_file: str, node: Any, start: int, stop: int) -> dict[str, torch.Tensor]:
        units = loaded(job, data_file, node, start, stop)
        return _overflowing(units, start) if start <= USER < stop else units

    monkeypatch.setattr(client, "node_units", node_units)
    p = plan(4, cfg={**VALUES, "rounds": 1})
    grid = RecordingGrid(make_client_app(), 4)
    _, records = on_lab_flower(p, grid)
    assert len(records) == 2 and all(r.zeroed is None for r in records)
    replies = [codec.decode_reply(m.content) for m in grid.received if m.metadata.message_type == "train"]
    assert replies and all((r.count, r.zeroed) == (0, 0) for r in replies)
    runs = json.loads((tmp_path / "store" / "lab-node-ledger.json").read_text())["runs"]
    data = [entry["data"] for entry in runs.values()]
    assert data and all("not released" in d["note"] for d in data)
    zeroed = sorted(d["0"]["units_zeroed"] for d in data)
    assert zeroed[-1] == 1 and sum(zeroed) == 1  # the overflowing user's node, round 0 (every user)
