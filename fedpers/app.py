"""The app layer between the Flower apps and the library: run config and experiment registry in, runtime calls out.

The Flower runtime (:mod:`fedpers.runtime.flower`) never looks an algorithm up; this module
does it for it:

- :func:`from_run_config`: what ``flwr run .`` hands the fedpers ServerApp
  (``context.run_config``) → experiment, config, options. An algorithm's fields travel in one
  string (``config='n_users=2000 rounds=2 cohorts="all"'``) or a TOML file (``config-file``),
  exactly like ``fedpers run ALGO --config FILE`` and its flags. Flower refuses a run-config key
  that ``[tool.flwr.app.config]`` of ``pyproject.toml`` does not declare, and the app declares only
  its own keys there; a field may still arrive as a flat key (``n-users``, ``epsilon``, …; "" = the
  algorithm's default) where a run config carries it (an in-process run, or an app whose pyproject
  declares it by hand): :func:`flat_keys` derives them from the config classes when asked.
- :func:`build_node`: the node builder injected into the ClientApp (job → protocol + units);
  :func:`make_client_app` is the ClientApp with it (``clients/client_app.py``).
- :func:`flower_job` and :func:`run_flower`: an experiment's run on the Flower runtime (what
  :func:`fedpers.runner.execute` calls).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpers import config as config_lib
from fedpers import experiments
from fedpers.config import DpModel, RunConfig
from fedpers.configs.runtime import Runtime, RuntimeOptions
from fedpers.privacy.accountant import Calibrations
from fedpers.privacy.distributed import NodeSidePrivatizer, RecordingCalibrations
from fedpers.runtime.distributed import node_side_privatizer, with_node_noise
from fedpers.runtime.flower.client import Node
from fedpers.runtime.flower.client import make_client_app as runtime_client_app
from fedpers.runtime.flower.codec import DATA_FILE, Job, Trust
from fedpers.runtime.flower.nodeside import NodeSettings, NodeSidePlan
from fedpers.seeds import derived_seed

if TYPE_CHECKING:
    from flwr.clientapp import ClientApp

    from fedpers.experiments.base import Experiment
    from fedpers.privacy import Privatizer
    from fedpers.protocols.base import Protocol
    from fedpers.runtime.driver import RoundRecord

ALGORITHM = "algorithm"
CONFIG = "config"
CONFIG_FILE = "config-file"
OUT = "out"
MIN_FRACTION = "min-fraction"
ROUND_TIMEOUT = "round-timeout"
USERS_PER_NODE = "users-per-node"
SECURE_NOISE = "secure-noise"
RESUME = "resume"
NODE_PARTITIONS = "node-partitions"
DP_MODEL = "dp-model"
BITS = "bits"
MIN_NODES = "min-nodes"
COLLUSION = "collusion"
NODES = "nodes"
KNOWN = (
    ALGORITHM,
    CONFIG,
    CONFIG_FILE,
    OUT,
    MIN_FRACTION,
    ROUND_TIMEOUT,
    USERS_PER_NODE,
    SECURE_NOISE,
    RESUME,
    NODE_PARTITIONS,
    DP_MODEL,
    BITS,
    MIN_NODES,
    COLLUSION,
    NODES,
)
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


@dataclass(frozen=True)
class ServerJob:
    experiment: Any
    cfg: Any
    options: Any
    out: Path | None
    resume: Path | None = None


def parse_pairs(text: str) -> dict[str, Any]:
    """``"a=1 b-c=2.5 d=\\"x\\" e=all"`` → ``{"a": 1, "b_c": 2.5, "d": "x", "e": "all"}`` (TOML values; bare words are strings)."""
    text = text.strip()
    out: dict[str, Any] = {}
    matched = "".join(m.group(0) for m in _PAIR.finditer(text))
    if matched.replace(" ", "") != text.replace(" ", ""):
        raise ValueError(f"{CONFIG} must be space-separated key=value pairs; got {text!r}")
    for key, raw in _PAIR.findall(text):
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip("'\"")
        out[key.replace("-", "_")] = value
    return out


UNSET = ""
"""A flat key's value when it is not given: the algorithm's default."""


def flat_keys() -> dict[str, list[str]]:
    """Every registered algorithm's config field as a run-config key (``n_users`` → ``n-users``),
    with the algorithms that have it (read from the config classes: :mod:`fedpers.configs`)."""
    out: dict[str, list[str]] = {}
    for name in sorted(experiments.ALGORITHMS):
        for f in fields(experiments.config_type(name)):
            out.setdefault(f.name.replace("_", "-"), []).append(name)
    return dict(sorted(out.items()))


def flat_values(run_config: Mapping[str, Any], experiment: Any, algorithm: str) -> dict[str, Any]:
    """The config fields given as flat keys (any value but :data:`UNSET`), as field names; a
    field the algorithm does not have is refused, naming the key."""
    own = {f.name for f in fields(experiment.config_type)}
    out: dict[str, Any] = {}
    for key, value in run_config.items():
        if key in KNOWN or (isinstance(value, str) and value == UNSET):
            continue
        name = key.replace("-", "_")
        if name not in own:
            raise ValueError(f"run config: {key} is not a field of {algorithm} (it has {', '.join(sorted(own))})")
        out[name] = value
    return out


def from_run_config(run_config: Mapping[str, Any]) -> ServerJob:
    """Build the job from a Flower run config; every problem is a ValueError naming the key."""
    registered = experiments.EXPERIMENTS  # every registered algorithm, imported now
    unknown = sorted(set(run_config) - set(KNOWN) - set(flat_keys()))
    if unknown:
        raise ValueError(
            f"run config: unknown key(s) {unknown}; known: {list(KNOWN)} and the algorithms' fields as flat keys"
        )
    resume = str(run_config.get(RESUME, ""))
    if resume:  # the run directory holds the configuration; nothing else may be given beside it
        fields_given = sorted(
            k for k, v in run_config.items() if k not in KNOWN and not (isinstance(v, str) and v == UNSET)
        )
        given = sorted(k for k in (CONFIG, CONFIG_FILE, OUT) if str(run_config.get(k, ""))) + fields_given
        if given:
            raise ValueError(f"run config: {RESUME} continues {resume!r} with its own configuration; drop {given}")
        return ServerJob(None, None, None, None, Path(resume))
    algorithm = str(run_config.get(ALGORITHM, ""))
    if algorithm not in registered:
        raise ValueError(f"run config: {ALGORITHM} must be one of {sorted(registered)}; got {algorithm!r}")
    experiment = registered[algorithm]
    values: dict[str, Any] = {}
    config_file = str(run_config.get(CONFIG_FILE, ""))
    if config_file:
        try:
            values.update({k.replace("-", "_"): v for k, v in tomllib.loads(Path(config_file).read_text()).items()})
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"run config: {CONFIG_FILE}: cannot read {config_file!r}: {e}") from None
    pairs = parse_pairs(str(run_config.get(CONFIG, "")))
    flat = flat_values(run_config, experiment, algorithm)
    twice = sorted(set(pairs) & set(flat))
    if twice:
        raise ValueError(f"run config: {twice} given both as flat keys and in {CONFIG}; give each once")
    values.update(pairs)
    values.update(flat)
    cfg = config_lib.build(experiment.config_type, values)
    options = config_lib.build(
        RuntimeOptions,
        {
            **_trust_model(run_config),
            "runtime": Runtime.FLOWER,
            "min_fraction": run_config.get(MIN_FRACTION, 1.0),
            "round_timeout": run_config.get(ROUND_TIMEOUT, 600.0),
            "users_per_node": run_config.get(USERS_PER_NODE, 0),
            "secure_noise": run_config.get(SECURE_NOISE, True),
            "node_partitions": str(run_config.get(NODE_PARTITIONS, "")),
        },
    )
    out = str(run_config.get(OUT, ""))
    return ServerJob(experiment, cfg, options, Path(out) if out else None)


def _trust_model(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The trust model's options from the run config: ``dp-model``, ``bits``, ``min-nodes``, ``collusion`` and ``nodes``
    (the SuperNodes holding partitions; 0: as many as ``node-partitions`` lists). The nodes derive the
    plan they noise with from these and the job, as in the simulation."""
    model = str(run_config.get(DP_MODEL, "central") or "central")
    out: dict[str, Any] = {
        "dp_model": model,
        "bits": run_config.get(BITS, 0),
        "min_nodes": run_config.get(MIN_NODES, 0),
        "collusion": run_config.get(COLLUSION, 0),
    }
    nodes = run_config.get(NODES, 0)
    if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes == 0:
        listed = len(str(run_config.get(NODE_PARTITIONS, "")).split())
        if model != "central" and not listed:
            raise ValueError(
                f"run config: {NODES} must name the SuperNodes holding partitions (nodes=N, N ≥ 1) with "
                f"{DP_MODEL}={model}, or {NODE_PARTITIONS} must list them: the nodes' noise shares are sized for them"
            )
        if listed:
            out["nodes"] = listed
    else:
        out["nodes"] = nodes
    return out


def build_node(job: Job, data_file: str = "", entries: Mapping[str, tuple[str, str, str]] | None = None) -> Node:
    """The node for ``job``: the registered algorithm's config and protocol (noise from the
    server's calibrations: a node runs no accountant), and a loader of its units by global id.
    ``data_file`` (node config) replaces the config's data path. ``entries``: registry entries
    (name → module, class, description) the node registers first: an algorithm registered in
    the driving process is unknown to a node process until it imports the module itself."""
    if entries and job.algorithm in entries:
        experiments.register(job.algorithm, *entries[job.algorithm])
    if job.algorithm not in experiments.ALGORITHMS:
        raise ValueError(
            f"algorithm {job.algorithm!r} is unknown on this node; known: {sorted(experiments.ALGORITHMS)}"
        )
    experiment = experiments.experiment(job.algorithm)
    values = json.loads(job.config_json)
    if data_file:
        if "data" not in {f.name for f in fields(experiment.config_type)}:
            raise ValueError(f"{DATA_FILE}: algorithm {job.algorithm!r} reads no data files")
        values["data"] = data_file
    cfg = config_lib.build(experiment.config_type, values)
    protocol = experiment.protocol(
        cfg, Calibrations(json.loads(job.calibrations_json))
    )  # the server's z: no accountant here

    def node_side(trust: Any) -> Any:
        """The distributed/local plan this node derives from the job alone for the job's trust model, and the
        protocol the server updates with (what the server sends must equal the plan: a node never noises by
        the server's word, and it derives each round's broadcast with that protocol from the releases)."""
        recording = RecordingCalibrations(json.loads(job.calibrations_json))
        public = experiment.protocol(cfg, recording)
        options = RuntimeOptions(
            dp_model=DpModel(trust.dp_model),
            nodes=trust.nodes,
            min_nodes=trust.min_nodes,
            bits=trust.bits,
            users_per_node=trust.users_per_node,
            collusion=trust.collusion,
        )
        rotation = derived_seed(cfg.seed, "rotation")
        units = experiment.num_units(cfg)
        privatizer = node_side_privatizer(public, units, recording, options, 0, rotation)
        return NodeSidePlan(privatizer.plan, with_node_noise(public, privatizer, units))

    return Node(
        protocol,
        lambda ids: experiment.units(cfg, ids),
        num_units=experiment.num_units(cfg),
        node_side=node_side,
    )


def make_client_app(
    entries: Mapping[str, tuple[str, str, str]] | None = None, *, noise_seed: int | None = None
) -> ClientApp:
    """The fedpers ClientApp: the Flower runtime's node side with :func:`build_node` injected.

    ``entries`` (registry entries, see :func:`fedpers.experiments.register`) travel inside the
    app to the simulation's node processes (Ray actors), which register them before the lookup;
    the names on the wire are only ever looked up, never imported. ``noise_seed``: the seeded noise
    stream of the nodes under distributed or local DP in a simulation, set by the lab that builds this
    app (the local runtime's bits); None, each node's OS entropy. A node never takes a seed from a message."""
    settings = NodeSettings(noise_seed)
    if not entries:
        return runtime_client_app(build_node, settings)
    return runtime_client_app(partial(build_node, entries=dict(entries)), settings)


def flower_job(
    experiment: Experiment[Any, Any],
    cfg: RunConfig,
    protocol: Protocol,
    calibrations: Mapping[str, float] | None = None,
    options: Any = None,
) -> Job:
    """What the nodes rebuild ``protocol`` from: algorithm name, config, protocol digest, the
    noise calibrations the server's accountant chose (nodes rebuild the protocol without one):
    ``calibrations`` if given, else recorded by building the protocol once more, and the run's trust
    model from the runtime ``options`` (central when None), which every node pins."""
    if calibrations is None:
        recorded = Calibrations()
        experiment.protocol(cfg, recorded)
        calibrations = recorded.table
    return Job.of(experiment.name, cfg, protocol, calibrations, None if options is None else Trust.of(options))


def run_flower(
    experiment: Experiment[Any, Any],
    cfg: RunConfig,
    protocol: Protocol,
    privatizer: Privatizer,
    options: RuntimeOptions,
    *,
    client_app: ClientApp | None = None,
    calibrations: Mapping[str, float] | None = None,
    node_protocol: Protocol | None = None,
    **kwargs: Any,
) -> tuple[Any, list[RoundRecord]]:
    """``experiment``'s run on the Flower runtime (:func:`fedpers.runtime.flower.run_flower`: on
    ``grid=`` if given, else a simulation whose nodes run ``client_app`` or :func:`make_client_app`);
    ``calibrations``: the noise multipliers ``protocol`` was built with (see :func:`flower_job`);
    ``node_protocol``: what the nodes build from them, when the server's differs (distributed or local DP)."""
    from fedpers.runtime.flower.simulation import run_flower as run  # Ray: a node process never imports it

    if kwargs.get("grid") is None and client_app is None:
        entry = experiments.ALGORITHMS.get(experiment.name)
        seed = privatizer.noise_seed if isinstance(privatizer, NodeSidePrivatizer) and not privatizer.secure else None
        client_app = make_client_app({experiment.name: entry} if entry is not None else None, noise_seed=seed)
    job = flower_job(experiment, cfg, node_protocol if node_protocol is not None else protocol, calibrations, options)
    return run(
        job,
        experiment.num_units(cfg),
        protocol,
        privatizer,
        options,
        device=cfg.device,
        client_app=client_app,
        **kwargs,
    )
