"""Where a protocol runs: the runtime and its settings, shared by every algorithm (``fedpers run`` flags)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fedpers.config import DpModel, field


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
    client_cpus: float = field(
        1.0, "CPUs per Flower node actor (a whole number: Flower's simulation settings hold one)", gt=0.0
    )
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
    dp_model: DpModel = field(
        DpModel.CENTRAL,
        "trust model: central (the server adds the noise), distributed (each node adds a share of Skellam "
        "noise inside secure aggregation; the server sees only the noisy sum), local (each unit's own noise on its node)",
    )
    bits: int = field(
        0,
        "dp_model distributed: bits of the modular sum, 4 to 32 (0: the fewest at which rounding costs at most 1 percent)",
        ge=0,
        le=32,
    )
    min_nodes: int = field(
        0,
        "dp_model distributed: nodes whose noise shares must reach the sum (0: all --nodes); a round with fewer "
        "survivors is discarded before any release",
        ge=0,
    )

    node_dropout: float = field(
        0.0,
        "dp_model distributed or local, local runtime: probability that each node drops out of each round "
        "(drawn from the run seed, independent of the data) to measure what dropouts cost",
        ge=0.0,
        lt=1.0,
    )

    def __post_init__(self) -> None:
        if self.node_dropout > 0 and DpModel(self.dp_model) is DpModel.CENTRAL:
            raise ValueError(
                "node_dropout needs --dp-model distributed or local (central has no node-side noise to size)"
            )
        if 0 < self.bits < 4:
            raise ValueError(f"bits must be 0 (auto) or in [4, 32]; got {self.bits}")
        if self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes must be in [0, nodes={self.nodes}]; got {self.min_nodes}")
        # Ray packs fractional shares on one GPU but never spreads one actor over part of several
        share = float(self.client_gpus)
        if share > 1.0 and not share.is_integer():
            raise ValueError(
                f"client_gpus must be in [0, 1] (a share of one GPU) or a whole number of GPUs; got {share}"
            )
