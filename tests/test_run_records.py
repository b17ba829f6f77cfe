"""Run records a researcher can trust: a killed run's releases are on disk, SIGTERM keeps records."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedpers.commands.privacy_report import privacy_report, privacy_summary
from fedpers.results.rundir import LEDGER_LOG, default_run_dir

CMD = [
    sys.executable,
    "-m",
    "fedpers",
    "run",
    "altmin",
    "--n-users",
    "40000",
    "--dim",
    "20",
    "--rounds",
    "3",
    "--quiet",
]


def start(out: Path) -> subprocess.Popen:
    return subprocess.Popen(CMD + ["--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for_releases(out: Path, count: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    log = out / LEDGER_LOG
    while not (log.is_file() and len(log.read_text().splitlines()) >= count):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before its releases"
        time.sleep(0.05)


def test_a_killed_run_reports_the_releases_it_made(tmp_path):
    out = tmp_path / "killed"
    proc = start(out)
    wait_for_releases(out, 3, proc)
    proc.kill()
    proc.wait()
    summary = privacy_summary(out)
    assert not summary["complete"] and summary["releases"] >= 3 and summary["epsilon"] > 0
    assert "INCOMPLETE" in privacy_report(out).splitlines()[0]


def test_sigterm_leaves_the_records_ctrl_c_leaves(tmp_path):
    out = tmp_path / "terminated"
    proc = start(out)
    wait_for_releases(out, 1, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert "Traceback" not in stderr and "fedpers: interrupted (signal 15)" in stderr  # a message, not a stack
    assert (out / "error.json").is_file() and (out / "ledger.json").is_file()
    assert "KeyboardInterrupt" in (out / "error.json").read_text()
    assert privacy_summary(out)["releases"] >= 1


def test_a_signal_during_the_imports_waits_for_them_then_ends_the_run():
    """A KeyboardInterrupt inside torch's import aborted the process (pybind11's terminate, exit
    -6) or left torch half-imported (a 38-line ImportError): Ctrl-C and SIGTERM in the first
    second of a run. Now the signal waits for the imports, then ends the run as anywhere else."""
    code = (
        "import builtins, os, signal, sys\n"
        "from fedpers.commands import cli\n"
        "real = builtins.__import__\n"
        "def spy(name, *a, **k):\n"
        "    if name == 'torch' and 'torch' not in sys.modules:\n"
        "        os.kill(os.getpid(), getattr(signal, sys.argv[1]))\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = spy\n"
        "try:\n"
        "    cli._import_run_libraries()\n"
        "except KeyboardInterrupt as e:\n"
        "    print('deferred', repr(str(e)), float(sys.modules['torch'].ones(2).sum()))\n"
    )
    for name, said in (("SIGINT", "''"), ("SIGTERM", "'signal 15'")):
        done = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stdout.strip()) == (0, f"deferred {said} 2.0"), done.stderr[-500:]


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(default_run_dir("altmin", 0))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 6 and all(p.is_dir() for p in paths)


def test_no_abbreviated_flags_and_no_broken_pipe(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "fedpers", "run", "altmin", "--n-user", "5"], capture_output=True, text=True
    )
    assert (
        bad.returncode == 2 and "unknown flag --n-user; did you mean --n-users?" in bad.stderr
    )  # no abbreviation: refused, with a suggestion
    out = tmp_path / "long"  # 1,500 releases: a report far longer than a pipe's buffer
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fedpers",
            "run",
            "noisyhead",
            "--prompts",
            "200",
            "--steps",
            "1500",
            "--quiet",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    piped = subprocess.run(
        f"{sys.executable} -m fedpers privacy {out} | head -1", shell=True, capture_output=True, text=True
    )
    assert piped.stdout.startswith("run:") and "Traceback" not in piped.stderr and "BrokenPipe" not in piped.stderr


def test_help_starts_without_importing_any_algorithm(tmp_path):
    code = "import sys; from fedpers.commands.cli import build_parser; build_parser(); print(sorted(m for m in ('torch', 'flwr', 'ray', 'dp_accounting') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
    run = "import sys; from fedpers.commands.cli import main; main(['run', 'altmin', '--n-users', '300', '--quiet', '--out', sys.argv[1]]); print('flwr' in sys.modules or 'ray' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", run, str(tmp_path / "run")], capture_output=True, text=True, check=True)
        .stdout.strip()
        .endswith("False")
    )


def test_runs_record_what_produced_them(tmp_path):
    import json

    from fedpers.commands.cli import main

    assert main(["run", "altmin", "--n-users", "300", "--quiet", "--out", str(tmp_path / "r")]) == 0
    record = json.loads((tmp_path / "r" / "provenance.json").read_text())
    assert record["fedpers"] and record["python"] and record["started"] <= record["finished"]
    assert set(record["libraries"]) >= {"torch", "flwr", "ray", "dp-accounting"} and all(record["libraries"].values())
    assert record["git"] is None or (len(record["git"]["commit"]) == 40 and isinstance(record["git"]["dirty"], bool))
    assert record["command"][:1] != []


def test_a_run_failing_before_its_first_release_leaves_no_directory(tmp_path, monkeypatch):
    """Nothing half-written blocks reusing --out: a run that released nothing removes the directory
    it created; the same --out then runs to completion."""
    from fedpers import runner
    from fedpers.commands.cli import main

    def broken(*args, **kwargs):
        raise RuntimeError("failed before any release")

    out = tmp_path / "run"
    args = ["run", "dpattention", "--columns", "2000", "--out", str(out), "--quiet"]
    monkeypatch.setattr(runner, "drive", broken)
    with pytest.raises(RuntimeError, match="before any release"):
        main(args)
    assert not out.exists()
    monkeypatch.undo()
    assert main(args) == 0 and (out / "result.json").is_file()


def test_a_process_reads_its_code_version_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Provenance asks git and the package metadata once per process (a sweep's runs share the
    answer); each run still gets its own copy, command and start time."""
    import subprocess

    from fedpers.results import provenance as prov

    calls: list[list[str]] = []
    real = subprocess.run
    monkeypatch.setattr(prov.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real(cmd, **kw))
    prov._process_code.cache_clear()
    try:
        first = prov.provenance()
        asked = len(calls)
        assert asked in (1, 2)  # rev-parse, and status in a checkout
        first["libraries"]["torch"] = "edited"
        second = prov.provenance()
        assert len(calls) == asked and second["libraries"]["torch"] != "edited"
        assert second["git"] == first["git"] and second["fedpers"] == first["fedpers"]
    finally:
        prov._process_code.cache_clear()
