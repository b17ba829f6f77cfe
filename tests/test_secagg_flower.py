"""SecAgg+ over Flower Messages under distributed DP: the server sums only masked vectors, recovers
dropped nodes' masks from shares, releases nothing below the threshold, and the run equals the local
runtime's exact simulation (same U, same ledger)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.app import Message as FlowerMessage

from fedpers import config
from fedpers.app import make_client_app, run_flower
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments.altmin import AltMinConfig, AltMinExperiment
from fedpers.privacy.accountant import Calibrations
from fedpers.runner import resolve
from fedpers.runtime import distributed as local_nodes
from fedpers.runtime.driver import RoundFailed
from fedpers.runtime.flower import codec, secaggplus
from fedpers.runtime.local import run_local
from tests.flower_support import InProcessGrid

SMALL = dict(n_users=120, dim=5, rank=2, samples_per_user=16, rounds=1, baselines="none", epsilon=2.0)


class DroppingGrid(InProcessGrid):
    """An in-process Grid whose partitions in ``lost`` compute and mask their vector but whose masked
    reply never reaches the server (a node dropping after masking); every reply is kept."""

    def __init__(self, partitions: int, lost: Iterable[int] = (), lost_unmask: Iterable[int] = (), **kw: Any) -> None:
        from fedpers.seeds import split_seed

        seed = split_seed(config.build(AltMinConfig, SMALL))[1]  # the lab seeds the simulation's nodes
        super().__init__(make_client_app(noise_seed=seed), partitions, **kw)
        self.lost, self.lost_unmask = set(lost), set(lost_unmask)
        self.received: list[tuple[int, FlowerMessage]] = []

    def _unmasking(self, reply: FlowerMessage) -> bool:
        asked = next(m for m in self.sent if m.metadata.message_id == reply.metadata.reply_to_message_id)
        rec = asked.content.config_records.get(secaggplus.SECAGG)
        return rec is not None and rec["stage"] == "unmask"

    def pull_messages(self, message_ids: Iterable[str]) -> list[FlowerMessage]:
        out = []
        for reply in super().pull_messages(message_ids):
            part = int(self.contexts[reply.metadata.src_node_id].node_config[codec.PARTITION_ID])
            if reply.metadata.message_type == "train" and part in self.lost:
                continue
            if part in self.lost_unmask and self._unmasking(reply):
                continue
            self.received.append((part, reply))
            out.append(reply)
        return out


def plan(runtime: str, **options: object) -> Any:
    cfg = config.build(AltMinConfig, SMALL)
    opts = {"nodes": 4, "runtime": runtime, "dp_model": "distributed", "bits": 16, **options}
    return resolve(AltMinExperiment(), cfg, config.build(RuntimeOptions, opts))


def on_flower(p: Any, grid: InProcessGrid) -> tuple[Any, list[Any]]:
    table = p.calibrations.table
    node_protocol = p.experiment.protocol(p.cfg, Calibrations(table))
    return run_flower(
        p.experiment, p.cfg, p.protocol, p.privatizer, p.options, grid=grid, progress=False, calibrations=table,
        node_protocol=node_protocol,
    )  # fmt: skip


def on_local(p: Any) -> Any:
    state, _ = run_local(p.protocol, p.experiment.unit_source(p.cfg), p.privatizer, progress=False)
    return state


@pytest.mark.parametrize("when", ["after masking", "before masking"])
def test_a_dropped_node_is_recovered_from_shares_and_equals_the_local_runtime(when, monkeypatch):
    """Partition 2 keys and shares, then drops (its masked vector lost, or it never computes one): the
    survivors' sum is unmasked from the shares, and U and the ledger equal the local runtime's with
    partition 2 dropped every round."""
    flower = plan("flower", min_nodes=3, round_timeout=0.5)
    grid = DroppingGrid(4, lost={2}) if when == "after masking" else DroppingGrid(4, silent={2})
    state_flower, records = on_flower(flower, grid)
    monkeypatch.setattr(local_nodes, "dropouts", lambda rate, seed: lambda round, node: node != 2)
    local = plan("local", min_nodes=3, node_dropout=0.25)
    torch.testing.assert_close(state_flower["U"], on_local(local)["U"], rtol=0, atol=1e-12)
    assert flower.privatizer.ledger == local.privatizer.ledger
    assert flower.privatizer.ledger.releases
    assert all(r.diagnostics["nodes_survived"] == 3 for r in records)
    stages = [m.content.config_records[secaggplus.SECAGG] for m in grid.sent if secaggplus.SECAGG in m.content]
    unmask = [r for r in stages if r["stage"] == "unmask"]
    assert unmask and all(list(r["ids"]) == [0, 1, 3] for r in unmask)
    answers = [
        r.content.config_records[secaggplus.SECAGG]
        for _, r in grid.received
        if secaggplus.SECAGG in r.content.config_records
    ]
    kinds = "".join(str(a.get("kinds", "")) for a in answers)
    if when == "after masking":  # its pair masks are in the survivors' vectors: its mask key was rebuilt
        assert "s" in kinds
    assert "b" in kinds


def test_fewer_survivors_than_the_threshold_release_nothing():
    """4 nodes (3 neighbours each, threshold 3: more than half of the 4 holders of a node's shares), noise
    sized for 1 survivor: 3 drop after masking, the one survivor's neighbourhood is below the threshold,
    the nodes reveal nothing and the round is discarded with an empty ledger."""
    assert secaggplus.threshold(4) == 3
    p = plan("flower", min_nodes=1, round_timeout=0.5)
    with pytest.raises(RoundFailed, match="SecAgg\\+ aborted|did not sign the survivor set"):
        on_flower(p, DroppingGrid(4, lost={0, 1, 3}))
    assert len(p.privatizer.ledger.releases) == 0
    q = plan("flower", min_nodes=3, round_timeout=0.5)  # the server's own min_nodes rule stops it before unmasking
    with pytest.raises(RoundFailed, match="below min_nodes=3"):
        on_flower(q, DroppingGrid(4, lost={0, 1}))
    assert len(q.privatizer.ledger.releases) == 0


def test_the_server_receives_only_masked_vectors_uniform_mod_2b(monkeypatch):
    """Each vector the server receives is the node's masked one: it differs from the node's plain
    (noised, integer) vector in nearly every coordinate, and all of them together pass a χ² test of
    uniformity on [0, 2^b) that the plain vectors fail (the test has power)."""
    from scipy import stats as scipy_stats

    plain: dict[int, np.ndarray] = {}
    masked: dict[int, np.ndarray] = {}
    real = secaggplus.mask

    def spy(node: Any, mine: Any, context: Context, round: int) -> Any:
        out = real(node, mine, context, round)
        if round == 0:
            names = sorted(mine.stats)
            part = int(context.node_config[codec.PARTITION_ID])
            plain[part], masked[part] = secaggplus.concat(mine.stats, names), secaggplus.concat(out.stats, names)
        return out

    monkeypatch.setattr(secaggplus, "mask", spy)
    p = plan("flower")
    grid = DroppingGrid(4)
    on_flower(p, grid)
    bits = p.privatizer.plan.bits
    got = {}
    for part, reply in grid.received:
        if (
            reply.metadata.message_type == "train"
            and codec.decode_reply(reply.content).stats.keys()
            and part not in got
        ):
            stats = codec.decode_reply(reply.content).stats
            got[part] = secaggplus.concat(stats, sorted(stats))
    assert sorted(got) == sorted(plain) == [0, 1, 2, 3]
    for part in got:
        assert np.array_equal(got[part], masked[part])  # what the server holds is the masked vector
        assert np.mean(got[part] != plain[part]) > 0.95

    def chi2_p(vectors: dict[int, np.ndarray]) -> float:
        values = np.concatenate(list(vectors.values()))
        counts = np.bincount(values >> (bits - 4), minlength=16)
        return float(scipy_stats.chisquare(counts).pvalue)

    assert chi2_p(got) > 1e-4
    assert chi2_p(plain) < 1e-6


def test_secagg_stages_must_come_in_order_once_each():
    """A node answers unmask only after it masked, and only once: a server asking out of order or a
    second time gets an error, never shares."""
    InProcessGrid(make_client_app(), 1)  # sets Flower's task identity, as a ServerApp has it
    context = Context(
        run_id=1, node_id=7, node_config={codec.PARTITION_ID: 0, codec.NUM_PARTITIONS: 4}, state=RecordDict(),
        run_config={},
    )  # fmt: skip

    def ask(**fields: Any) -> FlowerMessage:
        from flwr.app import ConfigRecord

        msg = FlowerMessage(RecordDict({secaggplus.SECAGG: ConfigRecord(fields)}), 7, secaggplus.MESSAGE_TYPE)
        msg.metadata.__dict__["_message_id"] = "m"
        return secaggplus.handle_stage(msg, context)

    reply = ask(stage="advertise", round=0, nodes=4, **{"min-nodes": 2, "bits": 16})
    assert len(bytes(reply.content.config_records[secaggplus.SECAGG]["c-pk"])) == 32
    with pytest.raises(ValueError, match="must follow 'consistency'"):
        ask(stage="unmask", round=0, ids=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="must follow 'advertise' of that round"):
        ask(stage="share", round=1, ids=[], **{"c-pk": [], "s-pk": []})
    with pytest.raises(ValueError, match="do not fit"):
        ask(stage="advertise", round=0, nodes=4, **{"min-nodes": 5, "bits": 16})
    with pytest.raises(ValueError, match="this node's config says 4 partitions"):  # degree/threshold from 4, not 3
        ask(stage="advertise", round=0, nodes=3, **{"min-nodes": 2, "bits": 16})


def test_the_run_config_carries_the_trust_model_and_a_distributed_deployment_needs_its_node_count():
    from fedpers.app import from_run_config

    job = from_run_config({"algorithm": "altmin", "dp-model": "distributed", "bits": 16, "min-nodes": 2, "nodes": 3})
    assert (job.options.dp_model.value, job.options.bits, job.options.min_nodes, job.options.nodes) == (
        "distributed",
        16,
        2,
        3,
    )
    listed = from_run_config({"algorithm": "altmin", "dp-model": "local", "node-partitions": "11=0 12=1"})
    assert listed.options.nodes == 2
    assert from_run_config({"algorithm": "altmin"}).options.dp_model.value == "central"
    with pytest.raises(ValueError, match="nodes must name the SuperNodes"):
        from_run_config({"algorithm": "altmin", "dp-model": "distributed"})
    with pytest.raises(ValueError, match="min_nodes"):
        from_run_config({"algorithm": "altmin", "dp-model": "distributed", "nodes": 3, "min-nodes": 4})
    p = plan("flower", nodes=3)  # a plan for 3 nodes on a federation of 4 partitions: refused before any release
    with pytest.raises(ValueError, match="the federation has 4 partitions"):
        on_flower(p, DroppingGrid(4))
    assert len(p.privatizer.ledger.releases) == 0


@pytest.mark.slow  # a loopback SuperLink and three SuperNodes (~2 min on a busy machine)
def test_a_three_node_loopback_deployment_runs_distributed_dp_through_secagg(tmp_path):
    """`flwr run .` with dp-model=distributed on one SuperLink and three SuperNodes (each message in a
    SuperNode may run in a new process: the SecAgg+ state lives in the node's Context): the run
    completes with the local runtime's ledger (the nodes' noise is drawn from OS entropy, so U is not
    compared) and every node survives every round."""
    import json
    import os
    import shutil
    import subprocess
    from pathlib import Path

    from fedpers.data.files import save_altmin_npz
    from fedpers.experiments import EXPERIMENTS
    from fedpers.experiments.altmin import truth
    from fedpers.runner import execute
    from tests.flower_support import Processes, free_port, wait_for_log, write_connection

    root = Path(__file__).resolve().parents[1]
    exp = EXPERIMENTS["altmin"]
    fields = {"n_users": 150, "dim": 5, "rank": 2, "samples_per_user": 8, "rounds": 1, "seed": 11, "epsilon": 2.0}
    users = exp.units(config.build(exp.config_type, fields), torch.arange(fields["n_users"]))
    data = tmp_path / "users.npz"
    save_altmin_npz(data, x=users["x"], y=users["y"], u_star=truth(config.build(exp.config_type, fields)))
    env = {**os.environ, "PYTHONPATH": str(root), "FLWR_DISABLE_UPDATE_CHECK": "1"}
    port = free_port()
    with Processes(tmp_path, env) as procs:
        link, link_log = procs.start(
            "superlink",
            ["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port),
             "--disable-runtime-dependency-installation"],
            FLWR_HOME=str(tmp_path / "link-home"),
        )  # fmt: skip
        wait_for_log(link_log, "Starting Flower SuperExec", link)
        for i in range(3):
            node_data = tmp_path / f"node{i}.npz"
            shutil.copy(data, node_data)
            node_config = f"partition-id={i} num-partitions=3 data-file='{node_data}'"
            procs.start(
                f"supernode{i}",
                ["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
                 "--node-config", node_config],
                FLWR_HOME=str(tmp_path / f"node{i}-home"),
            )  # fmt: skip
        home = tmp_path / "cli-home"
        write_connection(home, "deployment", f"127.0.0.1:{port}")
        out = tmp_path / "runs" / "flower"
        pairs = " ".join(f"{k}={v}" for k, v in fields.items())
        run_config = f"config='{pairs}' out='{out}' round-timeout=300.0 dp-model='distributed' bits=16 nodes=3"
        cmd = [shutil.which("flwr") or "flwr", "run", ".", "deployment", "--stream", "--run-config", run_config]
        done = subprocess.run(
            cmd, cwd=root, env={**procs.env, "FLWR_HOME": str(home)}, capture_output=True, text=True, timeout=480
        )
        assert (out / "result.json").is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    opts = config.build(RuntimeOptions, {"nodes": 3, "dp_model": "distributed", "bits": 16})
    execute(exp, config.build(exp.config_type, fields), opts, out=tmp_path / "local", progress=False)
    assert (out / "ledger.json").read_text() == (tmp_path / "local" / "ledger.json").read_text()
    result = json.loads((out / "result.json").read_text())
    assert result["privacy"]["trust_model"]["dp_model"] == "distributed"
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert rounds and all(r["nodes_survived"] == 3 for r in rounds)


def test_declared_node_dropout_on_flower_equals_the_local_runtime():
    """``--node-dropout q`` on Flower discards each dropped node's masked vector (a drop after masking,
    unmasked from shares); the run equals the local runtime's under the same public dropout draws. A round
    where SecAgg+ cannot unmask (2 of 4 survive, below its threshold of 3) is discarded on both runtimes."""
    flower = plan("flower", min_nodes=2, node_dropout=0.1)
    state_flower, records = on_flower(flower, DroppingGrid(4))
    local = plan("local", min_nodes=2, node_dropout=0.1)
    torch.testing.assert_close(state_flower["U"], on_local(local)["U"], rtol=0, atol=1e-12)
    assert flower.privatizer.ledger == local.privatizer.ledger
    survived = [r.diagnostics["nodes_survived"] for r in records]
    assert min(survived) < 4, survived  # the draws do drop a node here
    for runtime in ("flower", "local"):  # q = 0.3: round 1 keeps nodes 2 and 3 only
        p = plan(runtime, min_nodes=2, node_dropout=0.3)
        with pytest.raises(RoundFailed, match="below the SecAgg\\+ threshold|did not sign"):
            on_flower(p, DroppingGrid(4)) if runtime == "flower" else on_local(p)
        assert [r.name for r in p.privatizer.ledger.releases] == ["init.W"]  # round 0 only: nothing of round 1


def test_a_node_silent_at_unmasking_still_counts_its_masked_vector():
    """Partition 2's masked vector arrives but it never answers the unmask stage: its self mask is
    rebuilt from its neighbours' shares, so the sum holds all four nodes and equals the local runtime."""
    flower = plan("flower", min_nodes=3, round_timeout=0.5)
    state_flower, records = on_flower(flower, DroppingGrid(4, lost_unmask={2}))
    local = plan("local", min_nodes=3)
    torch.testing.assert_close(state_flower["U"], on_local(local)["U"], rtol=0, atol=1e-12)
    assert flower.privatizer.ledger == local.privatizer.ledger
    assert all(r.diagnostics["nodes_survived"] == 4 for r in records)
    assert all(r.diagnostics["suspected_wraps"] == 0 for r in records)  # an honest run: no false alarm


def test_the_server_flags_a_planted_wrap_from_the_sum_alone(monkeypatch):
    """The server holds only the sum mod 2^b, so it counts *suspected* wraps: centred coordinates beyond
    τ = (2^(b−1) − 1)·k(1e-3)/k(1e-6), where no honest sum lands but with probability 1e-3. One node adds
    2^(b−1) to its vector of b in round 1: the sum wraps (the local runtime, holding the unreduced sum,
    counts it), every coordinate of b lands beyond τ and the Flower server flags each, as the local runtime's
    own suspected count does; round 0 and every other statistic flag nothing."""
    from fedpers.privacy import distributed as dist

    honest = local_nodes.node_vectors
    planted: list[int] = []

    def plant(encoded: Any, specs: Any, privatizer: Any, round: int, generator: Any) -> Any:
        out = honest(encoded, specs, privatizer, round, generator)
        if round == 1 and len(planted) < 1:  # the first node of round 1, once per run
            planted.append(1)
            out["b"] = out["b"] + 2 ** (privatizer.plan.encodings["b"].bits - 1)
        return out

    enc = plan("local").privatizer.plan.encodings["b"]
    tau = dist.suspect_threshold(enc)
    assert 0.5 * 2**15 < tau < 2**15 - 1
    assert dist.suspected_wraps(torch.tensor([int(tau), -int(tau), 0]), enc) == 0  # within τ: never flagged
    assert dist.suspected_wraps(dist.modular(torch.tensor([2**15 + 3, -(2**15) - 3]), 16), enc) == 2  # wrapped
    monkeypatch.setattr(local_nodes, "node_vectors", plant)
    _, flower_records = on_flower(plan("flower"), DroppingGrid(4))
    planted.clear()
    local = plan("local")
    _, local_records = run_local(
        local.protocol, local.experiment.unit_source(local.cfg), local.privatizer, progress=False
    )
    D = enc.padded
    assert [r.diagnostics["suspected_wraps"] for r in flower_records] == [0, D]
    assert [r.diagnostics["suspected_wraps"] for r in local_records] == [0, D]
    assert local_records[0].diagnostics["modular_wraps"] == 0 < local_records[1].diagnostics["modular_wraps"] <= D
