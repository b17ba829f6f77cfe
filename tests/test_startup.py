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


def test_the_configs_layer_imports_neither_torch_nor_an_accounting_library() -> None:
    """Every module of fedpers/configs (and the registry that names them) imports no torch, no
    dp-accounting, no numpy or scipy: the CLI reads flags and checks values from them alone."""
    from pathlib import Path

    import fedpers.configs

    names = sorted(p.stem for p in Path(fedpers.configs.__file__).parent.glob("*.py") if p.stem != "__init__")
    assert {"altmin", "runtime", "privacy"} <= set(names)
    code = (
        "import importlib, sys\nimport fedpers.experiments\n"
        "for name in sys.argv[1:]:\n    importlib.import_module('fedpers.configs.' + name)\n"
        "for name in fedpers.experiments.ALGORITHMS:\n    fedpers.experiments.config_type(name)\n"
        "print(sorted(m for m in ('torch', 'dp_accounting', 'numpy', 'scipy') if m in sys.modules))"
    )
    proc = _run(code, *names)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_algorithm_help_imports_no_torch_and_lists_every_field() -> None:
    """``fedpers run ALGO --help`` (and ``fedpers audit ALGO --help``) is built from the config classes:
    no torch, no accounting library, and every field of the algorithm and of the runtime options
    has its flag there."""
    import os

    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.experiments import ALGORITHMS, config_type

    names = sorted(ALGORITHMS)
    code = (
        "import contextlib, io, json, sys\nfrom fedpers.commands.cli import main\ntexts = {}\n"
        "for name in sys.argv[1:]:\n    out = io.StringIO()\n"
        "    try:\n        with contextlib.redirect_stdout(out):\n            main(['run', name, '--help'])\n"
        "    except SystemExit as e:\n        assert e.code == 0, e.code\n    texts[name] = out.getvalue()\n"
        "out = io.StringIO()\nwith contextlib.redirect_stdout(out):\n    assert main(['audit', 'altmin', '--help']) == 0\n"
        "texts['audit'] = out.getvalue()\n"
        "print(json.dumps([texts, 'torch' in sys.modules, 'dp_accounting' in sys.modules]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert proc.returncode == 0, proc.stderr
    texts, torch, accounting = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (torch, accounting) == (False, False)
    assert len(names) >= 7
    runtime = [f.name for f in dataclasses.fields(RuntimeOptions)]
    for name in names:
        for field in [f.name for f in dataclasses.fields(config_type(name))] + runtime:
            assert "--" + field.replace("_", "-") + " " in texts[name], (name, field)
    assert "--canaries" in texts["audit"] and "--n-users" in texts["audit"]  # the audit's flags and ALGO's


def _bad_values(cls: type) -> list[tuple[str, str]]:
    """(flag, value) just outside each field's declared range, and a word no enum field takes."""
    import enum
    import typing

    from fedpers import config as config_lib

    out = []
    types = config_lib.field_types(cls)
    for f in dataclasses.fields(cls):
        flag, m = "--" + f.name.replace("_", "-"), f.metadata
        tp = next((a for a in typing.get_args(types[f.name]) if a is not type(None)), types[f.name])
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            out.append((flag, "no-such-choice"))
        elif m.get("ge") is not None:
            out.append((flag, str(m["ge"] - (1 if tp is int else 1e-9 * max(1.0, abs(m["ge"]))))))
        elif m.get("gt") is not None:
            out.append((flag, str(m["gt"])))
        elif m.get("le") is not None and not m.get("inf_ok"):
            out.append((flag, str(m["le"] * 2 + 1)))
        elif m.get("lt") is not None:
            out.append((flag, str(m["lt"])))
        elif tp in (int, float):
            out.append((flag, "nan" if tp is float else "x1"))
    return out


def test_every_bad_value_of_every_field_is_refused_before_torch_is_imported() -> None:
    """Each field's value just outside its range (an enum field: a word it does not take), values only
    a rule across fields refuses (rank >= dim, a noise strategy misspelt, a cycle of 0, an accountant
    without Poisson sampling for Poisson cohorts), for every built-in algorithm: each is refused
    with status 2, naming the field, and the process never imports torch or dp-accounting."""
    from fedpers.experiments import CONFIGS, config_type

    cases = [[name, flag, value] for name in sorted(CONFIGS) for flag, value in _bad_values(config_type(name))]
    cases += [
        ["altmin", "--rank", "20"],
        ["fedrep", "--noise", "bandd"],
        ["noisyhead", "--noise", "bandd"],
        ["noisygd", "--cycle", "0"],
        ["altmin", "--cohorts", "poisson", "--sampling-rate", "0.5", "--accountant", "rdp"],
        ["dpals", "--min-count", "9", "--max-count", "8"],
        ["altmin", "--runtime", "flower", "--nodes", "0"],
    ]
    assert len(cases) > 100
    code = (
        "import contextlib, io, json, sys\nfrom fedpers.commands.cli import main\nout = []\n"
        "for case in json.loads(sys.argv[1]):\n    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n        try:\n"
        "            status = main(['run', case[0], *case[1:], '--quiet'])\n"
        "        except SystemExit as e:\n            status = e.code\n"
        "    out.append([status, err.getvalue()])\n"
        "print(json.dumps([out, 'torch' in sys.modules, 'dp_accounting' in sys.modules]))"
    )
    proc = _run(code, json.dumps(cases))
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers, torch, accounting = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, (status, err) in zip(cases, answers, strict=True):
        field = case[-2][2:].replace("-", "_")
        assert status == 2 and (field in err or case[-2] in err), (case, status, err)
    assert (torch, accounting) == (False, False)


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


def test_a_misspelt_flag_and_a_bad_value_are_answered_as_fast_as_help() -> None:
    """``--epsilonn`` is refused with ``did you mean --epsilon`` and status 2, and so is a noise strategy
    misspelt, importing nothing outside the standard library and fedpers, as ``fedpers --help``: what makes
    a refusal slow (torch alone is seconds) is a third-party import, and the set of modules, unlike a wall
    time on a loaded machine, is the same every run."""
    code = (
        "import runpy, sys\nbefore = set(sys.modules)\nsys.argv = ['fedpers', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('fedpers', run_name='__main__')\nexcept SystemExit as e:\n    status = e.code\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(status, sorted(new - set(sys.stdlib_module_names) - {'fedpers'}))"
    )
    for args, refusal in (
        (["--help"], ""),
        (["run", "altmin", "--epsilonn", "4"], "did you mean --epsilon"),
        (["run", "fedrep", "--noise", "bandd"], "noise must be one of"),  # a value only the config's own check refuses
    ):
        proc = _run(code, *args)
        assert refusal in proc.stderr, proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == f"{2 if refusal else 0} []", (args, proc.stdout, proc.stderr)
    code = (
        "import sys\nfrom fedpers.commands.cli import main\n"
        "try:\n    main(['run', 'noisyhead', '--regime', 'low-dimm'])\nexcept SystemExit as e:\n"
        "    print(e.code, 'torch' in sys.modules)"
    )
    proc2 = _run(code)
    assert proc2.stdout.strip().splitlines()[-1] == "2 False" and "low-dim" in proc2.stderr


def test_the_gradient_round_flags_are_declared_once() -> None:
    """FedRep, NoisyGD and NoisyHead take their shared flags from one declaration: the same help and
    range in all three."""
    from fedpers.configs.gradient_rounds import GradientRoundFields
    from fedpers.experiments import config_type

    shared = {f.name: f.metadata for f in dataclasses.fields(GradientRoundFields)}
    for name in ("fedrep", "noisygd", "noisyhead"):
        taken = {f.name: f.metadata for f in dataclasses.fields(config_type(name)) if f.name in shared}
        assert {"noise", "bands", "clip_quantile", "clip_budget"} <= set(taken)
        for field in ("noise", "bands", "clip_quantile", "clip_budget"):
            assert taken[field] == shared[field], (name, field)


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


def test_refusals_of_the_line_itself_come_before_torch(tmp_path) -> None:
    """An --out that holds a run or a sweep, a theorem's declared precondition, a cross-field rule, a
    misspelt algorithm or command (with the closest name), a flag only other algorithms have (named
    with them): each refused with status 2 and its reason, and torch is never imported."""
    held, sweep = tmp_path / "held", tmp_path / "sweep"
    for d, name in ((held, "config.json"), (sweep, "spec.json")):
        d.mkdir()
        (d / name).write_text("{}")
    cases = [
        (["run", "altmin", "--out", str(held)], "already holds a run"),
        (["run", "noisygd", "--out", str(sweep)], "holds a sweep"),
        (["run", "dpattention", "--epsilon", "1"], "epsilon must be in (0, 0.1)"),
        (["run", "altmin", "--samples-per-user", "7"], "samples_per_user must be a multiple of 4"),
        (["run", "altmn"], "did you mean 'altmin'?"),
        (["runn", "altmin"], "did you mean 'run'?"),
        (["run", "altmin", "--noise", "banded"], "altmin has no --noise (noise across gradient rounds"),
        (["privacy", str(held), "--quiett"], "unrecognized arguments"),
    ]
    code = (
        "import contextlib, io, json, sys\nfrom fedpers.commands.cli import main\nout = []\n"
        "for case in json.loads(sys.argv[1]):\n    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n        try:\n            status = main(case)\n"
        "        except SystemExit as e:\n            status = e.code\n"
        "    out.append([status, err.getvalue()])\n"
        "print(json.dumps([out, 'torch' in sys.modules]))"
    )
    proc = _run(code, json.dumps([c for c, _ in cases]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers, torch = json.loads(proc.stdout.strip().splitlines()[-1])
    for (case, reason), (status, err) in zip(cases, answers, strict=True):
        assert status == 2 and reason in err, (case, status, err)
    assert torch is False
