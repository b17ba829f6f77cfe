"""Where a protocol runs: the runtime and its settings, shared by every algorithm (``fedpers run`` flags)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fedpers.config import field


class Runtime(str, enum.Enum):
    LOCAL = "local"
    FLOWER = "flower"


@dataclass(frozen=True)
class RuntimeOptions:
    """Where the protocol runs; shared by every algorithm."""

    runtime: Runtime = field(Runtime.LOCAL, "local: batched on one device; flower: Flower simulation on Ray")
    nodes: int = field(8, "Flower SuperNodes (virtual clients), each holding a partition of the units", ge=1)
    users_per_node: int = field(0, "units per node (0: split all units evenly over --nodes)", ge=0)
    ray_address: str = field("", "attach the Flower simulation to this Ray cluster (default: start a local Ray)")
    client_cpus: float = field(1.0, "CPUs per Flower client actor", gt=0.0)
    client_gpus: float = field(
        0.0,
        "GPU share per Flower client actor: a fraction in [0, 1] packs 1/share node actors on one GPU "
        "(0.1: ten), a whole number gives each actor that many GPUs",
        ge=0.0,
    )
    sim_gpus: int = field(
        -1,
        "GPUs the Flower simulation's own Ray may schedule node actors on (-1: the GPUs torch sees; N: "
        "declare N, logical ones on a machine without, to check the resource arithmetic on CPU)",
        ge=-1,
    )
    min_fraction: float = field(
        1.0, "fraction of nodes that must reply acceptably for a round to proceed", gt=0.0, le=1.0
    )
    round_timeout: float = field(600.0, "seconds to wait for client replies in a round", gt=0.0)
    node_partitions: str = field(
        "",
        "deployment: 'NODE_ID=P ...' assigns partitions to authenticated SuperNode ids (from `flwr supernode "
        "register`); nodes not listed take part in nothing, whatever they claim",
    )
    server_data: bool = field(
        True,
        "evaluate the run and its baselines on the server's copy of the users' data (false in a deployment: the "
        "server holds none; result.json marks those metrics unavailable)",
    )
    secure_noise: bool = field(
        False,
        "draw DP noise from OS entropy with floating-point-safe samplers (OpenDP); not reproducible by seed. Default for flwr run",
    )

    def __post_init__(self) -> None:
        # Ray packs fractional shares on one GPU but never spreads one actor over part of several
        share = float(self.client_gpus)
        if share > 1.0 and not share.is_integer():
            raise ValueError(
                f"client_gpus must be in [0, 1] (a share of one GPU) or a whole number of GPUs; got {share}"
            )
