"""What ``flwr run .`` hands the fedpers ServerApp: ``context.run_config`` → experiment, config, options.

Flower only accepts run-config keys declared in ``[tool.flwr.app.config]`` of
``pyproject.toml``, so the algorithm's own fields travel generically in one string
(``config='n_users=2000 rounds=2 cohorts="all"'``) or a TOML file (``config-file``),
exactly like ``fedpers run ALGO --config FILE`` and its flags.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fedpers import config as config_lib

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
KNOWN = (ALGORITHM, CONFIG, CONFIG_FILE, OUT, MIN_FRACTION, ROUND_TIMEOUT, USERS_PER_NODE, SECURE_NOISE, RESUME, NODE_PARTITIONS)
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


def from_run_config(run_config: Mapping[str, Any]) -> ServerJob:
    """Build the job from a Flower run config; every problem is a ValueError naming the key."""
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runner import Runtime, RuntimeOptions

    unknown = sorted(set(run_config) - set(KNOWN))
    if unknown:
        raise ValueError(f"run config: unknown key(s) {unknown}; known: {list(KNOWN)}")
    resume = str(run_config.get(RESUME, ""))
    if resume:  # the run directory holds the configuration; nothing else may be given beside it
        given = sorted(k for k in (CONFIG, CONFIG_FILE, OUT) if str(run_config.get(k, "")))
        if given:
            raise ValueError(f"run config: {RESUME} continues {resume!r} with its own configuration; drop {given}")
        return ServerJob(None, None, None, None, Path(resume))
    algorithm = str(run_config.get(ALGORITHM, ""))
    if algorithm not in EXPERIMENTS:
        raise ValueError(f"run config: {ALGORITHM} must be one of {sorted(EXPERIMENTS)}; got {algorithm!r}")
    experiment = EXPERIMENTS[algorithm]
    values: dict[str, Any] = {}
    config_file = str(run_config.get(CONFIG_FILE, ""))
    if config_file:
        try:
            values.update({k.replace("-", "_"): v for k, v in tomllib.loads(Path(config_file).read_text()).items()})
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"run config: {CONFIG_FILE}: cannot read {config_file!r}: {e}") from None
    values.update(parse_pairs(str(run_config.get(CONFIG, ""))))
    cfg = config_lib.build(experiment.config_type, values)
    options = config_lib.build(
        RuntimeOptions,
        {
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
