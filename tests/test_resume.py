"""Kill a run with SIGKILL at several points, resume it, and get the uninterrupted run's result and ledger.

The run is killed from inside its own process at a chosen event (after the n-th release is
written, after the n-th checkpoint, after the n-th round line, after the final state is
written, i.e. during evaluation), so each kill point is exact and the test is deterministic.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fedpers.commands.cli import main
from fedpers.runner import resume_run

ROOT = Path(__file__).resolve().parents[1]

KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from fedpers.results import rundir as results
    from fedpers.commands.cli import main
    from fedpers.runtime import checkpoint

    point, at = sys.argv[1], int(sys.argv[2])
    seen = [0]

    def wrap(owner, name):
        inner = getattr(owner, name)

        def hooked(*args, **kwargs):
            out = inner(*args, **kwargs)
            seen[0] += 1
            if seen[0] == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        setattr(owner, name, hooked)

    owner, name = {
        "release": (results.RunDirectory, "append_release"),
        "checkpoint": (checkpoint.Checkpointer, "save"),
        "round": (results.RunDirectory, "append_round"),
        "final": (results.RunDirectory, "write_arrays"),
    }[point]
    wrap(owner, name)
    sys.exit(main(sys.argv[3:]))
    """
)

ALTMIN = [
    "run",
    "altmin",
    "--n-users",
    "1200",
    "--dim",
    "8",
    "--rank",
    "2",
    "--rounds",
    "3",
    "--epsilon",
    "2",
    "--baselines",
    "none",
    "--quiet",
    "--seed",
    "5",
]
NOISYHEAD = [
    "run",
    "noisyhead",
    "--prompts",
    "120",
    "--mode",
    "rounds",
    "--steps",
    "6",
    "--unit",
    "user",
    "--prompts-per-user",
    "2",
    "--quiet",
    "--seed",
    "3",
]


def _killed(tmp_path: Path, args: list[str], point: str, at: int, name: str) -> Path:
    out = tmp_path / name
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, point, str(at), *args, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"the run was not killed at {point}:{at} (rc {proc.returncode}): {proc.stderr[-2000:]}"
    )
    assert not (out / "result.json").exists()
    return out


def _records(run: Path) -> tuple[list[str], list[dict], dict, dict]:
    ledger = (run / "ledger.jsonl").read_text().splitlines()
    rounds = [
        {k: v for k, v in json.loads(line).items() if k != "seconds"}
        for line in (run / "rounds.jsonl").read_text().splitlines()
    ]
    result = {
        k: v
        for k, v in json.loads((run / "result.json").read_text()).items()
        if k not in ("seconds", "run_dir", "plots")
    }
    state = dict(np.load(run / "final_state.npz")) if (run / "final_state.npz").exists() else {}
    return ledger, rounds, result, state


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    base = tmp_path_factory.mktemp("reference")
    refs = {}
    for name, args in (("altmin", ALTMIN), ("noisyhead", NOISYHEAD)):
        assert main([*args, "--out", str(base / name)]) == 0
        refs[name] = _records(base / name)
    return refs


@pytest.mark.parametrize(
    "name, point, at",
    [
        pytest.param(
            "altmin", "release", 1, marks=pytest.mark.slow
        ),  # inside the private initialisation, before any checkpoint
        ("altmin", "release", 4),  # mid-round: a release drawn, its round not checkpointed
        pytest.param("altmin", "checkpoint", 2, marks=pytest.mark.slow),  # checkpoint written, its round line not yet
        pytest.param("altmin", "round", 3, marks=pytest.mark.slow),  # every round done
        pytest.param("altmin", "final", 1, marks=pytest.mark.slow),  # during evaluation
        pytest.param("noisyhead", "release", 3, marks=pytest.mark.slow),
        ("noisyhead", "checkpoint", 4),
        pytest.param("noisyhead", "final", 1, marks=pytest.mark.slow),
    ],
)
def test_kill_and_resume_equals_uninterrupted(tmp_path: Path, reference: dict, name: str, point: str, at: int) -> None:
    args = ALTMIN if name == "altmin" else NOISYHEAD
    run = _killed(tmp_path, args, point, at, name)
    before = (run / "ledger.jsonl").read_text().splitlines()
    result = resume_run(run, progress=False)
    assert result["status"] == "completed"
    ledger, rounds, final, state = _records(run)
    ref_ledger, ref_rounds, ref_final, ref_state = reference[name]
    assert ledger == ref_ledger  # same releases, each once: nothing drawn twice, nothing lost
    assert ledger[: len(before)] == before  # append-only across the crash
    assert rounds == ref_rounds
    assert final == ref_final
    assert state.keys() == ref_state.keys() and all(
        np.array_equal(state[k], ref_state[k]) for k in state
    )  # bit for bit
    provenance = json.loads((run / "provenance.json").read_text())
    assert len(provenance["resumed"]) == 1 and "finished" in provenance
    assert not (run / "error.json").exists()


@pytest.mark.parametrize(
    "name, args",
    [
        ("altmin", [a if a != "none" else "private_init_only,oracle,local_only" for a in ALTMIN]),
        (
            "fedrep",
            [
                "run",
                "fedrep",
                "--n-users",
                "600",
                "--dim",
                "6",
                "--rank",
                "2",
                "--rounds",
                "3",
                "--epsilon",
                "2",
                "--baselines",
                "none",
                "--quiet",
                "--seed",
                "4",
            ],
        ),
    ],
)
def test_resume_gives_the_uninterrupted_result_baselines_included(tmp_path: Path, name: str, args: list[str]) -> None:
    """Round 0's private U (the private_init_only baseline) is kept in the run directory, so a
    run killed after round 0 and resumed reports every baseline the uninterrupted one does."""
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    run = _killed(tmp_path, args, "checkpoint", 2, name)
    resume_run(run, progress=False)
    _, _, whole, _ = _records(tmp_path / "whole")
    _, _, resumed, _ = _records(run)
    assert "private_init_only" in whole["baselines"] and not whole.get("baselines_skipped", []).count(
        "private_init_only"
    )
    assert resumed == whole  # identical apart from timing fields (seconds, run_dir, plots)


@pytest.mark.slow  # two kills of one run: the one-kill cases in the default suite cover each kill point
def test_resume_twice_after_two_kills(tmp_path: Path, reference: dict) -> None:
    run = _killed(tmp_path, ALTMIN, "release", 2, "altmin")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            KILLER.replace(
                "sys.exit(main(sys.argv[3:]))",
                "from fedpers.runner import resume_run; resume_run(sys.argv[3], progress=False)",
            ),
            "checkpoint",
            "2",
            str(run),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    resume_run(run, progress=False)
    ledger, rounds, final, state = _records(run)
    assert (ledger, rounds, final) == reference["altmin"][:3]
    assert len(json.loads((run / "provenance.json").read_text())["resumed"]) == 2


def test_killed_run_reports_its_releases_as_incomplete(tmp_path: Path) -> None:
    from fedpers.commands.privacy_report import privacy_summary

    run = _killed(tmp_path, ALTMIN, "checkpoint", 2, "altmin")
    summary = privacy_summary(run)
    assert not summary["complete"] and summary["releases"] == len((run / "ledger.jsonl").read_text().splitlines()) > 0
    assert summary["epsilon"] > 0


def test_resume_refusals(tmp_path: Path, reference: dict, capsys: pytest.CaptureFixture) -> None:
    done = tmp_path / "done"
    assert main([*ALTMIN, "--out", str(done)]) == 0
    assert main(["resume", str(done)]) == 2
    assert "completed run" in capsys.readouterr().err
    assert main(["resume", str(tmp_path / "nothing")]) == 2
    assert "not a fedpers run directory" in capsys.readouterr().err
    run = _killed(tmp_path, ALTMIN, "checkpoint", 1, "edited")
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "seed": 6}))
    assert main(["resume", str(run)]) == 2
    assert "another configuration" in capsys.readouterr().err
    (run / "config.json").write_text(json.dumps(cfg))
    (run / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert main(["resume", str(run)]) == 2
    assert "unreadable checkpoint" in capsys.readouterr().err


def test_rerun_into_a_killed_run_points_to_resume(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = _killed(tmp_path, ALTMIN, "checkpoint", 1, "altmin")
    assert main([*ALTMIN, "--out", str(run)]) == 2
    assert f"fedpers resume {run}" in capsys.readouterr().err


def test_secure_noise_run_resumes_without_writing_generator_state(tmp_path: Path, reference: dict) -> None:
    import torch

    run = _killed(tmp_path, [*ALTMIN, "--secure-noise", "true"], "release", 4, "secure")
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    assert saved["privatizer"] == {"releases": 3, "secure": True}  # nothing from which the noise could be recomputed
    resume_run(run, progress=False)
    ledger, rounds, final, state = _records(run)
    assert ledger == reference["altmin"][0]  # each release once, the same public parameters
    assert not np.array_equal(state["U"], reference["altmin"][3]["U"])  # fresh OS-entropy noise


FLOWER = [
    *ALTMIN[: ALTMIN.index("--rounds") + 1],
    "6",
    *ALTMIN[ALTMIN.index("--rounds") + 2 :],
    "--runtime",
    "flower",
    "--nodes",
    "3",
]
"""AltMin on Flower's simulation (its supported path: a private SuperLink and ``flwr run``), long enough to stop mid-way."""


def _tagged(tag: str) -> list[int]:
    """Processes (other than this one) whose environment carries ``FEDPERS_TEST_TAG=tag``: the CLI and
    every process started for its run (the SuperLink, its SuperExec, the simulation, its Ray)."""
    needle = f"FEDPERS_TEST_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        with open(f"/proc/{entry}/stat") as g:
                            if g.read().rsplit(")", 1)[1].split()[0] != "Z":
                                found.append(int(entry))
            except OSError:
                continue
    return found


def _flower_cli(out: Path, tag: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "FEDPERS_TEST_TAG": tag,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "fedpers", *FLOWER, "--out", str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_gone(tag: str, timeout: float = 60.0) -> list[int]:
    import time

    deadline = time.monotonic() + timeout
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _stop_mid_way(tmp_path: Path, name: str, stop) -> tuple[Path, subprocess.CompletedProcess]:
    """Start FLOWER, wait for its first round line, ``stop(cli, tag)``; return the run directory and the CLI's outcome."""
    import time
    import uuid

    out, tag = tmp_path / name, uuid.uuid4().hex
    cli = _flower_cli(out, tag)
    try:
        deadline = time.monotonic() + 600
        while not (out / "rounds.jsonl").is_file() or not (out / "rounds.jsonl").read_text().strip():
            assert cli.poll() is None, f"the run ended before its first round: {cli.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no round within 600 s"
            time.sleep(0.05)
        stop(cli, tag)
        stdout, stderr = cli.communicate(timeout=300)
    finally:
        if cli.poll() is None:
            cli.kill()
    left = _wait_gone(tag)
    assert not left, f"processes of the run left behind: {left}"
    assert not (out / "result.json").exists(), "the run completed before it was stopped"
    return out, subprocess.CompletedProcess(cli.args, cli.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def flower_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """FLOWER uninterrupted; nothing of it is left running once the CLI returns."""
    import uuid

    out, tag = tmp_path_factory.mktemp("flower") / "run", uuid.uuid4().hex
    cli = _flower_cli(out, tag)
    _, stderr = cli.communicate(timeout=900)
    assert cli.returncode == 0, stderr[-3000:]
    assert not _tagged(tag), "processes of a completed run left behind"
    return _records(out)


@pytest.mark.slow  # three Flower simulations (~1 min each on a busy machine)
def test_a_flower_run_stopped_by_ctrl_c_leaves_nothing_and_resumes_bit_for_bit(
    tmp_path: Path, flower_reference: tuple
) -> None:
    run, cli = _stop_mid_way(tmp_path, "ctrl-c", lambda proc, tag: proc.send_signal(signal.SIGINT))
    assert cli.returncode == 130 and "interrupted (Ctrl-C)" in cli.stderr, cli.stderr[-3000:]
    resume_run(run, progress=False)
    ledger, rounds, final, state = _records(run)
    assert ledger == flower_reference[0] and rounds == flower_reference[1] and final == flower_reference[2]
    assert state.keys() == flower_reference[3].keys() and all(
        np.array_equal(state[k], flower_reference[3][k]) for k in state
    )


@pytest.mark.slow
def test_a_flower_run_whose_serverapp_is_killed_fails_leaves_nothing_and_resumes_bit_for_bit(
    tmp_path: Path, flower_reference: tuple
) -> None:
    """SIGKILL the simulation's own process (where the ServerApp runs) mid-way: the CLI fails naming it,
    every process of the run ends, and `fedpers resume` (through the same path) completes the run exactly."""

    def kill_serverapp(proc: subprocess.Popen, tag: str) -> None:
        sims = [pid for pid in _tagged(tag) if b"flwr-simulation" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert sims, "no flwr-simulation process found"
        for pid in sims:
            os.kill(pid, signal.SIGKILL)

    run, cli = _stop_mid_way(tmp_path, "killed", kill_serverapp)
    assert cli.returncode != 0 and "without a result" in cli.stderr, cli.stderr[-3000:]
    resume_run(run, progress=False)
    ledger, rounds, final, state = _records(run)
    assert ledger == flower_reference[0] and rounds == flower_reference[1] and final == flower_reference[2]
    assert state.keys() == flower_reference[3].keys() and all(
        np.array_equal(state[k], flower_reference[3][k]) for k in state
    )


def test_a_run_still_going_cannot_be_resumed_beside_itself(tmp_path: Path) -> None:
    from fedpers.results.rundir import RunDirectory

    run = _killed(tmp_path, ALTMIN, "checkpoint", 1, "altmin")
    holder = RunDirectory(run, resume=True)  # as a resumed run in progress holds it
    try:
        with pytest.raises(ValueError, match=f"in use by another running process \\(pid {os.getpid()}\\)"):
            resume_run(run, progress=False)
    finally:
        holder.close()
    assert resume_run(run, progress=False)["status"] == "completed"
