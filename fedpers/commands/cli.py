"""Command line: ``fedpers run ALGO``, ``fedpers resume RUN_DIR``, ``fedpers sweep FILE.toml``,
``fedpers compare RUN_DIR...``, ``fedpers privacy RUN_DIR``, ``fedpers report RUN_DIR|SWEEP_DIR``."""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpers.commands import audit as audit_command
from fedpers.commands.parsers import (
    ChoiceSuggestingParser,
    RegisteredAccountants,
    add_tracking,
    algorithm_parser,
    out_directory,
    run_settings,
)
from fedpers.config import PreconditionFailed

if TYPE_CHECKING:
    from fedpers.results.run_result import RunResult


def _seconds(text: str) -> float:
    """A finite number of seconds >= 0 (argparse refuses anything else, naming the flag)."""
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0; got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser. It imports no algorithm: ``fedpers run ALGO ...`` hands the rest of
    the line to :func:`algorithm_parser`, built only for the algorithm asked for."""
    from fedpers import __version__
    from fedpers.experiments import ALGORITHMS

    parser = ChoiceSuggestingParser(
        prog="fedpers", description="Federated simulator for DP personalization (billboard model).", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"fedpers {__version__}")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show third-party deprecation notices and Flower/Ray warnings (hidden by default; accepted anywhere on the line)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run one algorithm and write a run directory",
        allow_abbrev=False,
        description="algorithms:\n"
        + "\n".join(f"  {name:<12} {text}" for name, (_, _, text) in ALGORITHMS.items())
        + "\n\n`fedpers run ALGO --help` lists ALGO's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("algorithm", choices=list(ALGORITHMS), metavar="ALGO", help="one of: " + ", ".join(ALGORITHMS))
    run.add_argument("args", nargs=argparse.REMAINDER, help="the algorithm's flags (see fedpers run ALGO --help)")
    sw = sub.add_parser("sweep", help="run a grid from a TOML file; write a table and figures", allow_abbrev=False)
    sw.add_argument("file", type=Path)
    sw.add_argument("--out", type=out_directory, help="output directory (default: runs/sweep-<name>-<time>)")
    sw.add_argument("--repetitions", type=int, help="override the number of Monte-Carlo repetitions")
    sw.add_argument(
        "--workers", type=int, default=1, help="points run concurrently on Ray (default 1: one at a time, no Ray)"
    )
    sw.add_argument(
        "--ray-address",
        default="",
        help="run the points on this running Ray cluster (e.g. 10.0.0.5:6379) instead of a new local Ray",
    )
    sw.add_argument("--quiet", action="store_true", help="no progress bar")
    sw.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout (the summary sweep.json holds, its directory and its table's rows; "
        "with --select the selection); no progress bar, the other lines on stderr",
    )
    for key, what in (("xlabel", "x-axis label"), ("ylabel", "y-axis label"), ("title", "title")):
        sw.add_argument(
            f"--{key}",
            help=f"the figures' {what} (over the file's [plot] {key}; default: from the field's and metric's definitions)",
        )
    _add_select_flags(sw)
    add_tracking(sw)
    rs = sub.add_parser(
        "resume", help="continue a killed run from its last checkpoint (same result, same ledger)", allow_abbrev=False
    )
    rs.add_argument("run_dir", type=Path)
    rs.add_argument("--json", action="store_true", help="print one JSON object with the result on stdout")
    rs.add_argument("--quiet", action="store_true", help="no progress bar")
    add_tracking(rs)
    cp = sub.add_parser(
        "compare", help="runs side by side: ε spent, noise, primary metrics, time; optional figure", allow_abbrev=False
    )
    cp.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    cp.add_argument("--json", action="store_true", help="print one JSON object (rows and metric columns)")
    cp.add_argument("--out", type=Path, help="also draw the metrics, one panel each, into this PNG")
    dp = sub.add_parser(
        "deploy",
        help="deployment across machines: certs, run, app-hash; supernode/superexec (faster Flower wrappers, Flower 1.41-1.42)",
        allow_abbrev=False,
    )
    dsub = dp.add_subparsers(dest="deploy_command", required=True)
    ce = dsub.add_parser(
        "certs",
        help="a CA, the SuperLink's TLS certificate and SuperNode key pairs; prints the commands",
        allow_abbrev=False,
    )
    ce.add_argument("dir", type=Path)
    ce.add_argument(
        "--host",
        action="append",
        default=[],
        help="the SuperLink's name or IP as SuperNodes reach it (repeat for more)",
    )
    ce.add_argument("--supernodes", type=int, default=1, help="SuperNode key pairs to create (default 1)")
    ce.add_argument("--days", type=int, default=365, help="certificate validity in days (default 365)")
    ce.add_argument("--force", action="store_true", help="overwrite the keys in an existing directory")
    ce.add_argument(
        "--port",
        type=int,
        default=9092,
        help="the network port SuperNodes connect to: fleet-proxy, the Fleet API only (default 9092)",
    )
    ce.add_argument("--link-port", type=int, default=9093, help="the SuperLink's own port, on 127.0.0.1 (default 9093)")
    ce.add_argument("--node-port", type=int, default=9094, help="SuperNode I's local port is this + I (default 9094)")
    ce.add_argument("--listen", default="0.0.0.0", help="the address fleet-proxy listens on (default 0.0.0.0)")
    ce.add_argument(
        "--data-file", default="/data/users.npz", help="each SuperNode's data file (default /data/users.npz)"
    )
    for flag, default, what in (
        ("--n-users", 300, "users in each SuperNode's data file"),
        ("--dim", 10, "the data's dimension d"),
        ("--samples-per-user", 20, "samples per user m"),
    ):
        ce.add_argument(
            flag,
            type=int,
            default=default,
            help=f"the job's declared shape in the printed run command: {what} (default {default}; every node "
            "refuses a task its file does not match)",
        )
    ce.add_argument(
        "--app",
        default="",
        help="the lab's checkout: its FAB hash goes into --trust-app (default: a $(fedpers deploy app-hash ...) placeholder)",
    )
    ce.add_argument(
        "--policy",
        type=Path,
        help="the lab's privacy policy TOML to copy to every machine (default: a template with max-epsilon 8, min-units 50)",
    )
    dc = dsub.add_parser(
        "connection",
        help="on the SuperLink machine: DIR/flwr/config.toml, flwr's loopback connection naming DIR/ca.crt by its "
        "absolute path here (the recipe's step 4)",
        allow_abbrev=False,
    )
    dc.add_argument("dir", type=Path, help="the SuperLink's directory written by fedpers deploy certs (superlink)")
    dc.add_argument("--link-port", type=int, default=9093, help="the SuperLink's own port, on 127.0.0.1 (default 9093)")
    dr = dsub.add_parser(
        "run",
        help="flwr run, stream the logs, wait; exit 0 only if the run completed (flwr run --stream exits 0 either way)",
        allow_abbrev=False,
    )
    dr.add_argument("superlink", help="the flwr SuperLink connection name (e.g. deployment)")
    dr.add_argument("--app", default=".", help="the Flower app directory (default: .)")
    dr.add_argument("--run-config", default="", help="passed to flwr run --run-config")
    dr.add_argument("--timeout", type=_seconds, default=0.0, help="give up waiting after this many seconds (0: never)")
    se = dsub.add_parser(
        "superexec",
        help="flower-superexec (same flags) for a SuperNode with --isolation process, forking warm ClientApp processes",
        allow_abbrev=False,
    )
    se.add_argument(
        "flower_args",
        nargs=argparse.REMAINDER,
        help="[--trust-app SHA256 ...] and flower-superexec's flags, e.g. --runtime-api-address 127.0.0.1:9094 --insecure",
    )
    sn = dsub.add_parser(
        "supernode",
        help="flower-supernode (same flags) with warm ClientApps, polling every --poll s (default 0.2) instead of 3 s",
        allow_abbrev=False,
    )
    sn.add_argument(
        "flower_args",
        nargs=argparse.REMAINDER,
        help="[--poll S] [--trust-app SHA256 ...] and flower-supernode's flags; --trust-app: run only the apps with these FAB hashes",
    )
    sl = dsub.add_parser(
        "superlink",
        help="flower-superlink (same flags) answering only this uid and --allow-uid ones (the Control API included)",
        allow_abbrev=False,
    )
    sl.add_argument(
        "flower_args",
        nargs=argparse.REMAINDER,
        help="[--allow-uid UID ...] and flower-superlink's flags, e.g. --host 127.0.0.1 --port 9093 --ssl-certfile ...",
    )
    fp = dsub.add_parser(
        "fleet-proxy",
        help="the SuperLink's network face: its Fleet API only (TLS), the loopback SuperLink behind it",
        allow_abbrev=False,
    )
    fp.add_argument(
        "proxy_args",
        nargs=argparse.REMAINDER,
        help="--listen HOST:PORT --superlink 127.0.0.1:PORT --ssl-certfile --ssl-keyfile --ssl-ca-certfile",
    )
    ah = dsub.add_parser(
        "app-hash",
        help="the SHA-256 of the Flower app (FAB) that `flwr run DIR` sends: what a SuperNode's --trust-app lists",
        allow_abbrev=False,
    )
    ah.add_argument("app", nargs="?", default=".", help="the Flower app directory (default: .)")
    au = sub.add_parser(
        "audit",
        help="empirical lower bound on ε from canary users, beside the proven ε",
        allow_abbrev=False,
        description=audit_command.AUDIT_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    au.add_argument(
        "algorithm",
        metavar="ALGO|RUN_DIR",
        help="one of: " + ", ".join(ALGORITHMS) + "; or a finished run directory (audits its configuration)",
    )
    au.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="[--canaries K] [--runs R] [--confidence C] [--audit-seed S] and ALGO's flags",
    )
    rp = sub.add_parser(
        "report",
        help="one self-contained HTML page of a run or a sweep (privacy, ledger, metrics and baselines, figures, provenance)",
        allow_abbrev=False,
    )
    rp.add_argument("dir", type=Path, metavar="RUN_DIR|SWEEP_DIR")
    rp.add_argument("--out", type=Path, help="the HTML file to write (default: DIR/report.html)")
    pr = sub.add_parser("privacy", help="print a run's privacy ledger and its (ε, δ)", allow_abbrev=False)
    pr.add_argument("run_dir", type=Path)
    pr.add_argument(
        "--accountant",
        choices=RegisteredAccountants(),
        metavar="ACCOUNTANT",  # argparse would list the choices (import the registry) while building the parser
        default=None,
        help="re-account with this accountant: one of %(choices)s",
    )
    pr.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    pr.add_argument("--quiet", action="store_true", help="print only the (ε, δ) line")
    return parser


def _track(kind: str | None, uri: str | None, *, run_dir: str | None = None, sweep_dir: str | None = None) -> None:
    if not kind:
        return
    from fedpers.commands import tracking

    if sweep_dir is not None:
        where = (
            tracking.track_sweep(sweep_dir, kind, uri=uri)
            if kind == "mlflow"
            else tracking.track_sweep(sweep_dir, kind)
        )
        print(f"tracked {len(where['points'])} sweep points in {kind}", file=sys.stderr)
    elif run_dir is not None:
        where = tracking.track_run(
            run_dir, kind, uri=uri if kind == "mlflow" else None, logdir=uri if kind == "tensorboard" else None
        )
        print(
            f"tracked in {kind}: " + ", ".join(f"{k} {v}" for k, v in where.items() if k != "tracker"), file=sys.stderr
        )


def print_summary(result: Mapping[str, Any] | RunResult, out: typing.TextIO | None = None) -> None:
    """A readable summary: privacy, the main metrics, and the baselines side by side
    (:func:`fedpers.commands.summary.summary_text`)."""
    from fedpers.commands.summary import summary_text

    out = out if out is not None else sys.stdout  # looked up now, so a redirected stdout is honoured
    print(summary_text(_run_result(result)), file=out)


def print_warnings(result: Mapping[str, Any] | RunResult, out: typing.TextIO | None = None) -> None:
    """The result's warnings (a private result no better than a trivial baseline), loudly."""
    from fedpers.commands.summary import warning_lines

    out = out if out is not None else sys.stdout
    for line in warning_lines(_run_result(result)):
        print(line, file=out)


def _run_result(result: Mapping[str, Any] | RunResult) -> RunResult:
    from fedpers.results.run_result import RunResult

    return result if isinstance(result, RunResult) else RunResult.from_dict(result)


def cmd_run(args: argparse.Namespace) -> int:
    """``fedpers run ALGO ...``: the line is parsed once and the config and runtime options built
    from their classes (:func:`run_settings`, no torch), so ``--help``, a mistyped flag and any bad
    value are answered before the run's libraries are imported; then the run."""
    parsed = algorithm_parser(args.algorithm).parse_args(args.args)
    parsed.algorithm = args.algorithm
    parsed.settings = run_settings(args.algorithm, parsed)
    if parsed.out is not None:
        from fedpers.results.rundir import check_free

        check_free(parsed.out)  # an --out holding a run is refused before torch is imported
    if parsed.track:
        from fedpers.commands.tracking import check_uri

        check_uri(parsed.track, parsed.track_uri)  # a missing extra or an unusable URI is refused before any work
    return _as_process(args, lambda _: _run(parsed))


def _as_process(args: argparse.Namespace, body: typing.Callable[[argparse.Namespace], int]) -> int:
    """``body(args)``; in a process of its own (``fedpers`` as the entry point), with a plot worker
    started first (the plots' start-up overlaps the run) and, once it completed, an exit without
    teardown (:func:`_end_without_teardown`)."""
    if not getattr(args, "entry_point", False):
        return body(args)
    from fedpers.results.plots import start_worker, stop_worker

    start_worker()
    _import_run_libraries()
    try:
        status = body(args)
    finally:
        stop_worker()
    _ENDING["no_teardown"] = True
    return status


def _import_run_libraries() -> None:
    """Import what a run needs (torch, dp-accounting, scipy: ~220,000 objects) with the cyclic
    collector paused, then move those objects to the permanent generation. Otherwise the
    collector walks all of them several times while they are created (0.2-0.3 s of full
    collections per process) and again in every later full collection; module objects live
    as long as the process anyway. Only for a process of its own (a run, a resume, a sweep).

    Ctrl-C and SIGTERM wait for the imports to finish: torch aborts the process (pybind11's
    terminate) or cannot be imported again when a KeyboardInterrupt lands inside its import.
    The signal then ends the run as it would at any later point."""
    import gc
    import signal
    import threading

    pending: list[int] = []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda received, frame: pending.append(received))
    gc.disable()
    try:
        import fedpers.runner  # noqa: F401
    finally:
        gc.freeze()
        gc.enable()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if signal.SIGTERM in pending:
        _terminate(signal.SIGTERM, None)
    if pending:
        raise KeyboardInterrupt


def _run(args: argparse.Namespace) -> int:
    from fedpers.experiments import experiment
    from fedpers.runner import execute
    from fedpers.seeds import split_seed

    exp = experiment(args.algorithm)
    cfg, options = args.settings
    for line in exp.plan(split_seed(cfg)[0]):  # the config the run trains on (its public seed splits the data)
        print(line, file=sys.stderr, flush=True)
    result = execute(exp, cfg, options, out=args.out, progress=not (args.quiet or args.json))
    _print_result(result, args.json)
    _track(args.track, args.track_uri, run_dir=result.get("run_dir"))
    return 0


def _print_result(result: Mapping[str, Any], as_json: bool) -> None:
    from fedpers.commands.summary import json_text

    run = _run_result({k: v for k, v in result.items() if not k.startswith("_")})
    if as_json:
        print_warnings(run, sys.stderr)  # stdout stays one JSON object; the warnings are in it too
        print(json_text(run))
    else:
        print_summary(run)


def cmd_resume(args: argparse.Namespace) -> int:
    return _as_process(args, _resume)


def _resume(args: argparse.Namespace) -> int:
    from fedpers.runner import resume_run

    if args.track:
        from fedpers.commands.tracking import check_uri

        check_uri(args.track, args.track_uri)  # a missing extra or an unusable URI is refused before any work
    result = resume_run(args.run_dir, progress=not (args.quiet or args.json))
    _print_result(result, args.json)
    _track(args.track, args.track_uri, run_dir=result.get("run_dir"))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """``fedpers sweep``; with ``--json`` stdout is one JSON object (as ``run``, ``compare`` and ``privacy``
    print theirs) and every line meant for a reader goes to stderr."""
    if getattr(args, "entry_point", False):
        _import_run_libraries()
    if not args.json:
        _sweep(args)
        return 0
    import contextlib

    from fedpers.results.rundir import dumps

    args.quiet = True  # as run --json: no progress bar
    with contextlib.redirect_stdout(sys.stderr):
        result = _sweep(args)
    print(dumps(result, indent=None))
    return 0


def _sweep(args: argparse.Namespace) -> dict[str, Any]:
    """The sweep, sweep set or selection ``args`` ask for; returns what ``--json`` prints."""
    from fedpers.sweeps.run import run_sweep
    from fedpers.sweeps.sets import run_sweep_set, sweep_set

    how = {
        "out": args.out,
        "repetitions": args.repetitions,
        "progress": not args.quiet,
        "workers": args.workers,
        "ray_address": args.ray_address,
        "labels": {"xlabel": args.xlabel, "ylabel": args.ylabel, "title": args.title},
    }
    if sweep_set(args.file) is not None:  # several sweeps (one algorithm each) run in turn
        if args.select is not None or args.private or args.track:
            raise ValueError("sweep: --select, --private and --track take one sweep file, not a sweep set")
        return run_sweep_set(args.file, **how)
    if args.select is not None or args.private:
        return cmd_select(args)
    if args.track:
        from fedpers.commands.tracking import check_uri

        check_uri(args.track, args.track_uri)  # a missing extra or an unusable URI is refused before any work
    summary = run_sweep(args.file, **how)
    _track(args.track, args.track_uri, sweep_dir=summary.get("out"))
    return summary


def cmd_compare(args: argparse.Namespace) -> int:
    from fedpers.commands.compare import compare, figure_metrics, format_table
    from fedpers.results.rundir import dumps

    if args.out is not None:
        if args.out.suffix.lower() != ".png":
            raise ValueError(f"--out must name a .png file; got {args.out}")
        _check_output_file(args.out)
    rows, metrics, primary = compare(args.run_dirs)
    if args.out is not None:
        from fedpers.commands.summary import quantities_of
        from fedpers.results.plots import _plt, compare_figure, save

        own: dict[str, Any] = {}
        for name in dict.fromkeys(str(r.get("algorithm")) for r in rows):
            own = {**quantities_of(name), **own}
        fig = compare_figure(rows, figure_metrics(rows, metrics, primary), own)
        save(fig, args.out)
        _plt().close(fig)
    print(
        dumps({"rows": rows, "metrics": metrics, "figure": str(args.out) if args.out else None}, indent=None)
        if args.json
        else format_table(rows, metrics)
    )
    return 0


FLOWER_WRAPPERS = ("superexec", "supernode", "superlink")
"""``fedpers deploy`` commands that take Flower's own flags (each wraps Flower's command of that name)."""


def _flower_wrapper(command: str) -> Callable[[list[str]], int]:
    """``fedpers deploy superexec|supernode|superlink``: Flower's command of that name, wrapped (fedpers/deploy)."""
    from fedpers.deploy import forkserver, superlink, supernode

    wrappers = {"superexec": forkserver.superexec, "supernode": supernode.supernode, "superlink": superlink.superlink}
    return wrappers[command]


def cmd_deploy(args: argparse.Namespace) -> int:
    from fedpers.deploy import make_certs, run_and_wait

    if args.deploy_command == "run":
        return run_and_wait(args.app, args.superlink, args.run_config, timeout=args.timeout)[0]
    if args.deploy_command == "app-hash":
        from fedpers.deploy.forkserver import app_hash

        print(app_hash(args.app))
        return 0
    if args.deploy_command == "fleet-proxy":
        from fedpers.deploy.fleetproxy import main as proxy

        return proxy(list(args.proxy_args))
    if args.deploy_command == "connection":
        from fedpers.deploy.recipe import write_connection

        print(f"wrote {write_connection(args.dir, args.link_port)}")
        return 0
    if args.deploy_command in FLOWER_WRAPPERS:  # reached only without flags (main() passes flags through)
        return _flower_wrapper(args.deploy_command)(list(args.flower_args))

    from fedpers.runtime.flower.policy import load_policy

    if args.policy is not None:
        if not args.policy.is_file():
            raise ValueError(f"--policy: {args.policy} is not a file; name the lab's policy TOML (docs/flower.md)")
        load_policy(args.policy)  # a malformed policy is refused before anything is written
    fab = ""  # the FAB hash SuperNodes trust (none: a placeholder in the printed commands)
    if args.app:
        from fedpers.deploy.forkserver import app_hash as fab_hash

        fab = fab_hash(args.app)
    files = make_certs(
        args.dir,
        args.host,
        args.supernodes,
        days=args.days,
        force=args.force,
        port=args.port,
        link_port=args.link_port,
        node_port=args.node_port,
        listen=args.listen,
        data_file=args.data_file,
        app_hash=fab,
        n_users=args.n_users,
        dim=args.dim,
        samples_per_user=args.samples_per_user,
        policy=args.policy.read_text() if args.policy is not None else None,
    )
    print(
        f"wrote {len(files)} files to {args.dir} (directories 0700, files 0600), one directory per machine:",
        ", ".join(sorted(files)),
    )
    print(files["commands.txt"].read_text(), end="")
    return 0


def _check_output_file(out: Path) -> None:
    """Refuse an ``--out`` file that cannot be written (a directory, a missing folder) before any work."""
    if out.is_dir():
        raise ValueError(f"--out: {out} is a directory; name the file to write")
    if not out.parent.is_dir():
        raise ValueError(f"--out: the folder {out.parent} does not exist (or is not a folder); create it first")


def cmd_report(args: argparse.Namespace) -> int:
    from fedpers.commands.report import write_report

    if args.out is not None:
        _check_output_file(args.out)
    print(write_report(args.dir, args.out))
    return 0


def cmd_privacy(args: argparse.Namespace) -> int:
    from fedpers.commands.privacy_report import privacy_report, privacy_summary
    from fedpers.results.rundir import dumps

    print(
        dumps(privacy_summary(args.run_dir, args.accountant), indent=None)
        if args.json
        else privacy_report(args.run_dir, args.accountant, quiet=args.quiet)
    )
    return 0


def _add_select_flags(sw: argparse.ArgumentParser) -> None:
    g = sw.add_argument_group("selection (docs/audit.md)")
    g.add_argument(
        "--select", metavar="METRIC", help="choose the best grid point by METRIC (non-private unless --private)"
    )
    g.add_argument("--goal", choices=["min", "max"], default="min", help="minimise or maximise METRIC (default min)")
    g.add_argument(
        "--private",
        action="store_true",
        help="private selection (Papernot-Steinke): METRIC is a private validation score; reports the ε of tuning + final run",
    )
    g.add_argument("--tuning-mean", type=float, help="mean number of trials with --private (default 2 x grid points)")
    g.add_argument(
        "--tuning-shape",
        type=float,
        default=1.0,
        help="η of the truncated negative binomial number of trials (1: geometric; 0: logarithmic)",
    )
    g.add_argument(
        "--validation-users", type=int, default=2000, help="held-out users of the private score (default 2000)"
    )
    g.add_argument("--tuning-seed", type=int, default=0, help="seed of the trials' draws and noise (default 0)")
    g.add_argument(
        "--secure-noise",
        action="store_true",
        help="with --private: draw the number of trials, the candidates and every trial's and the final run's noise "
        "from OS entropy (the number of trials must stay secret for the guarantee); --tuning-seed is then unused",
    )


def cmd_select(args: argparse.Namespace) -> dict[str, Any]:
    """``sweep --select``: the sweep then a non-private choice, or (``--private``) a private search in place of the sweep."""
    import time

    from fedpers.sweeps.run import load_spec, run_sweep
    from fedpers.sweeps.tuning import Goal, format_selection, private_select, select_nonprivate

    if args.select is None:
        raise ValueError("select: --private needs --select METRIC")
    spec = load_spec(args.file, args.repetitions)
    out = (
        args.out or Path("runs") / f"{'tune' if args.private else 'sweep'}-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    goal = Goal(args.goal)
    if args.private:
        result = private_select(
            spec,
            args.select,
            goal,
            mean=args.tuning_mean,
            shape=args.tuning_shape,
            validation_users=args.validation_users,
            seed=args.tuning_seed,
            out=out,
            progress=not args.quiet,
            secure_noise=args.secure_noise,
        )
    else:
        run_sweep(
            args.file,
            out=out,
            repetitions=args.repetitions,
            progress=not args.quiet,
            workers=args.workers,
            ray_address=args.ray_address,
        )
        result = select_nonprivate(out, args.select, goal)
    from fedpers.results.rundir import dumps, write_atomic

    Path(out).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(out) / "selection.json", dumps(result) + "\n")
    print(format_selection(result, args.select))
    return result


class _DropNotices:
    """A logging filter: Flower's "DEPRECATED FEATURE" notices and its actor-shutdown chatter,
    which a user of ``fedpers`` cannot act on (fedpers, not the user, calls Flower)."""

    PHRASES = ("DEPRECATED", "Manually terminating")

    def filter(self, record: Any) -> bool:
        text = str(record.msg)
        return not any(p in text for p in self.PHRASES)


NOISY_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def quiet_third_party(verbose: bool) -> None:
    """Hide warnings about libraries' own future changes (Ray's FutureWarning, Flower's
    DEPRECATED lines, numpy/torch deprecations) unless ``--verbose``; fedpers' own warnings and
    every warning of another kind still show. Ray workers inherit the filter through
    ``PYTHONWARNINGS``."""
    import logging
    import os
    import warnings

    if verbose:
        return
    for category in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("default", category=category, module=r"fedpers(\.|$)")
    os.environ.setdefault("PYTHONWARNINGS", ",".join(f"ignore::{c.__name__}" for c in NOISY_WARNINGS))
    # Flower's ClientApp actors run in Ray workers, where a filter set here does not reach:
    # Flower reads its console level from FLWR_LOG_LEVEL at import. Errors still show.
    os.environ.setdefault("FLWR_LOG_LEVEL", "ERROR")
    logging.getLogger("flwr").addFilter(_DropNotices())


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM ends a run the way Ctrl-C does: its records (ledger, error.json) are written."""
    raise KeyboardInterrupt(f"signal {signum}")


_ENDING: dict[str, int | bool] = {}
"""How the process may end: ``"no_teardown"`` once a run's records are all written and closed,
``"status"`` the exit status :func:`_end_without_teardown` ends it with."""


def main(argv: Sequence[str] | None = None) -> int:
    """``fedpers ARGS``: the exit status of the command. Called as the process's entry point
    (``argv`` None), it leaves the interpreter's exit cheap: see :func:`_cheap_exit` and
    :func:`_end_without_teardown`."""
    if argv is None:
        import atexit

        _ENDING.clear()
        atexit.register(_end_without_teardown)  # registered first, so it runs after every other handler
    status = _main(argv)
    if argv is None:
        _cheap_exit()
        if _ENDING.get("no_teardown"):
            _ENDING["status"] = status
    return status


def _end_without_teardown() -> None:
    """The process's last exit handler. After a completed ``fedpers run`` (every record written
    whole and closed, the plot worker reaped), once the interpreter has joined its threads and run
    every other exit handler, end the process with its status instead of tearing its modules down:
    the teardown only frees memory the operating system takes back (0.3-1.7 s with torch and the
    accounting libraries loaded). Any other ending (an error, another command) is left as it is."""
    import os

    status = _ENDING.get("status")
    if status is None or isinstance(status, bool):
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be written to it
            pass
    os._exit(status)


def _cheap_exit() -> None:
    """Freeze what the process holds out of the cyclic collector before the interpreter exits:
    its exit-time collections would walk every object torch and the accounting libraries
    created (0.3-0.9 s) to free memory the operating system takes back anyway. Exit handlers,
    stream flushes and reference-counted cleanup still run; only garbage in reference cycles
    is left to the process's end, as it is for every object alive at exit."""
    import gc

    gc.freeze()


def _main(argv: Sequence[str] | None) -> int:
    import os
    import signal

    entry_point = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in argv[: argv.index("--") if "--" in argv else len(argv)]
    if verbose:
        argv.remove("--verbose")
    if argv[:2] == ["deploy", "fleet-proxy"]:  # its own flags (argparse.REMAINDER would take none before a flag)
        from fedpers.deploy.fleetproxy import main as proxy

        return proxy(argv[2:])
    flower_flags = argv[:1] == ["deploy"] and argv[1:2] and argv[1] in FLOWER_WRAPPERS
    if flower_flags and not {"-h", "--help"} & set(argv[2:]):  # Flower's own flags, untouched
        return _flower_wrapper(argv[1])(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    args.entry_point = entry_point
    try:
        signal.signal(signal.SIGTERM, _terminate)
        if args.command != "deploy":  # `deploy run` streams Flower's own log: left as Flower prints it
            quiet_third_party(verbose)
        if args.command in ("run", "resume", "sweep", "audit"):
            from fedpers.memory import reuse_freed_memory

            reuse_freed_memory()
        commands = {
            "run": cmd_run,
            "resume": cmd_resume,
            "sweep": cmd_sweep,
            "compare": cmd_compare,
            "deploy": cmd_deploy,
            "privacy": cmd_privacy,
            "audit": audit_command.cmd_audit,
            "report": cmd_report,
        }
        return commands[args.command](args)
    except ValueError as e:
        print(f"fedpers: error: {e}", file=sys.stderr)
        return 2
    except PreconditionFailed as e:  # decided on the data after work began: a failure, never a result
        print(f"fedpers: failed: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (:func:`_terminate`): the records are written by now
        by = str(e) or "Ctrl-C"
        print(
            f"fedpers: interrupted ({by}); what was written is kept: a run directory with releases "
            "continues with `fedpers resume RUN_DIR`, a sweep with the same command again",
            file=sys.stderr,
        )
        return 143 if by == f"signal {signal.SIGTERM}" else 130
    except BrokenPipeError:  # `fedpers privacy RUN | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
