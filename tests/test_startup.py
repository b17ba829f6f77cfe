"""Start-up of ``fedpers``: what a process imports before it refuses bad input, and how it exits.

Checked by what is in ``sys.modules`` (timings are too noisy on shared machines); figures are in
docs/benchmarks.md."""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys

import pytest

from fedpers.commands import cli


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_help_imports_no_torch() -> None:
    code = (
        "import sys\nfrom fedpers.commands.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print('torch' in sys.modules, 'dp_accounting' in sys.modules, 'matplotlib' in sys.modules)"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False False False"


def test_algorithm_help_imports_no_torch_and_prints_the_full_parsers_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fedpers run ALGO --help`` (and ``fedpers audit ALGO --help``) is answered from the flag
    snapshot: no torch, no accounting library, and for every built-in algorithm the text the
    experiment's own parser prints."""
    import os

    from fedpers.commands import flags

    table = flags._load()
    assert table is not None
    names = sorted(table["algorithms"])
    code = (
        "import contextlib, io, json, sys\nfrom fedpers.commands.cli import main\ntexts = {}\n"
        "for name in sys.argv[1:]:\n    out = io.StringIO()\n"
        "    try:\n        with contextlib.redirect_stdout(out):\n            main(['run', name, '--help'])\n"
        "    except SystemExit as e:\n        assert e.code == 0, e.code\n    texts[name] = out.getvalue()\n"
        "out = io.StringIO()\nwith contextlib.redirect_stdout(out):\n    assert main(['audit', 'altmin', '--help']) == 0\n"
        "texts['audit'] = out.getvalue()\n"
        "print(json.dumps([texts, 'torch' in sys.modules, 'dp_accounting' in sys.modules]))"
    )
    monkeypatch.setenv("COLUMNS", "97")  # argparse wraps to the terminal's width: the same in both processes
    proc = subprocess.run(
        [sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert proc.returncode == 0, proc.stderr
    texts, torch, accounting = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (torch, accounting) == (False, False)
    assert len(names) >= 7
    for name in names:
        assert texts[name] == cli.algorithm_parser(name).format_help(), name
    assert texts["audit"].endswith(cli.algorithm_parser("altmin").format_help())  # `fedpers audit ALGO --help` too


def test_a_mistyped_flag_value_is_refused_with_status_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fedpers", "run", "altmin", "--n-users", "2x"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "n_users" in proc.stderr and "2x" in proc.stderr


def test_a_mistyped_flag_value_is_refused_before_torch_is_imported() -> None:
    code = (
        "import sys\nfrom fedpers.commands.cli import main\n"
        "status = main(['run', 'altmin', '--n-users', '2x'])\n"
        "print(status, 'torch' in sys.modules, 'dp_accounting' in sys.modules)"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "2 False False"


def test_only_the_process_entry_point_freezes_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """``main()`` as the process's entry point (no argv) moves its objects out of the cyclic
    collector before exit; ``main(argv)`` called from Python leaves the caller's collector alone."""
    frozen: list[int] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(1))
    monkeypatch.setattr(cli, "_main", lambda argv: 0)
    assert cli.main(["privacy", "x"]) == 0 and frozen == []
    monkeypatch.setattr(sys, "argv", ["fedpers", "privacy", "x"])
    assert cli.main() == 0 and frozen == [1]


def test_a_misspelt_flag_is_answered_with_a_suggestion_as_fast_as_help() -> None:
    """``--epsilonn`` is refused with ``did you mean --epsilon`` and status 2, importing no torch;
    its wall time is measured against ``fedpers --help``'s in the same conditions."""
    import time

    def timed(*args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "fedpers", *args], capture_output=True, text=True, timeout=300)
        return time.perf_counter() - start, proc

    help_s, _ = timed("--help")
    typo_s, proc = timed("run", "altmin", "--epsilonn", "4")
    assert proc.returncode == 2 and "did you mean --epsilon" in proc.stderr, proc.stderr
    assert typo_s < help_s + 0.5, (typo_s, help_s)
    code = (
        "import sys\nfrom fedpers.commands.cli import main\n"
        "status = main(['run', 'noisyhead', '--regime', 'low-dimm'])\n"
        "print(status, 'torch' in sys.modules)"
    )
    proc2 = _run(code)
    assert proc2.stdout.strip().splitlines()[-1] == "2 False" and "low-dim" in proc2.stderr


def test_the_flag_snapshot_is_current() -> None:
    """The snapshot the early check reads equals what the config classes give now (regenerate with
    ``python -m fedpers.commands.flags`` after changing a config field)."""
    from fedpers.commands import flags

    assert flags.TABLE_FILE.read_text() == flags.table_text(flags.build_table()), (
        "run: python -m fedpers.commands.flags"
    )


def test_a_flag_declared_by_a_sibling_puts_its_file_in_the_snapshots_sources() -> None:
    """FedRep, NoisyGD and NoisyHead take their shared flags from one declaration (the same help and
    range in all three); an edit there changes all three snapshots' fingerprints, so none goes stale."""
    from fedpers.commands import flags
    from fedpers.experiments import experiment
    from fedpers.configs.gradient_rounds import GradientRoundFields

    shared = {f.name: f.metadata for f in dataclasses.fields(GradientRoundFields)}
    for name in ("fedrep", "noisygd", "noisyhead"):
        cls = experiment(name).config_type
        taken = [f for f in dataclasses.fields(cls) if f.metadata.get("declared_by") is GradientRoundFields]
        assert {"noise", "bands", "clip_quantile", "clip_budget"} <= {f.name for f in taken}
        assert all(f.metadata["help"] == shared[f.name]["help"] for f in taken)
        assert "configs/gradient_rounds.py" in flags._sources([cls])


@pytest.mark.parametrize("flag, value", [("--delta", "1"), ("--delta", "0"), ("--epsilon", "0")])
def test_the_early_check_names_the_whole_range_a_bound_of_zero_included(flag: str, value: str) -> None:
    """The snapshot's refusal says what the full validation says: a lower bound of 0 is a bound."""
    from fedpers import config as config_lib
    from fedpers.commands import flags
    from fedpers.experiments.altmin import AltMinConfig

    name = flag[2:]
    meta = {f.name: f.metadata for f in dataclasses.fields(AltMinConfig)}[name]
    with pytest.raises(ValueError) as full:
        config_lib.check_range(name, float(value), meta)
    with pytest.raises(ValueError) as early:
        flags.precheck("altmin", [flag, value])
    assert str(early.value) == str(full.value) and " and " in str(early.value)


def test_a_stale_snapshot_defers_to_the_full_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot whose sources changed checks nothing (the experiment's own parser answers)."""
    from fedpers.commands import flags

    with pytest.raises(ValueError, match="did you mean --epsilon"):
        flags.precheck("altmin", ["--epsilonn", "4"])
    monkeypatch.setattr(flags, "fingerprint", lambda sources: "changed")
    flags.precheck("altmin", ["--epsilonn", "4"])  # deferred: no error here
    assert cli.snapshot_parser("altmin") is None  # --help then comes from the full parser
    with pytest.raises(SystemExit):
        cli.algorithm_parser("altmin").parse_args(["--epsilonn", "4"])


def test_a_run_process_draws_its_plots_in_a_worker_the_same_files_and_imports_no_matplotlib(tmp_path) -> None:
    """``fedpers run`` as a process hands its plots to a worker started before torch is imported:
    the process itself never imports matplotlib (nor Flower, Ray, pandas: a local run calls none
    of them), and the PNGs are byte for byte those an
    in-process run of the same config draws. The process ends without tearing its modules down,
    after its output is flushed."""
    run = ["run", "altmin", "--n-users", "200", "--dim", "6", "--rank", "2", "--quiet"]
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fedpers", *run, "--out", str(tmp_path / "worker")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "completed in" in proc.stdout and proc.stdout.rstrip().endswith(str(tmp_path / "worker"))  # the output whole
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    unused = {"matplotlib", "flwr", "ray", "pandas", "grpc", "sympy"}  # nothing a local run calls
    assert "torch" in imported and not {m.split(".")[0] for m in imported} & unused
    assert cli.main([*run, "--out", str(tmp_path / "here")]) == 0
    drawn = json.loads((tmp_path / "worker" / "result.json").read_text())["plots"]
    assert drawn and drawn == json.loads((tmp_path / "here" / "result.json").read_text())["plots"]
    for name in drawn:
        assert (tmp_path / "worker" / name).read_bytes() == (tmp_path / "here" / name).read_bytes(), name


def test_a_failed_plot_worker_leaves_the_drawing_to_the_run(tmp_path) -> None:
    """A worker that died answers None (nothing promised): the run directory draws the plots itself."""
    from fedpers.results import plots
    from fedpers.results.rundir import RunDirectory

    rounds = [{"round": r, "subspace_error": 0.5 / (r + 1)} for r in range(3)]
    plots.start_worker()
    worker = plots._WORKERS[0]
    worker.proc.kill()
    assert worker.plot_run(tmp_path, rounds, ["subspace_error"], title="t") is None
    run_dir = RunDirectory(tmp_path / "run")
    assert run_dir.plot_rounds(rounds, ["subspace_error"], "t") == ["subspace_error.png"]
    assert (tmp_path / "run" / "subspace_error.png").stat().st_size > 0 and not plots._WORKERS
    run_dir.close()


def test_a_run_process_imports_its_libraries_with_the_collector_paused_then_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process's own run imports torch and the accounting libraries with the cyclic collector
    off, freezes what they built and turns the collector back on, an import error included;
    ``main(argv)`` from Python leaves the caller's collector alone."""
    import argparse

    from fedpers.results import plots

    calls: list[str] = []
    for name in ("disable", "freeze", "enable"):
        monkeypatch.setattr(gc, name, lambda name=name: calls.append(name))
    monkeypatch.setattr(plots, "start_worker", lambda: None)
    monkeypatch.setattr(plots, "stop_worker", lambda: None)
    monkeypatch.setattr(cli, "_ENDING", {})
    assert cli._as_process(argparse.Namespace(entry_point=False), lambda args: 0) == 0 and calls == []
    assert cli._as_process(argparse.Namespace(entry_point=True), lambda args: 0) == 0
    assert calls == ["disable", "freeze", "enable"]
    monkeypatch.setitem(sys.modules, "fedpers.runner", None)  # the import fails
    with pytest.raises(ImportError):
        cli._as_process(argparse.Namespace(entry_point=True), lambda args: 0)
    assert calls[3:] == ["disable", "freeze", "enable"]
    with pytest.raises(ImportError):  # a sweep process imports alike, before its sweep file is read
        cli.cmd_sweep(argparse.Namespace(entry_point=True))
    assert calls[6:] == ["disable", "freeze", "enable"]
