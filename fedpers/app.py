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
- :func:`flower_job` and :func:`run_flower`: an experiment's run on a ServerApp's Grid (what
  :func:`fedpers.runner.execute` calls inside the fedpers ServerApp), or on Flower's simulation with
  the server loop and the nodes handed over as objects (:func:`simulate_objects`);
- :func:`simulate`: a run through Flower's supported simulation path (this fedpers staged as a Flower
  app, :func:`stage_app`, and run by ``flwr run`` on a private simulation SuperLink), what
  ``fedpers run --runtime flower`` does.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Mapping
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
NODES = "nodes"
JOB = "job"
RUN_CONFIG_DEFAULTS: dict[str, Any] = {
    ALGORITHM: "altmin",
    CONFIG: "",
    CONFIG_FILE: "",
    OUT: "",
    MIN_FRACTION: 1.0,
    ROUND_TIMEOUT: 600.0,
    USERS_PER_NODE: 0,
    SECURE_NOISE: True,
    RESUME: "",
    NODE_PARTITIONS: "",
    DP_MODEL: "central",
    BITS: 0,
    MIN_NODES: 0,
    NODES: 0,
    JOB: "",
}
"""The app's run-config keys and their defaults: ``[tool.flwr.app.config]`` of ``pyproject.toml`` declares
exactly these (a test holds the two equal), and a staged app's pyproject is written from them."""
KNOWN = tuple(RUN_CONFIG_DEFAULTS)
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
    job_file = str(run_config.get(JOB, ""))
    if job_file:
        return from_job_file(run_config, Path(job_file))
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


def from_job_file(run_config: Mapping[str, Any], path: Path) -> ServerJob:
    """The job a ``job`` file holds: a run's ``config.json`` (its algorithm, its fields and its runtime
    options, as :func:`simulate` writes it for the simulation's ServerApp); only ``out`` may be given
    beside it (any other key away from its default is refused, naming it: the file holds the whole run)."""
    given = sorted(
        k
        for k, v in run_config.items()
        if k not in (JOB, OUT) and v != RUN_CONFIG_DEFAULTS.get(k, UNSET) and not (isinstance(v, str) and v == UNSET)
    )
    if given:
        raise ValueError(f"run config: {JOB} holds the whole run (algorithm, fields, runtime options); drop {given}")
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"run config: {JOB}: cannot read {str(path)!r}: {e}") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("runtime", {}), dict):
        raise ValueError(f"run config: {JOB}: {str(path)!r} must hold a JSON object as a run's config.json does")
    saved = dict(saved)
    algorithm = saved.pop("algorithm", None)
    if algorithm not in experiments.ALGORITHMS:
        raise ValueError(
            f"run config: {JOB}: algorithm must be one of {sorted(experiments.ALGORITHMS)}; got {algorithm!r}"
        )
    found = experiments.experiment(str(algorithm))
    runtime = {**saved.pop("runtime", {}), "runtime": Runtime.FLOWER}
    cfg = config_lib.build(found.config_type, saved)
    options = config_lib.build(RuntimeOptions, runtime)
    out = str(run_config.get(OUT, ""))
    return ServerJob(found, cfg, options, Path(out) if out else None)


def _trust_model(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The trust model's options from the run config: ``dp-model``, ``bits``, ``min-nodes`` and ``nodes``
    (the SuperNodes holding partitions; 0: as many as ``node-partitions`` lists). The nodes derive the
    plan they noise with from these and the job, as in the simulation."""
    model = str(run_config.get(DP_MODEL, "central") or "central")
    out: dict[str, Any] = {
        "dp_model": model,
        "bits": run_config.get(BITS, 0),
        "min_nodes": run_config.get(MIN_NODES, 0),
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
    grid: Any = None,
    client_app: ClientApp | None = None,
    calibrations: Mapping[str, float] | None = None,
    node_protocol: Protocol | None = None,
    extra: Mapping[str, Path] | None = None,
    **kwargs: Any,
) -> tuple[Any, list[RoundRecord]]:
    """``experiment``'s run on the Flower runtime: on ``grid`` (a ServerApp's:
    :func:`fedpers.runtime.flower.run_flower`), else in Flower's simulation through its supported path
    (:func:`simulate_objects`), the server loop holding ``protocol`` and ``privatizer`` and the nodes
    running ``client_app`` (default :func:`make_client_app`; tests inject faulty ones; ``extra``: what
    else its code needs in the app, name → file or folder). The privatizer comes back with what the
    simulation's server drew (its ledger and generators); callbacks (``on_round``, ...) are refused
    there: they would run in the simulation's process. ``calibrations``: the noise multipliers
    ``protocol`` was built with (see :func:`flower_job`); ``node_protocol``: what the nodes build from
    them, when the server's differs (distributed or local DP)."""
    from fedpers.runtime.flower.simulation import run_flower as run  # Ray: a node process never imports it

    job = flower_job(experiment, cfg, node_protocol if node_protocol is not None else protocol, calibrations, options)
    if grid is not None:
        return run(
            job, experiment.num_units(cfg), protocol, privatizer, options, grid=grid, device=cfg.device, **kwargs
        )
    given = sorted(k for k, v in kwargs.items() if v is not None and k != "progress")
    if given:
        raise ValueError(
            f"{given}: in a simulation the server loop runs in Flower's process, where a callback's effects stay; "
            "return what you need from a server function (fedpers.app.simulate_objects)"
        )
    if client_app is None:
        client_app = make_client_app(plugin_entries(experiment.name), noise_seed=node_noise_seed(privatizer))
    num_units, device = experiment.num_units(cfg), cfg.device

    def server(grid: Any, context: Any) -> tuple[Any, list[RoundRecord], Privatizer]:
        state, records = run(job, num_units, protocol, privatizer, options, grid=grid, device=device, progress=False)
        return state, records, privatizer

    check_engine_and_split(options, num_units, str(device))
    state, records, drawn = simulate_objects(
        server, client_app, options, entries=plugin_entries(experiment.name), extra=extra
    )
    privatizer.__dict__.update(drawn.__dict__)  # the ledger and generators the simulation's server left
    return state, records


# ----- Flower's supported simulation path: the app staged as a FAB, run on a private SuperLink -----------
ENTRIES_TABLE = ("tool", "fedpers", "algorithms")
"""Where an app's ``pyproject.toml`` declares algorithms registered beside the built-in ones:
``[tool.fedpers.algorithms] NAME = [MODULE, CLASS, DESCRIPTION]`` (the module ships in the FAB)."""
COMPONENTS = {"serverapp": "server.server_app:app", "clientapp": "clients.client_app:app"}
APP_PACKAGES = ("fedpers", "clients", "server")


def app_entries(app_dir: Path) -> dict[str, tuple[str, str, str]]:
    """The algorithms ``app_dir/pyproject.toml`` registers (:data:`ENTRIES_TABLE`): what the app's
    ServerApp and ClientApp register before any lookup (the process Flower runs them in knows only the
    built-in registry). Nothing is imported here."""
    path = app_dir / "pyproject.toml"
    if not path.is_file():
        return {}
    table: Any = tomllib.loads(path.read_text())
    for key in ENTRIES_TABLE:
        table = table.get(key, {}) if isinstance(table, dict) else {}
    out: dict[str, tuple[str, str, str]] = {}
    for name, entry in dict(table).items():
        if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(v, str) for v in entry)):
            raise ValueError(f"{path}: [{'.'.join(ENTRIES_TABLE)}] {name} must be [module, class, description]")
        out[str(name)] = (entry[0], entry[1], entry[2])
    return out


def register_app_entries(app_dir: Path) -> dict[str, tuple[str, str, str]]:
    """Register :func:`app_entries` of ``app_dir`` (an entry already registered alike is left as it is)."""
    entries = app_entries(app_dir)
    for name, (module, cls, description) in entries.items():
        experiments.register(name, module, cls, description)
    return entries


def _top_level(module: str) -> tuple[str, Path]:
    """The top-level package (or module) of ``module`` and where it lives."""
    import importlib.util

    top = module.split(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None:
        raise ValueError(f"algorithm module {module!r}: {top!r} cannot be found to ship in the Flower app")
    if spec.submodule_search_locations:
        return top, Path(next(iter(spec.submodule_search_locations)))
    if spec.origin is None:
        raise ValueError(f"algorithm module {module!r}: {top!r} has no file to ship in the Flower app")
    return top, Path(spec.origin)


def stage_app(
    dest: Path,
    entries: Mapping[str, tuple[str, str, str]] | None = None,
    *,
    components: Mapping[str, str] | None = None,
    extra: Mapping[str, Path] | None = None,
) -> Path:
    """``dest`` made a Flower app of this fedpers: copies of the ``fedpers``, ``clients`` and ``server``
    packages this process imports (the code the run ships, whatever the working directory holds), the
    packages of ``entries`` (registered algorithms outside fedpers) and ``extra`` (name in the app →
    file or folder), and a ``pyproject.toml`` declaring the components (the fedpers apps unless
    ``components`` says otherwise), the run config's keys (:data:`RUN_CONFIG_DEFAULTS`) and the entries."""
    import shutil

    import tomli_w

    import fedpers

    root = Path(fedpers.__file__).resolve().parents[1]
    sources = {name: root / name for name in APP_PACKAGES}
    for module, _, _ in (entries or {}).values():
        top, where = _top_level(module)
        if top not in sources:
            sources[top if where.is_dir() else where.name] = where
    sources.update(extra or {})
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name, source in sources.items():
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        else:
            shutil.copy2(source, dest / name)
    include = sorted(f"{name}/**" if (dest / name).is_dir() else name for name in sources)
    project: dict[str, Any] = {
        "project": {"name": "fedpers", "version": fedpers.__version__, "description": "fedpers as a Flower app"},
        "tool": {
            "flwr": {
                "app": {
                    "publisher": "fedpers",
                    "fab-include": include,
                    "components": dict(components or COMPONENTS),
                    "config": dict(RUN_CONFIG_DEFAULTS),
                }
            }
        },
    }
    if entries:
        project["tool"]["fedpers"] = {ENTRIES_TABLE[-1]: {k: list(v) for k, v in entries.items()}}
    (dest / "pyproject.toml").write_text(tomli_w.dumps(project))
    return dest


def node_noise_seed(privatizer: Any) -> int | None:
    """The seed of the nodes' noise a lab gives its simulation's nodes under distributed or local DP with
    seeded noise (the local runtime's bits); None otherwise (each node's OS entropy)."""
    if isinstance(privatizer, NodeSidePrivatizer) and not privatizer.secure:
        return int(privatizer.noise_seed)
    return None


def plugin_entries(name: str) -> dict[str, tuple[str, str, str]]:
    """``{name: entry}`` when algorithm ``name`` is registered from outside fedpers (its module must
    ship in the Flower app), else nothing."""
    entry = experiments.ALGORITHMS.get(name)
    return {name: entry} if entry is not None and not entry[0].startswith("fedpers.") else {}


ERROR_LINE = "fedpers error: "
"""What the ServerApp logs (then raises) when the run fails: this, then ``{"type": ..., "message": ...}``."""


def error_line(error: BaseException) -> str:
    return ERROR_LINE + json.dumps({"type": type(error).__name__, "message": str(error)})


def raise_logged_error(log: str) -> None:
    """Raise the last error the ServerApp logged (:func:`error_line`) as its own kind: a ValueError stays a
    ValueError (a refused input), a failed round a :class:`~fedpers.runtime.driver.RoundFailed`."""
    from fedpers.runtime.driver import RoundFailed

    found = None
    for line in log.splitlines():
        at = line.find(ERROR_LINE)
        if at >= 0:
            with_error = line[at + len(ERROR_LINE) :].strip()
            try:
                found = json.loads(with_error)
            except ValueError:
                continue
    if not isinstance(found, dict):
        return
    kind, message = str(found.get("type", "")), str(found.get("message", ""))
    if kind == "ValueError":
        raise ValueError(message)
    if kind == "RoundFailed":
        raise RoundFailed(message)
    raise RuntimeError(f"the Flower simulation's ServerApp failed: {kind}: {message}")


def simulate(
    experiment: Experiment[Any, Any],
    saved: Mapping[str, Any],
    options: RuntimeOptions,
    out: Path,
    *,
    resume: bool = False,
    rounds: int,
    final_phase: str,
    progress: bool = True,
    echo: bool = False,
    noise_seed: int | None = None,
) -> None:
    """Run ``saved`` (a run's ``config.json``: algorithm, fields, runtime options) through Flower's
    supported simulation path: this fedpers staged as a Flower app, run by ``flwr run`` on a private
    simulation SuperLink (:func:`fedpers.runtime.flower.managed.run_app`), whose ServerApp (the fedpers
    one, ``server/server_app.py``) writes the run directory ``out`` (``resume``: continues the run there)
    exactly as a run in this process would. The nodes run the ClientApp this process builds
    (:func:`make_client_app`, handed over as an object: :mod:`fedpers.runtime.flower.objects`), with the
    lab's seed of the nodes' noise under distributed or local DP (``noise_seed``; None: each node's OS
    entropy), as the lab builds a simulation's nodes. Progress is read from ``out`` as it grows; an
    error of the ServerApp is raised here as its own kind;
    every process of the simulation is stopped before this returns or raises."""
    from fedpers.results.provenance import LAUNCHED_BY, launch_record
    from fedpers.runtime.flower import managed
    from fedpers.runtime.flower.simulation import federation_config, ray_address

    cfg = config_lib.build(
        experiment.config_type, {k: v for k, v in saved.items() if k not in ("algorithm", "runtime")}
    )
    check_engine_and_split(options, experiment.num_units(cfg), str(getattr(cfg, "device", "cpu")))
    follow = managed.RoundFollower(
        out,
        rounds=rounds,
        desc=experiment.name,
        nodes=options.nodes,
        final=f"{experiment.name}: evaluating {final_phase}",
        enabled=progress,
    )
    import cloudpickle

    from fedpers.runtime.flower import objects

    entries = plugin_entries(experiment.name)
    with managed.private_home() as home:
        where = home / "objects"
        where.mkdir(mode=0o700)
        with open(where / objects.CLIENT, "wb") as f:
            cloudpickle.dump(make_client_app(entries, noise_seed=noise_seed), f)
        components = {**COMPONENTS, "clientapp": OBJECT_COMPONENTS["clientapp"]}
        app = stage_app(home / "app", entries, components=components)
        if resume:
            run_config: dict[str, Any] = {RESUME: str(out)}
        else:
            (home / "job.json").write_text(json.dumps(dict(saved)))
            run_config = {JOB: str(home / "job.json"), OUT: str(out)}
        try:
            outcome = managed.run_app(
                app,
                run_config,
                federation_config(options),
                home,
                ray_address=ray_address(options),
                watch=follow,
                echo=echo,
                env={LAUNCHED_BY: launch_record(), objects.OBJECTS: str(where)},  # provenance: this command
            )
        except managed.SimulationFailed as e:
            raise_logged_error(managed.read_log(home))
            raise RuntimeError(str(e)) from None
        finally:
            follow.close()
        raise_logged_error(outcome.log)
        if not (out / "result.json").is_file():
            raise RuntimeError(
                f"the Flower simulation ended without a result in {out}; its log ends:\n"
                + "\n".join(outcome.log.splitlines()[-40:])
            )


def check_engine_and_split(options: RuntimeOptions, num_units: int, device: str) -> None:
    """What a simulation refuses before any process starts: resources Flower's simulation cannot give
    (:func:`fedpers.runtime.flower.simulation.check_engine`) and a split of the units over the nodes that
    does not hold (:func:`fedpers.runtime.flower.partition.unit_ranges`)."""
    from fedpers.runtime.flower.partition import unit_ranges
    from fedpers.runtime.flower.simulation import check_engine

    check_engine(options, device)
    unit_ranges(num_units, options.nodes, options.users_per_node)


OBJECT_COMPONENTS = {
    "serverapp": "fedpers.runtime.flower.objects:server_app",
    "clientapp": "fedpers.runtime.flower.objects:client_app",
}


def simulate_objects(
    server: Callable[[Any, Any], Any],
    client_app: ClientApp,
    options: RuntimeOptions,
    *,
    entries: Mapping[str, tuple[str, str, str]] | None = None,
    extra: Mapping[str, Path] | None = None,
    echo: bool = False,
) -> Any:
    """``server(grid, context)`` as the ServerApp and ``client_app`` on ``options.nodes`` nodes, through
    Flower's supported simulation path (a private simulation SuperLink and ``flwr run``): both are
    pickled into the run's private directory and run by :mod:`fedpers.runtime.flower.objects`, which
    this fedpers, staged as the app with the packages of ``entries`` (algorithms registered from
    outside fedpers) and ``extra`` (name in the app → file or folder: modules the objects' code
    imports), names as its components. Returns what ``server`` returned; raises what it
    raised."""
    import cloudpickle

    from fedpers.runtime.flower import managed, objects
    from fedpers.runtime.flower.simulation import federation_config, ray_address

    with managed.private_home() as home:
        where = home / "objects"
        where.mkdir(mode=0o700)
        for name, value in ((objects.SERVER, server), (objects.CLIENT, client_app)):
            with open(where / name, "wb") as f:
                cloudpickle.dump(value, f)
        app = stage_app(home / "app", entries, components=OBJECT_COMPONENTS, extra=extra)
        failure: BaseException | None = None
        try:
            managed.run_app(
                app,
                {},
                federation_config(options),
                home,
                ray_address=ray_address(options),
                echo=echo,
                env={objects.OBJECTS: str(where)},
            )
        except managed.SimulationFailed as e:
            failure = e
        if (where / objects.ERROR).is_file():
            with open(where / objects.ERROR, "rb") as f:
                raise cloudpickle.load(f)
        if failure is not None:
            raise RuntimeError(str(failure)) from None
        if not (where / objects.RESULT).is_file():
            raise RuntimeError(
                "the Flower simulation ended without its server's result; its log ends:\n"
                + "\n".join(managed.read_log(home).splitlines()[-40:])
            )
        with open(where / objects.RESULT, "rb") as f:
            return cloudpickle.load(f)
