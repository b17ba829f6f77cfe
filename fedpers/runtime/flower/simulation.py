"""The Flower runtime's settings for Flower's simulation engine, and ``run_flower`` on a Grid.

A simulation runs through Flower's supported path (:mod:`fedpers.runtime.flower.managed`: a private
SuperLink in simulation mode and ``flwr run``): its ServerApp and ClientApp are the app's own
(``server/``, ``clients/``), loaded by Flower in its ``flwr-simulation`` process, and the ServerApp
calls :func:`run_flower` on the Grid Flower gives it. This module checks, before any process starts,
what the simulation's Ray can honour (:func:`check_resources`) and turns the runtime options into
Flower's simulation settings (:func:`federation_config`) and the Ray cluster to use (:func:`ray_address`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from flwr.serverapp import Grid

from fedpers.privacy import Privatizer
from fedpers.protocols.base import Protocol
from fedpers.runtime.driver import RoundRecord
from fedpers.runtime.flower import codec
from fedpers.runtime.flower.server import Federation, run_on_grid


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


def check_engine(options: Any, device: str = "cpu") -> None:
    """Refuse, before any process starts, what Flower's simulation cannot run (naming the fields): a
    GPU share Ray cannot honour (:func:`check_resources`), and a fractional CPU count per node actor
    (Flower's simulation settings hold whole CPUs: ``client-resources-num-cpus`` is an unsigned integer)."""
    cpus = float(options.client_cpus)
    if not cpus.is_integer() or cpus < 1:
        raise ValueError(
            f"client_cpus={cpus:g}: Flower's simulation gives each node actor a whole number of CPUs "
            "(its client-resources-num-cpus is an integer); use 1, 2, ..."
        )
    check_resources(options, device)


def federation_config(options: Any) -> dict[str, Any]:
    """The simulation's settings for ``flwr run --federation-config`` (Flower's ``SimulationConfig``):
    ``--nodes`` SuperNodes, each node actor's CPUs and GPU share and, when the simulation starts its
    own Ray, the GPUs that Ray may schedule node actors on (``--sim-gpus``, else the GPUs torch sees).
    Which Ray is the environment's ``RAY_ADDRESS`` (:func:`ray_address`): Flower's simulation calls
    ``ray.init()`` without an address."""
    out: dict[str, Any] = {
        "num-supernodes": int(options.nodes),
        "client-resources-num-cpus": int(options.client_cpus),
        "client-resources-num-gpus": float32_at_most(float(options.client_gpus)),
        "init-args-logging-level": "error",
        "init-args-log-to-driver": True,
    }
    gpus = simulation_gpus(options)
    if gpus is not None:  # Ray refuses resource counts when it joins an existing cluster
        out["init-args-num-gpus"] = gpus
    return out


def float32_at_most(share: float) -> float:
    """The largest 32-bit float not above ``share``: Flower's simulation settings hold a node actor's GPU
    share as a 32-bit float, and the nearest one to 0.1 is 0.10000000149, of which one GPU holds only 9
    (Flower's pool: int(1 / share); Ray: 10 of them exceed the GPU). Rounded down, 0.1 still packs ten."""
    import numpy as np

    near = np.float32(share)
    if float(near) > share:
        near = np.nextafter(near, np.float32(0))
    return float(near)


def ray_address(options: Any) -> str:
    """``RAY_ADDRESS`` of the simulation: ``--ray-address``, else ``$RAY_ADDRESS``, else ``local`` (a new
    Ray: without it ``ray.init()`` silently joins the last ``ray start`` cluster on this machine)."""
    return _attached(options) or "local"


def run_flower(
    job: codec.Job,
    num_units: int,
    protocol: Protocol,
    privatizer: Privatizer,
    options: Any,
    *,
    grid: Grid | None,
    device: torch.device | str = "cpu",
    on_round: Callable[[RoundRecord, Any], None] | None = None,
    on_discovery: Callable[[Federation], None] | None = None,
    progress: bool = True,
    checkpoint: Any = None,
) -> tuple[Any, list[RoundRecord]]:
    """Run ``protocol`` (``job``: what the nodes rebuild it from) over ``num_units`` units on ``grid``,
    the Grid Flower hands a ServerApp (a simulation's or a deployment's). A simulation is started by
    the app layer (:func:`fedpers.app.simulate`), never from here: its ServerApp comes here."""
    if grid is None:
        raise ValueError(
            "grid: run_flower runs on the Grid of a ServerApp; a Flower simulation is started with "
            "fedpers.app.simulate (what `fedpers run --runtime flower` does)"
        )
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
