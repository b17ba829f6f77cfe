"""``run_flower``: the protocol in Flower's simulation engine on Ray, or on a Grid already given.

The ServerApp built here runs in this process (its closure holds the protocol, the
privatizer and the callbacks); the ClientApp (given by the caller: it carries the node
builder, see :mod:`fedpers.runtime.flower.client`) runs in Ray actors, which import fedpers
from the same checkout (its root is put on ``sys.path``, which Flower's Ray backend
passes to every worker as ``PYTHONPATH`` in the job's runtime_env).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

import fedpers
from fedpers.privacy import Privatizer
from fedpers.protocols.base import Protocol
from fedpers.runtime.driver import RoundRecord
from fedpers.runtime.flower import codec
from fedpers.runtime.flower.partition import unit_ranges
from fedpers.runtime.flower.server import Federation, run_on_grid
from fedpers.runtime.progress import say

CHECKOUT = str(Path(fedpers.__file__).resolve().parents[1])


def _attached(options: Any) -> str:
    """The Ray cluster the simulation attaches to ("" when it starts its own)."""
    return str(options.ray_address or os.environ.get("RAY_ADDRESS", ""))


def simulation_gpus(options: Any) -> int | None:
    """GPUs the simulation's own Ray declares: ``--sim-gpus`` if set, else the GPUs torch sees;
    None when attached to a cluster (it declares its own: ``ray start --num-gpus N``)."""
    if _attached(options):
        return None
    return int(options.sim_gpus) if options.sim_gpus >= 0 else torch.cuda.device_count()


def actor_capacity(client_cpus: float, client_gpus: float, cpus: float, gpus: float) -> int:
    """Node actors Ray runs at once on one machine of ``cpus`` CPUs and ``gpus`` GPUs: Flower's own
    pool arithmetic (flwr 1.41 ``pool_size_from_resources``), so ``client_gpus=0.1`` on one GPU
    caps the pool at 10 actors whatever the CPU count allows."""
    actors = int(cpus / client_cpus)
    if client_gpus > 0:
        actors = min(actors, int(gpus / client_gpus)) if gpus else 0
    return actors


def check_resources(options: Any, device: str = "cpu") -> None:
    """Refuse, before Ray starts, a GPU share the simulation cannot honour (naming the fields)."""
    share = float(options.client_gpus)
    gpus = simulation_gpus(options)
    if options.sim_gpus >= 0 and gpus is None:
        raise ValueError(
            f"sim_gpus={options.sim_gpus} declares the GPUs of the simulation's own Ray, but it attaches to the cluster "
            f"at ray_address={_attached(options)!r}, which declares its own (`ray start --num-gpus N`); leave sim_gpus at -1"
        )
    if gpus is not None and share > 0 and gpus == 0:
        raise ValueError(
            f"client_gpus={share} but the simulation's Ray has no GPU (sim_gpus={options.sim_gpus}, torch sees none); "
            "set client_gpus 0, declare logical GPUs with --sim-gpus N (checks the resource arithmetic on CPU), "
            "or attach a GPU cluster with --ray-address"
        )
    if gpus is not None and share > gpus:
        raise ValueError(
            f"client_gpus={share} does not fit the simulation's {gpus} GPU(s) (sim_gpus={options.sim_gpus}): "
            "no node actor could start; lower client_gpus or raise sim_gpus"
        )
    if str(device).startswith("cuda"):
        if share == 0:
            raise ValueError(
                f"device={device} on the Flower simulation needs client_gpus > 0: Ray hides the GPUs from node actors "
                "that ask for none (e.g. --client-gpus 0.1 packs ten node actors on each GPU)"
            )
        if str(device) != "cuda":
            raise ValueError(
                f"device={device}: on the Flower simulation Ray gives each node actor its own GPU share; use device cuda"
            )


def backend_config(options: Any) -> dict[str, Any]:
    """Flower's Ray backend settings: ``--ray-address``, else ``$RAY_ADDRESS``, else a new local Ray
    told how many GPUs it may schedule node actors on (``--sim-gpus``, else the GPUs torch sees)."""
    # "local" starts a new Ray: without it ray.init() silently joins the last `ray start` cluster on this machine.
    address = _attached(options) or "local"
    init_args: dict[str, Any] = {"logging_level": "error", "log_to_driver": True, "address": address}
    gpus = simulation_gpus(options)
    if gpus is not None:  # Ray refuses resource counts when it joins an existing cluster
        init_args["num_gpus"] = gpus
    return {
        "client_resources": {"num_cpus": float(options.client_cpus), "num_gpus": float(options.client_gpus)},
        "init_args": init_args,
    }


@contextlib.contextmanager
def _flower_logs(level: int) -> Iterator[None]:
    logger = logging.getLogger("flwr")
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def _root_cause(e: BaseException) -> BaseException:
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def in_process_simulation() -> Callable[..., None]:
    """Flower's in-process simulation entry, ``flwr.simulation.run_simulation``: deprecated (flwr
    1.42 warns on every call; still present in 1.42.0) but the only public one that takes a
    ServerApp and a ClientApp object. Flower's supported route, ``flwr run`` against ``flower-superlink
    --simulation``, loads both apps from the app's components in a ``flwr-simulation`` process,
    so this run's protocol, privatizer and callbacks cannot reach it (docs/flower.md §1, "Why
    `run_simulation`"); fedpers runs that route as ``flwr run .`` (docs/flower.md §2). A Flower
    without the function is refused here, before Ray starts."""
    import flwr
    import flwr.simulation

    found = getattr(flwr.simulation, "run_simulation", None)
    if found is None:
        raise RuntimeError(
            f"flwr {getattr(flwr, '__version__', '?')} has no flwr.simulation.run_simulation, which "
            "`--runtime flower` runs in this process; run the simulation through Flower's supported route "
            "instead: `flwr run .` against a `flower-superlink --simulation` (docs/flower.md section 2)"
        )
    return cast(Callable[..., None], found)


def run_flower(
    job: codec.Job,
    num_units: int,
    protocol: Protocol,
    privatizer: Privatizer,
    options: Any,
    *,
    device: torch.device | str = "cpu",
    on_round: Callable[[RoundRecord, Any], None] | None = None,
    on_discovery: Callable[[Federation], None] | None = None,
    progress: bool = True,
    grid: Grid | None = None,
    client_app: ClientApp | None = None,
    checkpoint: Any = None,
) -> tuple[Any, list[RoundRecord]]:
    """Run ``protocol`` (``job``: what the nodes rebuild it from) over ``num_units`` units through
    Flower: on ``grid`` if given (inside a ServerApp), else in a new simulation whose nodes run
    ``client_app`` (:func:`fedpers.app.make_client_app`; tests inject faulty clients).
    """
    if grid is not None:
        return run_on_grid(
            grid,
            job,
            num_units,
            protocol,
            privatizer,
            options,
            device=device,
            on_round=on_round,
            on_discovery=on_discovery,
            progress=progress,
            checkpoint=checkpoint,
        )
    if client_app is None:
        raise ValueError("client_app: a simulation needs the ClientApp its nodes run (fedpers.app.make_client_app())")
    unit_ranges(num_units, options.nodes, options.users_per_node)  # refuse a bad split before Ray starts
    check_resources(options, str(device))
    run_simulation = in_process_simulation()
    outcome: dict[str, Any] = {}
    stopped = threading.Event()
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            outcome["result"] = run_on_grid(
                grid,
                job,
                num_units,
                protocol,
                privatizer,
                options,
                device=device,
                expected_nodes=options.nodes,
                on_round=on_round,
                on_discovery=on_discovery,
                progress=progress,
                stop=stopped.is_set,
                checkpoint=checkpoint,
            )
        except BaseException as e:
            outcome["error"] = e

    if CHECKOUT not in sys.path:
        sys.path.insert(0, CHECKOUT)
    say(f"flower: starting the simulation engine (Ray) for {options.nodes} nodes …", progress)
    try:
        with _flower_logs(logging.WARNING):
            run_simulation(server_app, client_app, options.nodes, backend_config=backend_config(options))
    except RuntimeError as e:
        root = _root_cause(e)
        if "result" in outcome:  # the engine failed after the ServerApp finished: keep the result
            logging.getLogger("fedpers.flower").warning("Flower simulation error after the run completed: %s", root)
            return outcome["result"]
        kind = ValueError if isinstance(root, ValueError) else RuntimeError
        raise kind(
            f"the Flower simulation failed ({type(root).__name__}: {root}); client_cpus={options.client_cpus}, "
            f"client_gpus={options.client_gpus}, sim_gpus={options.sim_gpus}"
        ) from e
    finally:
        stopped.set()  # a ServerApp thread still waiting for replies gives up
    if "error" in outcome:
        raise outcome["error"]
    if "result" not in outcome:
        raise RuntimeError("the Flower simulation ended without running the ServerApp")
    return outcome["result"]
