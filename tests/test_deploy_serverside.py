"""A deployment's ServerApp side (fedpers/deploy/serverside.py): no user data on the server, every
check before the charge, no round after a stop or the policy's wall time, private run files."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedpers import config as config_lib
from fedpers.app import from_run_config, make_client_app
from fedpers.data.files import save_altmin_npz
from fedpers.deploy.serverside import (
    BoundedGrid,
    RunStopped,
    confine_config_file,
    deployed,
    lab_config_dir,
    preflight,
    private_files,
    refuse_seeded_node_noise,
    refuse_server_data,
)
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.altmin import truth
from fedpers.runner import execute
from fedpers.runtime.flower.policy import PolicyRefused, admit_run, load_policy
from tests.flower_support import InProcessGrid

EXP = EXPERIMENTS["altmin"]
SHAPES = {"n_users": 150, "dim": 5, "rank": 2, "samples_per_user": 8, "rounds": 1, "seed": 11, "cohorts": "all"}
POLICY = 'federation = "lab"\nmax-epsilon = 8.0\nmax-delta = 1e-4\nrequire-secure-noise = false\nmin-units = 50\nalgorithms = ["altmin"]\nmax-rounds = 3\n'


@pytest.fixture(scope="module")
def users_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("node") / "users.npz"
    cfg = config_lib.build(EXP.config_type, SHAPES)
    users = EXP.units(cfg, torch.arange(SHAPES["n_users"]))
    save_altmin_npz(path, x=users["x"], y=users["y"], u_star=truth(cfg))
    return path


_opened: list[str] = []
_watch: dict[str, object] = {"path": None, "in_node": False}


def _audit(event: str, args: tuple) -> None:
    if (
        event == "open"
        and _watch["path"] is not None
        and not _watch["in_node"]
        and args
        and str(args[0]) == _watch["path"]
    ):
        _opened.append(str(args[0]))


sys.addaudithook(_audit)


def test_the_server_opens_no_data_file_and_gives_the_local_private_result(tmp_path: Path, users_file: Path) -> None:
    """The deployment's run-config declares the shapes; each node reads its own data-file. Every
    open() of the users' file outside a node's handler is recorded: there is none, and the private
    release equals the local runtime's on the file."""
    run_config = {
        "algorithm": "altmin",
        "config": " ".join(f"{k}={v if k != 'cohorts' else chr(34) + v + chr(34)}" for k, v in SHAPES.items()),
        "out": str(tmp_path / "run"),
        "secure-noise": False,
    }
    job = deployed(from_run_config(run_config))
    refuse_server_data(job)
    app = make_client_app()

    def node_side(message, context):
        _watch["in_node"] = True
        try:
            return app(message, context)
        finally:
            _watch["in_node"] = False

    grid = InProcessGrid(node_side, 3, extra={"data-file": str(users_file)})  # type: ignore[arg-type]
    _watch["path"] = str(users_file)
    try:
        result = execute(job.experiment, job.cfg, job.options, out=job.out, progress=False, grid=grid)
    finally:
        _watch["path"] = None
    assert _opened == []
    assert "unavailable" in result["evaluation"] and "subspace_error" not in result and not result.get("baselines")
    local_cfg = config_lib.build(
        EXP.config_type,
        {
            **{k: v for k, v in SHAPES.items() if k not in ("n_users", "dim", "samples_per_user")},
            "data": str(users_file),
        },
    )
    local = execute(EXP, local_cfg, out=tmp_path / "local", progress=False)
    U = torch.from_numpy(np.load(tmp_path / "run" / "final_state.npz")["U"])
    torch.testing.assert_close(U, local["_state"]["U"], rtol=0, atol=1e-10)
    assert "subspace_error" in local  # the local run, which holds the data, still evaluates


def test_a_deployment_refuses_a_data_path_before_anything(tmp_path: Path) -> None:
    job = from_run_config({"algorithm": "altmin", "config": f"data='{tmp_path / 'absent.npz'}' rank=2"})
    with pytest.raises(ValueError, match="data: in a deployment the ServerApp opens no data file"):
        refuse_server_data(job)


def _job(tmp_path: Path, **config: object) -> object:
    fields = {**SHAPES, **config}
    text = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in fields.items())
    return deployed(
        from_run_config(
            {
                "algorithm": "altmin",
                "config": text,
                "out": str(tmp_path / "out"),
                "secure-noise": False,
                "node-partitions": "11=0 12=1 13=2",
            }
        )
    )


@pytest.mark.parametrize(
    ("config", "rule"),
    [
        ({"rounds": 3}, "max-rounds"),  # 4 rounds > the policy's 3
        ({"rounds": 2, "cohorts": "disjoint"}, "min-units"),  # round 1: 21..28 users a node a round < 50
    ],
)
def test_every_check_comes_before_the_charge(tmp_path: Path, config: dict, rule: str) -> None:
    (tmp_path / "policy.toml").write_text(POLICY)
    policy = load_policy(tmp_path / "policy.toml")
    with pytest.raises(PolicyRefused, match=f"rule '{rule}'"):
        preflight(policy, _job(tmp_path, **config))
    assert not policy.ledger.exists()  # type: ignore[union-attr]


def test_an_existing_out_directory_leaves_the_budget_unchanged(tmp_path: Path) -> None:
    (tmp_path / "policy.toml").write_text(POLICY)
    policy = load_policy(tmp_path / "policy.toml")
    job = _job(tmp_path)
    preflight(policy, job)
    admit_run(policy, job, "1")
    before = policy.ledger.read_bytes()  # type: ignore[union-attr]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds a run"):
        preflight(policy, _job(tmp_path))
    assert policy.ledger.read_bytes() == before  # type: ignore[union-attr]


def test_no_round_is_sent_after_a_stop_or_past_the_wall_time() -> None:
    pushed: list[object] = []
    inner = SimpleNamespace(
        push_messages=lambda m: pushed.append(m) or ["id"], pull_messages=lambda ids: [], get_node_ids=lambda: [1]
    )
    state = {"alive": True}
    grid = BoundedGrid(inner, deadline=float("inf"), alive=lambda: state["alive"])
    assert grid.push_messages(["task-0"]) == ["id"] and grid.get_node_ids() == [1]
    state["alive"] = False  # flwr stop
    with pytest.raises(RunStopped, match="stopped"):
        grid.push_messages(["task-1"])
    late = BoundedGrid(inner, deadline=0.0, alive=lambda: True)
    with pytest.raises(RunStopped, match="max-seconds"):
        late.push_messages(["task-2"])
    assert pushed == [["task-0"]]


@pytest.mark.slow
def test_run_files_are_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        private_files()
        cfg = config_lib.build(EXP.config_type, {**SHAPES, "n_users": 60})
        execute(EXP, cfg, out=tmp_path / "run", progress=False)
    finally:
        os.umask(old)
    run = tmp_path / "run"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    files = [p for p in run.rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), [
        (p.name, oct(p.stat().st_mode)) for p in files
    ]


def test_a_deployment_refuses_node_noise_drawn_from_the_runs_seed() -> None:
    """Under distributed or local DP the run's seed travels with the public plan: a deployment must draw
    the nodes' noise from their own OS entropy, or the server could subtract it."""
    import dataclasses

    from fedpers.config import DpModel

    job = from_run_config({"algorithm": "altmin", "config": "rank=2", "secure-noise": False})
    refuse_seeded_node_noise(job)  # central: the server adds the noise
    for model in (DpModel.DISTRIBUTED, DpModel.LOCAL):
        seeded = dataclasses.replace(job, options=dataclasses.replace(job.options, dp_model=model))
        with pytest.raises(ValueError, match=f"secure_noise: a deployment with dp_model={model.value}"):
            refuse_seeded_node_noise(seeded)
        secure = dataclasses.replace(job, options=dataclasses.replace(job.options, dp_model=model, secure_noise=True))
        refuse_seeded_node_noise(secure)


def _polled(grid_type: type, reply_at: float) -> tuple[list[float], float]:
    """The pauses of ``exchange`` on a grid whose one reply is there from ``reply_at`` s on (a fake
    clock), and how long after ``reply_at`` it was seen."""
    from fedpers.runtime.flower import server

    clock = {"now": 0.0}
    pauses: list[float] = []
    reply = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="task"))
    grid = grid_type(
        SimpleNamespace(
            push_messages=lambda m: ["task"], pull_messages=lambda ids: [reply] if clock["now"] >= reply_at else []
        )
    )

    def sleep(s: float) -> None:
        pauses.append(s)
        clock["now"] += s

    fake = SimpleNamespace(monotonic=lambda: clock["now"], sleep=sleep)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server, "time", fake)
        assert server.exchange(grid, ["task"], timeout=60.0) == [reply]
    return pauses, clock["now"] - reply_at


def test_a_deployed_round_sees_its_last_reply_within_a_tenth_of_its_wait() -> None:
    """The deployed grid (BoundedGrid) polls every tenth of the time waited (5 ms to 0.1 s); any other
    grid (a simulation's) keeps the geometric polls."""
    from fedpers.runtime.flower import server

    class Plain:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def push_messages(self, m: object) -> object:
            return self.inner.push_messages(m)  # type: ignore[attr-defined]

        def pull_messages(self, ids: object) -> object:
            return self.inner.pull_messages(ids)  # type: ignore[attr-defined]

    def deployed(inner: object) -> BoundedGrid:
        return BoundedGrid(inner, deadline=float("inf"), alive=lambda: True)

    for reply_at in (0.003, 0.05, 0.3, 0.6, 2.0, 10.0):
        pauses, late = _polled(deployed, reply_at)
        assert late <= max(server.POLL_FIRST, min(0.1 * reply_at * 1.0001, server.POLL_MAX)) + 1e-9
        assert all(server.POLL_FIRST <= p <= server.POLL_MAX for p in pauses)
    geometric, plain_late = _polled(Plain, 0.6)
    assert geometric[:3] == pytest.approx([server.POLL_FIRST, server.POLL_FIRST * 1.5, server.POLL_FIRST * 2.25])
    assert max(geometric) == server.POLL_MAX
    pauses, late = _polled(deployed, 0.6)
    assert late <= 0.06 and len(pauses) <= 45  # bounded pulls: 10 at 5 ms, then 10% more time per pull


def test_a_deployment_reads_a_config_file_only_from_the_labs_directory(tmp_path: Path) -> None:
    """configs/ beside $FEDPERS_POLICY: a relative name is read from there; an absolute path elsewhere, a `..`
    escape, a symbolic link out of it, or any config file without a policy is refused before it is opened,
    naming the key and the allowed place (the ServerApp used to read any TOML and echo its key names)."""
    lab = tmp_path / "superlink"
    (lab / "configs").mkdir(parents=True)
    (lab / "policy.toml").write_text(POLICY)
    (lab / "configs" / "job.toml").write_text("rank = 2\nepsilon = 4.0\n")
    secret = tmp_path / "elsewhere.toml"
    secret.write_text("private-key-name = 1\n")
    (lab / "configs" / "link.toml").symlink_to(secret)
    where = lab_config_dir({"FEDPERS_POLICY": str(lab / "policy.toml")})
    assert where == (lab / "configs").resolve() and lab_config_dir({}) is None
    run_config = {"algorithm": "altmin", "config-file": "job.toml"}
    confined = confine_config_file(run_config, where)
    assert confined["config-file"] == str(where / "job.toml") and run_config["config-file"] == "job.toml"
    assert from_run_config(confined).cfg.rank == 2
    for given in (
        str(secret),
        "../policy.toml",
        "link.toml",
        str(where / ".." / "configs" / ".." / "policy.toml"),
        ".",
    ):
        with pytest.raises(
            ValueError, match=rf"config-file: .* is outside the lab's config directory {where}; put the TOML file there"
        ) as refused:
            confine_config_file({**run_config, "config-file": given}, where)
        assert "private-key-name" not in str(refused.value)
    with pytest.raises(
        ValueError,
        match=r"config-file: a deployment reads config files only from the lab's directory \(configs/ beside \$FEDPERS_POLICY\)",
    ):
        confine_config_file(run_config, None)
    assert confine_config_file({"algorithm": "altmin", "config-file": ""}, None) == {
        "algorithm": "altmin",
        "config-file": "",
    }
