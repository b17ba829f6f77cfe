"""What a deployment's ServerApp checks and keeps to itself: no user data, every check before the charge, bounded runs.

In a deployment (``flwr run`` against a SuperLink whose nodes are other machines) the ServerApp
runs on the SuperLink machine, which holds no user's data:

- :func:`refuse_server_data`: a run-config naming a data file is refused (the public shapes, e.g.
  ``n_users``, ``dim``, ``samples_per_user``, are declared in the config; each node reads its own
  file, ``--node-config data-file=...``, and refuses a task whose protocol its data does not match);
  :func:`deployed` turns the server's evaluation off (``server_data=false``): result.json holds the
  private release and its privacy, and marks the data-dependent metrics and baselines unavailable;
- :func:`preflight`: every check that can refuse a run, before the federation's budget is charged —
  the out directory, the policy's ``max-rounds``, the node count of ``node-partitions`` and the
  policy's ``min-units`` for every planned round's cohort on every partition;
- :class:`BoundedGrid`: the Grid the run uses, which sends no round's tasks (so nothing more is
  released) once the policy's ``max-seconds`` have passed or the run was stopped (``flwr stop``:
  the Runtime API's heartbeat says so before each round and while replies are awaited);
- :func:`private_files`: run files only this user can read (umask 077: directories 0700, files 0600);
- :func:`confine_config_file`: a run-config's ``config-file`` is read only from the lab's directory
  (:func:`lab_config_dir`: ``configs/`` beside the lab's policy), never from anywhere else on the machine.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedpers.runtime.flower.policy import Policy, PolicyRefused

CONFIG_DIR = "configs"
"""The lab's directory for run-config files on the SuperLink machine: this name beside ``$FEDPERS_POLICY``
(``fedpers deploy certs`` creates ``superlink/configs/``, 0700)."""

HEARTBEAT_EVERY = 0.2
"""Seconds between the BoundedGrid's checks of the run's status while it waits for replies."""


class RunStopped(RuntimeError):
    """The run was stopped (``flwr stop``) or ran past the policy's ``max-seconds``: no further round is sent."""


def is_deployment(grid: Any) -> bool:
    """Whether ``grid`` is a SuperLink's Runtime API (a ServerApp process of ``flwr run``), not a simulation."""
    return type(grid).__name__ == "HttpGrid"


def refuse_server_data(job: Any) -> None:
    """Refuse a deployment's run-config that names a data file (the ServerApp opens none)."""
    cfg = getattr(job, "cfg", None)
    if cfg is not None and getattr(cfg, "data", None) is not None:
        raise ValueError(
            "data: in a deployment the ServerApp opens no data file (the users' data stays on the nodes); drop data= from "
            "the config, declare the public shapes (e.g. n_users, dim, samples_per_user) and give each SuperNode its file "
            "with --node-config data-file=PATH"
        )


def refuse_seeded_node_noise(job: Any) -> None:
    """Refuse a deployment that has the nodes add noise from the run's seed: under distributed or local DP
    the seed travels with the public plan (a reproducible simulation), so the server could subtract every
    node's noise; a deployment draws it from each node's OS entropy (``secure_noise``)."""
    options = getattr(job, "options", None)
    model = getattr(getattr(options, "dp_model", None), "value", "central")
    if options is not None and model != "central" and not options.secure_noise:
        raise ValueError(
            f"secure_noise: a deployment with dp_model={model} must set secure_noise=true (the nodes' noise would "
            "otherwise follow the run's seed, which the server knows)"
        )


def lab_config_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """``configs/`` beside the lab's policy (``$FEDPERS_POLICY``); None when this process has no policy."""
    from fedpers.runtime.flower.policy import POLICY_ENV

    policy = (os.environ if environ is None else environ).get(POLICY_ENV, "")
    return Path(policy).resolve().parent / CONFIG_DIR if policy else None


def confine_config_file(run_config: Mapping[str, Any], config_dir: Path | None) -> dict[str, Any]:
    """``run_config`` with its ``config-file`` resolved inside ``config_dir`` (a relative name is read from
    there); a path that leads anywhere else (``..``, a symbolic link out, another directory) or a
    config file without a lab directory is refused before the file is opened, so the ServerApp reads,
    and echoes key names of, no TOML file but the lab's."""
    from fedpers.app import CONFIG_FILE, JOB

    if str(run_config.get(JOB, "")):
        raise ValueError(
            f"run config: {JOB}: a deployment reads no job file on the SuperLink machine; give the run in config= "
            f"or {CONFIG_FILE} (from the lab's directory, {CONFIG_DIR}/ beside $FEDPERS_POLICY)"
        )
    given = str(run_config.get(CONFIG_FILE, ""))
    if not given:
        return dict(run_config)
    if config_dir is None:
        raise ValueError(
            f"run config: {CONFIG_FILE}: a deployment reads config files only from the lab's directory ({CONFIG_DIR}/ "
            "beside $FEDPERS_POLICY), and this ServerApp has no policy; give the fields in config= or as flat keys"
        )
    where = config_dir.resolve()
    path = (where / given).resolve()  # an absolute name replaces the directory; symbolic links are followed
    if not path.is_relative_to(where) or path == where:
        raise ValueError(
            f"run config: {CONFIG_FILE}: {given!r} is outside the lab's config directory {where}; put the TOML file "
            "there (a relative name is read from there)"
        )
    return {**run_config, CONFIG_FILE: str(path)}


def deployed(job: Any) -> Any:
    """``job`` with the server's evaluation off (``server_data=false``: no metric needs the users' data)."""
    if job.options is None:  # a resumed run: its saved options are its own
        return job
    return dataclasses.replace(job, options=dataclasses.replace(job.options, server_data=False))


def preflight(policy: Policy, job: Any) -> None:
    """Every check that can refuse ``job`` before the federation's budget is charged (see the module docstring)."""
    if job.resume is not None:
        return
    from fedpers.runtime.flower.policy import check_run

    check_run(
        policy, job.experiment.name, job.cfg, secure_noise=bool(job.options.secure_noise)
    )  # the run's own terms first
    if job.out is not None and (Path(job.out) / "config.json").exists():
        raise ValueError(f"out: {job.out} already holds a run; choose another out (nothing was charged)")
    declared = getattr(job.cfg, "rounds", None)  # before the protocol is built (calibrating a huge run takes minutes)
    if isinstance(declared, int) and declared > policy.max_rounds:
        raise PolicyRefused(
            "max-rounds", f"the run asks for rounds={declared}, the lab allows at most {policy.max_rounds}"
        )
    protocol = job.experiment.protocol(job.cfg)
    if protocol.num_rounds > policy.max_rounds:
        raise PolicyRefused(
            "max-rounds", f"the run has {protocol.num_rounds} rounds, the lab allows at most {policy.max_rounds}"
        )
    from fedpers.runtime.flower.partition import unit_ranges
    from fedpers.runtime.flower.server import parse_node_partitions

    mapping = parse_node_partitions(job.options.node_partitions)
    if not mapping:
        raise PolicyRefused(
            "min-units", "a deployment under a policy names its nodes: give node-partitions='NODE_ID=P ...'"
        )
    import torch

    ranges = unit_ranges(int(job.experiment.num_units(job.cfg)), len(mapping), job.options.users_per_node)
    for r in range(protocol.num_rounds):
        for p, ids in enumerate(ranges):
            count = protocol.units_in_round(r, {"ids": torch.arange(ids.start, ids.stop)})
            if count < policy.min_units:
                raise PolicyRefused(
                    "min-units",
                    f"round {r}: partition {p} would compute a message over {count} users, the lab's minimum is "
                    f"{policy.min_units} (fewer nodes, or cohorts='all')",
                )


def private_files() -> None:
    """Every file this process creates from now on is its user's alone (directories 0700, files 0600)."""
    os.umask(0o077)


class BoundedGrid:
    """A Flower Grid that sends nothing once the run is stopped or ``deadline`` (monotonic) has passed.

    Replies are pulled every tenth of the time already waited for them (:data:`reply_poll_share`;
    5 ms to 0.1 s), so a deployed round waits at most about a tenth longer than its last reply."""

    reply_poll_share = 0.1

    def __init__(self, grid: Any, deadline: float, alive: Any = None) -> None:
        self._grid, self._deadline = grid, deadline
        self._alive = alive if alive is not None else _heartbeat(grid)
        self._checked = 0.0

    def _check(self, force: bool) -> None:
        now = time.monotonic()
        if now >= self._deadline:
            raise RunStopped("the run reached the lab's max-seconds; no further round is sent")
        if force or now - self._checked >= HEARTBEAT_EVERY:
            self._checked = now
            if not self._alive():
                raise RunStopped("the run was stopped; no further round is sent")

    def push_messages(self, messages: Any) -> Any:
        self._check(force=True)
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Any) -> Any:
        self._check(force=False)
        return self._grid.pull_messages(message_ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def _heartbeat(grid: Any) -> Any:
    """True while the SuperLink says the run goes on (Flower's task heartbeat; internals of the
    HttpGrid: gated by :mod:`fedpers.deploy.flower`). On an unchecked series: always True (the
    run then stops when Flower's own heartbeat notices, a few seconds later)."""
    from fedpers.deploy.flower import supported

    client = getattr(grid, "_runtime_client", None)
    if client is None or not supported():
        return lambda: True
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest

    def alive() -> bool:
        try:
            return bool(client.SendTaskHeartbeat(SendTaskHeartbeatRequest()).success)
        except Exception:  # an unreachable SuperLink: Flower's own exit handling decides
            return True

    return alive
