"""What Flower costs: one private AltMin round on the local runtime vs Flower's Ray simulation.

Every simulation here runs through Flower's supported path, as ``fedpers run --runtime flower`` does: a
private simulation SuperLink and ``flwr run`` (``fedpers.app.simulate_objects``), the server loop and
the nodes handed over as objects; bare Flower runs on the same path, in the same simulation.

Three set-ups in one run (same seed, d = 50, k = 3, m = 40, every user in the round):

1. local runtime, 10,000 users batched on this machine;
2. Flower simulation, 8 nodes × 1,250 users (each node computes its users' statistics batched);
3. Flower simulation, one node per user (the common tutorial set-up), on 500 users.

Reported: Ray start-up (the discovery round: ``ray.init``, client actors, first
round trip), node data loading + protocol set-up (the first round), and the private AltMin
round (round 1) itself; then the ratios the issue asks for. Targets: the 8-node round within
3× of the local round; the 8-node per-user cost ≥ 100× below one node per user.

Then the per-call table (``--per-call 100,500,1000``): one node per user, the cost of one
ClientApp call in a steady round (total round time / nodes), fedpers' ClientApp (an AltMin
round: decode, statistics, verification, encode) beside Flower's own cost for an empty
ClientApp answering an empty message, and for one whose messages carry fedpers' bytes: one
simulation, the three kinds of round interleaved on the same Ray actors (a busy machine's load
falls on all three alike), medians of ``--steady-rounds`` rounds each.

    PYTHONPATH=. python benchmarks/flower_overhead.py [--users 10000 --nodes 8 --per-user-users 500 --per-call 100,500,1000]

GPU sharing (``--client-gpus 0.1``: ten node actors per GPU; users on ``--device``): on a GPU
machine, 1,000 nodes sharing one GPU, per-call cost beside bare Flower with the same Ray
settings, and the flower U against the local runtime's on the same device:

    PYTHONPATH=. python benchmarks/flower_overhead.py --only-per-call --per-call 1000 --client-gpus 0.1 --device cuda

On a machine without a GPU, ``--sim-gpus 1 --device cpu`` runs the same resource arithmetic on
one logical GPU (the nodes compute on the CPU).

Start-up (``--startup 8,100``): for each node count, one simulation whose server only discovers its
nodes: seconds from the call to the ServerApp's start (the private SuperLink, ``flwr run``, Flower's
simulation process and the app's imports), from there to Ray being up, and from Ray up to the first
round (every node actor started, its ClientApp loaded, every node answering discovery); beside it,
side by side, what one fresh Python process pays to import torch, and torch with fedpers' node side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

from fedpers import config as config_lib
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import Privatizer
from fedpers.runner import RuntimeOptions, split_seed
from fedpers.runtime.local import run_local

EXP = EXPERIMENTS["altmin"]


def make_config(users: int, args: argparse.Namespace, rounds: int = 1) -> Any:
    fields = {
        "n_users": users,
        "dim": args.dim,
        "rank": args.rank,
        "samples_per_user": args.samples,
        "rounds": rounds,
        "cohorts": "all",
        "epsilon": 4.0,
        "seed": 0,
        "baselines": "none",
        "device": args.device,
    }
    return split_seed(config_lib.build(EXP.config_type, fields))


def local(users: int, args: argparse.Namespace, rounds: int = 1) -> dict[str, Any]:
    cfg, noise_seed = make_config(users, args, rounds)
    protocol = EXP.protocol(cfg)
    start = time.perf_counter()
    units = EXP.units(cfg, torch.arange(users))
    load = time.perf_counter() - start
    state, records = run_local(protocol, units, Privatizer(noise_seed), progress=False)
    return {
        "startup": 0.0,
        "first": load + records[0].seconds,
        "round": records[1].seconds,
        "U": state["U"],
        "users": users,
    }


def flower(users: int, nodes: int, per_node: int, args: argparse.Namespace) -> dict[str, Any]:
    from fedpers.app import flower_job, make_client_app, simulate_objects
    from fedpers.runtime.flower.simulation import run_flower as run_on_grid

    cfg, noise_seed = make_config(users, args)
    protocol = EXP.protocol(cfg)
    opts = config_lib.build(
        RuntimeOptions,
        {"runtime": "flower", "nodes": nodes, "users_per_node": per_node, "round_timeout": 3600.0, **resources(args)},
    )
    job = flower_job(EXP, cfg, protocol)

    def server(grid: Any, context: Any) -> dict[str, Any]:
        found: dict[str, float] = {}
        start = time.perf_counter()
        state, records = run_on_grid(
            job,
            users,
            protocol,
            Privatizer(noise_seed),
            opts,
            grid=grid,
            device=cfg.device,
            progress=False,
            on_discovery=lambda f: found.update(startup=f.discovery_seconds),
        )
        total = time.perf_counter() - start
        return {
            "startup": found["startup"],
            "first": records[0].seconds,
            "round": records[1].seconds,
            "U": state["U"],
            "users": users,
            "total": total,
            "shutdown": total - found["startup"] - sum(r.seconds for r in records),
        }

    return simulate_objects(server, make_client_app(), opts)


def resources(args: argparse.Namespace) -> dict[str, Any]:
    """The RuntimeOptions fields of Ray's resources (the same for fedpers and bare Flower)."""
    return {
        "client_cpus": args.client_cpus,
        "client_gpus": args.client_gpus,
        "sim_gpus": args.sim_gpus,
        "ray_address": args.ray_address,
    }


def per_call(counts: list[int], args: argparse.Namespace) -> None:
    from fedpers.runtime.flower.simulation import actor_capacity, simulation_gpus

    opts = config_lib.build(RuntimeOptions, {"runtime": "flower", **resources(args)})
    gpus = simulation_gpus(opts)
    cpus = float(os.cpu_count() or 1)  # Ray's own count may be lower (cgroups): an upper bound
    cap = (
        ""
        if gpus is None
        else f", at most {actor_capacity(args.client_cpus, args.client_gpus, cpus, gpus)} node actors at once ({gpus} GPU(s))"
    )
    print(
        f"\nper ClientApp call, one user per node (steady round / nodes), client_cpus={args.client_cpus}, client_gpus={args.client_gpus}, device={args.device}{cap}:"
    )
    task_bytes, reply_bytes = message_bytes(args)
    print(
        f"interleaved in one simulation: each fedpers round is followed by a round of an empty ClientApp (bare Flower) and one whose task and reply "
        f"carry fedpers' bytes ({task_bytes} and {reply_bytes}: same bytes); medians of {args.steady_rounds} steady rounds"
    )
    print("wall: round seconds / nodes; cpu: CPU seconds of this process and its Ray (every node actor) / nodes")
    print(
        f"{'nodes':>6s}{'':5s}{'fedpers':>12s}{'bare Flower':>14s}{'ratio':>8s}{'same bytes':>13s}{'ratio':>8s}{'max|U_flower-U_local|':>24s}"
    )
    for n in counts:
        run = interleaved(n, args, task_bytes, reply_bytes)
        diff = float((run["U"].cpu() - local(n, args, rounds=args.steady_rounds)["U"].cpu()).abs().max())
        for what, suffix in (("wall", ""), ("cpu", " cpu")):
            fed, bare, same = (statistics.median(run[k + suffix]) / n for k in ("fedpers", "bare", "same"))
            tail = f"{diff:24.2e}" if what == "wall" else ""
            print(
                f"{n:6d} {what:4s}{fed * 1e3:10.2f} ms{bare * 1e3:12.2f} ms{fed / bare:7.2f}x{same * 1e3:10.2f} ms{fed / same:7.2f}x{tail}",
                flush=True,
            )


def cpu_seconds() -> float:
    """CPU seconds used so far by this process and its descendants (read from Linux's /proc):
    the simulation's own Ray (GCS, raylet, node actors) is started from here. Less inflated than
    wall time on a busy machine."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    mine, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _) in stats.items():
            if ppid == parent and pid not in mine:
                mine.add(pid)
                frontier.append(pid)
    return sum(stats[pid][1] for pid in mine if pid in stats)


BARE = "bench.bare"
"""Record name of a bare round's task: the ClientApp answers it as an empty ClientApp would."""


def interleaved(nodes: int, args: argparse.Namespace, task_bytes: int, reply_bytes: int) -> dict[str, Any]:
    """fedpers' AltMin on ``nodes`` nodes of one user, each steady round followed by a bare round
    and a same-bytes round on the same Ray actors: round seconds of each kind, and the final U."""
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict
    from flwr.clientapp import ClientApp

    from fedpers.app import flower_job, make_client_app, simulate_objects
    from fedpers.runtime.flower.server import exchange
    from fedpers.runtime.flower.simulation import run_flower as run_on_grid

    cfg, noise_seed = make_config(nodes, args, rounds=args.steady_rounds)
    protocol = EXP.protocol(cfg)
    job = flower_job(EXP, cfg, protocol)
    opts = config_lib.build(
        RuntimeOptions,
        {"runtime": "flower", "nodes": nodes, "users_per_node": 1, "round_timeout": 3600.0, **resources(args)},
    )
    # the reply's bytes are made in the actor: a closure holding them would be pickled with the app
    # on every call of every kind (Ray ships the app with each call), inflating bare Flower too
    fedpers_app, client = make_client_app(), ClientApp()

    @client.train()
    def _train(message: Message, context: Any) -> Message:
        bare = message.content.config_records.get(BARE)
        if bare is None:
            return fedpers_app(message, context)
        return Message(
            RecordDict({"r": ConfigRecord({"b": bytes(reply_bytes)})} if bare["b"] else {}), reply_to=message
        )

    @client.query()
    def _query(message: Message, context: Any) -> Message:
        return fedpers_app(message, context)

    def server(grid: Any, context: Any) -> dict[str, Any]:  # in Flower's simulation process, beside its Ray
        out: dict[str, Any] = {k: [] for k in ("fedpers", "bare", "same", "fedpers cpu", "bare cpu", "same cpu")}
        ids: list[int] = []

        def bare_round(size: int) -> float:
            content = lambda: RecordDict({BARE: ConfigRecord({"b": bytes(size)})})  # noqa: E731
            start = time.perf_counter()
            replies = exchange(grid, [Message(content(), n, MessageType.TRAIN) for n in ids], 3600.0)
            assert len(replies) == len(ids) and not any(r.has_error() for r in replies)
            return time.perf_counter() - start

        mark = [cpu_seconds()]

        def timed(kind: str, size: int) -> None:
            before = cpu_seconds()
            out[kind].append(bare_round(size))
            out[f"{kind} cpu"].append(cpu_seconds() - before)

        def on_round(record: Any, state: Any) -> None:
            if record.round == 0:  # the first round loads every node's user and warms the actors
                bare_round(0)
                bare_round(task_bytes)
            else:
                out["fedpers"].append(record.seconds)
                out["fedpers cpu"].append(cpu_seconds() - mark[0])
                timed("bare", 0)
                timed("same", task_bytes)
            mark[0] = cpu_seconds()

        state, _ = run_on_grid(
            job,
            nodes,
            protocol,
            Privatizer(noise_seed),
            opts,
            grid=grid,
            device=cfg.device,
            progress=False,
            on_round=on_round,
            on_discovery=lambda f: ids.extend(f.nodes.values()),
        )
        out["U"] = state["U"]
        return out

    return simulate_objects(server, client, opts)


def startup(counts: list[int], args: argparse.Namespace) -> None:
    """Seconds to the first round of a simulation of N nodes, in its phases (see the module docstring)."""
    import subprocess

    from fedpers.app import flower_job, make_client_app, simulate_objects
    from fedpers.runtime.flower.server import discover

    cfg, _ = make_config(2, args)
    job = flower_job(EXP, cfg, EXP.protocol(cfg))

    def server(grid: Any, context: Any) -> dict[str, float]:
        import threading

        import ray

        marks = {"server": time.time()}

        def watch() -> None:
            while not ray.is_initialized():
                time.sleep(0.005)
            marks["ray"] = time.time()

        threading.Thread(target=watch, daemon=True).start()
        nodes, _ = discover(grid, job, 3600.0)
        marks["first round"] = time.time()
        marks["nodes"] = float(len(nodes))
        return marks

    def fresh(code: str) -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - start

    print(
        f"\nstart-up to the first round, client_cpus={args.client_cpus} (medians of {args.startup_reps}; load {os.getloadavg()[0]:.1f} at the start)"
    )
    print(
        f"{'nodes':>6s}{'to ServerApp':>14s}{'to Ray up':>11s}{'Ray up to first round':>23s}{'fresh: torch':>14s}{'torch+node side':>17s}"
    )
    for n in counts:
        opts = config_lib.build(RuntimeOptions, {"runtime": "flower", "nodes": n, **resources(args)})
        rows: dict[str, list[float]] = {"server": [], "ray": [], "first": [], "torch": [], "node": []}
        for _ in range(args.startup_reps):
            start = time.time()
            marks = simulate_objects(server, make_client_app(), opts)
            assert marks["nodes"] == n
            rows["server"].append(marks["server"] - start)
            rows["ray"].append(marks["ray"] - marks["server"])
            rows["first"].append(marks["first round"] - marks["ray"])
            rows["torch"].append(fresh("import torch"))
            rows["node"].append(fresh("import fedpers.app, fedpers.runtime.flower.client"))
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(
            f"{n:6d}{med['server']:13.1f}s{med['ray']:10.1f}s{med['first']:22.1f}s{med['torch']:13.1f}s{med['node']:16.1f}s",
            flush=True,
        )


def message_bytes(args: argparse.Namespace) -> tuple[int, int]:
    """Bytes of a steady round's task (job config and broadcast) and reply (packed statistics) at one user per node."""
    from fedpers.app import flower_job

    cfg, _ = make_config(2, args)
    protocol = EXP.protocol(cfg)
    job = flower_job(EXP, cfg, protocol)
    itemsize = torch.empty((), dtype=protocol.dtype).element_size()
    task = len(job.config_json) + len(job.calibrations_json) + args.dim * args.rank * itemsize
    reply = sum(
        (s.shape[0] * (s.shape[0] + 1) // 2 if s.symmetric and len(s.shape) == 2 else int(torch.Size(s.shape).numel()))
        * itemsize
        for s in protocol.stat_specs(1)
    )
    return task, reply


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=10_000)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--per-user-users", type=int, default=500, help="users (= nodes) of the one-node-per-user set-up")
    p.add_argument("--dim", type=int, default=50)
    p.add_argument("--rank", type=int, default=3)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--client-cpus", type=float, default=1.0)
    p.add_argument("--client-gpus", type=float, default=0.0, help="GPU share per node actor (0.1: ten per GPU)")
    p.add_argument("--sim-gpus", type=int, default=-1, help="GPUs the simulation's Ray declares (-1: those torch sees)")
    p.add_argument("--device", default="cpu", help="where nodes and the local run keep users: cpu or cuda")
    p.add_argument("--ray-address", default="", help="attach to this Ray cluster instead of starting one")
    p.add_argument("--per-call", default="100,500,1000", help="node counts of the per-call table ('' to skip)")
    p.add_argument("--only-per-call", action="store_true", help="skip the batched set-ups")
    p.add_argument(
        "--steady-rounds",
        type=int,
        default=3,
        help="AltMin rounds of the per-call table (each followed by the bare rounds)",
    )
    p.add_argument(
        "--startup", default="", help="node counts of the start-up table (e.g. 8,100); alone, only that table"
    )
    p.add_argument("--startup-reps", type=int, default=3, help="simulations per node count of the start-up table")
    args = p.parse_args()
    counts = [int(c) for c in args.per_call.split(",") if c.strip()]
    if args.startup:
        startup([int(c) for c in args.startup.split(",") if c.strip()], args)
        return
    if args.only_per_call:
        per_call(counts, args)
        return
    print(
        f"torch threads {torch.get_num_threads()}, d={args.dim} k={args.rank} m={args.samples}, one private AltMin round (every user)",
        flush=True,
    )
    runs = {
        f"local ({args.users} users)": local(args.users, args),
        f"flower {args.nodes} nodes x {args.users // args.nodes}": flower(args.users, args.nodes, 0, args),
        f"flower {args.per_user_users} nodes x 1": flower(args.per_user_users, args.per_user_users, 1, args),
    }
    print(f"\n{'set-up':34s}{'Ray start-up':>14s}{'first round':>13s}{'AltMin round':>14s}{'per user':>12s}")
    for name, r in runs.items():
        print(
            f"{name:34s}{r['startup']:13.2f}s{r['first']:12.2f}s{r['round']:13.3f}s{r['round'] / r['users'] * 1e6:9.1f} µs"
        )
    loc, fl8, fl1 = runs.values()
    diff = float((fl8["U"].cpu() - loc["U"].cpu()).abs().max())
    print(f"\nmax |U_flower - U_local| = {diff:.2e} (same seed, float64)")
    print(f"8-node Flower round / local round             = {fl8['round'] / loc['round']:.2f}x   (target <= 3x)")
    print(
        f"8-node incl. first round / local incl. data   = {(fl8['first'] + fl8['round']) / (loc['first'] + loc['round']):.2f}x"
    )
    per_user_ratio = (fl1["round"] / fl1["users"]) / (fl8["round"] / fl8["users"])
    print(f"per-user cost, one node per user / 8 nodes     = {per_user_ratio:.0f}x   (target >= 100x)")
    print(
        f"Ray start-up: {fl8['startup']:.1f} s ({args.nodes} nodes), {fl1['startup']:.1f} s ({args.per_user_users} nodes); shutdown {fl8['shutdown']:.1f} s / {fl1['shutdown']:.1f} s"
    )
    if counts:
        per_call(counts, args)


if __name__ == "__main__":
    main()
