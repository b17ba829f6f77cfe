"""SecAgg+ over Flower Messages against central aggregation: one AltMin round in Flower's simulation.

For each number of nodes, three runs of the same tiny AltMin (2 users per node, d = 5, k = 2, every
user in each round, ε = 2) on Flower's Ray simulation, one after the other in this process:

- central: each node sends its clipped sums, the server adds them and the noise (``--dp-model central``);
- local: each node noises its units and sends its noisy sum (``--dp-model local``: node-side encoding,
  no secure aggregation);
- distributed: each node encodes, noises and masks its integer vector, in five Message stages per
  round (advertise keys, share keys, masked task, consistency, unmask; ``--dp-model distributed --bits 16``).

Timed: the steady round (the last of the run's rounds, from its record: the Ray start-up and the
nodes' first data loading fall in earlier ones), and the ratio of each to central's, measured side
by side in this run. The statistics here are small (W: 10, A: 55, b: 10 values), so the ratio is the
protocol's message and cryptography cost, not the arithmetic's.

    PYTHONPATH=$PWD python benchmarks/secagg_flower.py [--nodes 10,100] [--client-cpus 1] [--rounds 2]
        [--models central,local,distributed]

The floor (``--floor``): how much of SecAgg+'s cost is Flower's exchanges, not its work. For each number
of nodes, one simulation runs fedpers' central AltMin rounds, and after each steady round, on the same
Ray actors, two rounds of a bare ClientApp that computes nothing: one exchange with the central round's
bytes, and a *null SecAgg*, five exchanges with a SecAgg+ round's message types and sizes (keys, relayed
ciphertexts, the task with its relays, the survivor set, signatures, shares) and a node state of its
size kept in ``context.state``, no cryptography. Medians of ``--steady-rounds`` rounds:

    PYTHONPATH=$PWD python benchmarks/secagg_flower.py --floor --nodes 1000 [--steady-rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from fedpers import config as config_lib
from fedpers.app import run_flower
from fedpers.configs.runtime import RuntimeOptions
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy.accountant import Calibrations
from fedpers.runner import resolve

EXP = EXPERIMENTS["altmin"]
MODELS = ("central", "local", "distributed")


def one_run(nodes: int, model: str, args: argparse.Namespace) -> tuple[float, float, int]:
    """(seconds of the steady round, whole run's seconds, nodes that survived it) for one trust model."""
    fields = {"n_users": 2 * nodes, "dim": 5, "rank": 2, "samples_per_user": 16, "rounds": args.rounds,
              "cohorts": "all", "epsilon": 2.0, "seed": 0, "baselines": "none"}  # fmt: skip
    cfg = config_lib.build(EXP.config_type, fields)
    opts: dict[str, Any] = {"runtime": "flower", "nodes": nodes, "dp_model": model, "round_timeout": 3600.0,
                            "client_cpus": args.client_cpus}  # fmt: skip
    if model == "distributed":
        opts["bits"] = 16
    p = resolve(EXP, cfg, config_lib.build(RuntimeOptions, opts))
    table = p.calibrations.table
    node_protocol = EXP.protocol(p.cfg, Calibrations(table)) if model != "central" else None
    start = time.perf_counter()
    _, records = run_flower(EXP, p.cfg, p.protocol, p.privatizer, p.options, progress=False, calibrations=table,
                            node_protocol=node_protocol)  # fmt: skip
    total = time.perf_counter() - start
    last = records[-1]
    return last.seconds, total, int(last.diagnostics.get("nodes_survived", nodes))


NULL = "bench.null"
"""Record of a null-SecAgg message: the stage, and the bytes its reply carries."""


def null_sizes(nodes: int) -> dict[str, Any]:
    """A SecAgg+ round's message and state sizes at ``nodes`` nodes (degree and threshold as the protocol's)."""
    from fedpers.privacy import secagg

    degree = min(secagg.plus_degree(nodes), nodes - 1)
    cipher = 12 + 2 * secagg.SHARE_BYTES + 16  # nonce, the two shares, the AES-GCM tag
    return {"degree": degree, "cipher": cipher, "key": secagg.KEY_BYTES}


def floor(nodes: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of fedpers' central rounds, of one bare exchange with their bytes, and of a null SecAgg
    (five bare exchanges with SecAgg+'s sizes), interleaved on one simulation's Ray actors."""
    from flwr.app import ConfigRecord, MessageType, RecordDict
    from flwr.app import Message as FlowerMessage
    from flwr.clientapp import ClientApp

    from fedpers.app import flower_job, simulate_objects
    from fedpers.app import make_client_app as fedpers_client
    from fedpers.privacy import Privatizer
    from fedpers.privacy.distributed import flat_dim, padded_dim
    from fedpers.runner import split_seed
    from fedpers.runtime.flower.server import exchange
    from fedpers.runtime.flower.simulation import run_flower as run_on_grid

    fields = {"n_users": 2 * nodes, "dim": 5, "rank": 2, "samples_per_user": 16, "rounds": args.steady_rounds + 1,
              "cohorts": "all", "epsilon": 2.0, "seed": 0, "baselines": "none"}  # fmt: skip
    cfg, noise_seed = split_seed(config_lib.build(EXP.config_type, fields))
    protocol = EXP.protocol(cfg)
    job = flower_job(EXP, cfg, protocol)
    opts = config_lib.build(
        RuntimeOptions, {"runtime": "flower", "nodes": nodes, "round_timeout": 3600.0, "client_cpus": args.client_cpus}
    )
    specs = protocol.stat_specs(1)
    central_reply = 8 * sum(flat_dim(s.shape, s.symmetric) for s in specs)
    masked_reply = 8 * sum(padded_dim(flat_dim(s.shape, s.symmetric)) for s in specs)
    task = len(job.config_json) + len(job.calibrations_json) + 8 * cfg.dim * cfg.rank
    z = null_sizes(nodes)
    d, key, cipher = z["degree"], z["key"], z["cipher"]
    fedpers_app, client = fedpers_client(), ClientApp()

    def _answer(message: FlowerMessage, context: Any) -> FlowerMessage | None:
        rec = message.content.get(NULL)
        if not isinstance(rec, ConfigRecord):
            return None
        stage, n = str(rec["stage"]), int(str(rec["nodes"]))
        if stage != "central":  # the node's round state, as SecAgg+ keeps it (its survivor set packed at unmask)
            context.state["bench.state"] = ConfigRecord(
                {"keys": bytes(3 * 32 + 3 * d * key), "held": bytes(2 * (d + 1) * 20), "signed": bytes(8 * n)}
            )
        replies: dict[str, dict[str, Any]] = {
            "central": {"stats": bytes(central_reply)},
            "advertise": {"c-pk": bytes(key), "s-pk": bytes(key), "g-pk": bytes(key)},
            "share": {"ids": list(range(d)), "blobs": [bytes(cipher)] * d},
            "masked": {"stats": bytes(masked_reply)},
            "consistency": {"signature": bytes(64)},
            "unmask": {"ids": list(range(d + 1)), "kinds": "b" * (d + 1), "shares": [bytes(20)] * (d + 1)},
        }
        return FlowerMessage(RecordDict({NULL: ConfigRecord(replies[stage])}), reply_to=message)

    @client.train()
    def _train(message: FlowerMessage, context: Any) -> FlowerMessage:
        return _answer(message, context) or fedpers_app(message, context)

    @client.query()
    def _query(message: FlowerMessage, context: Any) -> FlowerMessage:
        return _answer(message, context) or fedpers_app(message, context)

    def server(grid: Any, context: Any) -> dict[str, list[float]]:  # in Flower's simulation process
        out: dict[str, list[float]] = {"fedpers central": [], "bare central": [], "null SecAgg+": []}
        ids: list[int] = []
        n = len(range(nodes))

        def one(stage: str, kind: str, body: dict[str, Any]) -> None:
            rec = ConfigRecord({"stage": stage, "nodes": n, **body})
            replies = exchange(grid, [FlowerMessage(RecordDict({NULL: rec}), i, kind) for i in ids], 3600.0)
            assert len(replies) == len(ids) and not any(r.has_error() for r in replies)

        def null_round() -> float:
            start = time.perf_counter()
            one("advertise", MessageType.QUERY, {"round": 1, "min-nodes": 1, "bits": 16})
            one("share", MessageType.QUERY, {"ids": list(range(d)), "c-pk": [bytes(key)] * d,
                                               "s-pk": [bytes(key)] * d, "g-pk": [bytes(key)] * d})  # fmt: skip
            one("masked", MessageType.TRAIN, {"task": bytes(task), "secagg-from": list(range(d)),
                                              "secagg-blobs": [bytes(cipher)] * d})  # fmt: skip
            one("consistency", MessageType.QUERY, {"ids": list(range(n))})
            one("unmask", MessageType.QUERY, {"ids": list(range(n)), "signers": list(range(d)),
                                              "signatures": [bytes(64)] * d})  # fmt: skip
            return time.perf_counter() - start

        def central_round() -> float:
            start = time.perf_counter()
            one("central", MessageType.TRAIN, {"task": bytes(task)})
            return time.perf_counter() - start

        def on_round(record: Any, state: Any) -> None:
            if record.round == 0:  # the first round loads every node's users and warms the actors
                central_round(), null_round()
                return
            out["fedpers central"].append(record.seconds)
            out["bare central"].append(central_round())
            out["null SecAgg+"].append(null_round())

        run_on_grid(job, 2 * nodes, protocol, Privatizer(noise_seed), opts, grid=grid, device=cfg.device,
                    progress=False, on_round=on_round, on_discovery=lambda f: ids.extend(f.nodes.values()))  # fmt: skip
        return out

    found: dict[str, list[float]] = simulate_objects(server, client, opts)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="10,100")
    p.add_argument("--rounds", type=int, default=2, help="AltMin rounds (the last one is timed)")
    p.add_argument("--client-cpus", type=float, default=1.0)
    p.add_argument("--models", default=",".join(MODELS), help="comma list of central, local, distributed")
    p.add_argument("--floor", action="store_true", help="the null-SecAgg floor against central (see the docstring)")
    p.add_argument("--steady-rounds", type=int, default=3, help="--floor: steady rounds (medians)")
    a = p.parse_args()
    if a.floor:
        print(
            "seconds of a round on Flower's Ray simulation, interleaved on the same actors (medians of steady rounds)"
        )
        print(
            f"{'nodes':>6} {'fedpers central':>16} {'bare central':>13} {'null SecAgg+':>13} {'null/central':>13} {'null/bare':>10}"
        )
        for n in [int(v) for v in a.nodes.split(",")]:
            med = {k: statistics.median(v) for k, v in floor(n, a).items()}
            c, b, z = med["fedpers central"], med["bare central"], med["null SecAgg+"]
            print(f"{n:>6} {c:>16.2f} {b:>13.2f} {z:>13.2f} {z / c:>13.2f} {z / b:>10.2f}", flush=True)
        return
    models = [m for m in MODELS if m in a.models.split(",")]
    if "central" not in models or len(models) < 2:
        p.error("--models must hold central and at least one other (the ratios are to central)")
    print("seconds of one steady AltMin round on Flower's Ray simulation (whole run in brackets)")
    print(
        f"{'nodes':>6} {'central':>16} {'local':>16} {'distributed':>16} {'local/central':>14} {'SecAgg+/central':>16}"
    )
    for n in [int(v) for v in a.nodes.split(",")]:
        got: dict[str, tuple[float, float, int]] = {}
        for m in models:  # each printed as it finishes: a long run killed later keeps what it measured
            got[m] = one_run(n, m, a)
            print(f"  {n} nodes, {m}: steady round {got[m][0]:.2f} s (whole run {got[m][1]:.1f} s)", flush=True)
        if "distributed" in got:
            assert got["distributed"][2] == n, "every node should survive the timed round"
        cells = " ".join(f"{got[m][0]:>7.2f} ({got[m][1]:>6.1f})" if m in got else f"{'-':>16}" for m in MODELS)
        c = got["central"][0]
        ratios = " ".join(f"{got[m][0] / c:>14.1f}" if m in got else f"{'-':>14}" for m in ("local", "distributed"))
        print(f"{n:>6} {cells} {ratios}", flush=True)


if __name__ == "__main__":
    main()
