"""``fedpers audit ALGO|RUN_DIR``: the command over the audit library (:mod:`fedpers.audit`): it parses the
line, runs the audit, prints the report and saves the result; the canaries, published runs, scores and
bounds are the library's. Imports nothing heavy until a line asks for an audit (``fedpers --help`` reads
this module's description)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

AUDIT_DESCRIPTION = (
    "K canary users (each holding one of two neighbouring data sets, by a fair coin) run through the real\n"
    "server path; each is scored from the broadcasts and noisy releases only; the guesses give lower\n"
    "bounds on ε at the run's δ (docs/audit.md). `fedpers audit ALGO [--canaries K] [--runs R]` + ALGO's flags;\n"
    "--out DIR saves the result as DIR/audit.json (never over an earlier one), --quiet prints nothing."
)


def audit_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedpers audit ALGO", add_help=False, allow_abbrev=False)
    p.add_argument(
        "--canaries",
        type=int,
        default=None,
        help="canary users per run (orthogonal: at most the design's capacity; default 10, or the capacity if smaller)",
    )
    p.add_argument("--runs", type=int, default=1, help="independent runs, K canaries each (default 1)")
    p.add_argument("--confidence", type=float, default=0.95, help="confidence of the lower bounds (default 0.95)")
    p.add_argument(
        "--audit-seed", type=int, default=0, help="seed of the coins, canaries and noise of the audit runs (default 0)"
    )
    p.add_argument(
        "--placement",
        choices=["auto", "orthogonal", "random", "paired", "steered"],
        default="auto",
        help="canary directions: one orthogonal coordinate each, random (any number; interference scored), "
        "or auto: orthogonal up to the design's capacity, random beyond (default); paired: the same data on one of "
        "two orthogonal coordinates (a PSD release, e.g. altmin's A, moves by its full sensitivity); steered: every "
        "round's data rebuilt from its broadcast (fedrep)",
    )
    p.add_argument(
        "--releases",
        default=None,
        help="comma-separated statistic names (e.g. W,b for altmin): score only those releases, against the proven "
        "ε of those releases alone (default: every release, against the run's proven ε)",
    )
    p.add_argument(
        "--score",
        choices=["threshold", "gaussian"],
        default="threshold",
        help="which bound the report leads with: threshold (non-parametric, any mechanism; default) or gaussian "
        "(Gaussian-score μ, labelled with its assumption); both are always printed",
    )
    return p


def cmd_audit(args: argparse.Namespace) -> int:
    """``fedpers audit ALGO|RUN_DIR``: parse, run the audit (:mod:`fedpers.audit`), print and save."""
    from fedpers.commands.parsers import algorithm_parser, run_settings

    if {"-h", "--help"} & set(args.args):  # read from the config classes (no torch)
        print(audit_flags().format_help())
        algorithm_parser(args.algorithm).print_help()
        return 0
    from fedpers.results.rundir import dumps

    own, rest = audit_flags().parse_known_args(args.args)
    releases = None if own.releases is None else tuple(n.strip() for n in own.releases.split(","))
    if Path(args.algorithm).is_dir():
        if rest:
            raise ValueError(f"audit RUN_DIR: the run's own configuration is audited; unexpected flags {rest}")
        done = audit_run_dir(
            args.algorithm,
            own.canaries,
            own.runs,
            own.confidence,
            own.audit_seed,
            placement=own.placement,
            releases=releases,
        )
        print(format_run_audit(done, score=own.score))
        return 0
    from fedpers.experiments import ALGORITHMS

    if args.algorithm not in ALGORITHMS:
        raise ValueError(
            f"audit: ALGO must be one of {', '.join(ALGORITHMS)} or a run directory; got {args.algorithm!r}"
        )
    algo_args = algorithm_parser(args.algorithm).parse_args(rest)
    saved = _audit_file(algo_args.out)  # checked before any audit run: nothing is computed to be lost
    cfg, options = run_settings(args.algorithm, algo_args)  # every bad value refused before the audit's libraries load
    from fedpers.audit import audit
    from fedpers.configs.runtime import Runtime
    from fedpers.experiments import experiment

    result = audit(
        experiment(args.algorithm),
        cfg,
        own.canaries,
        runs=own.runs,
        confidence=own.confidence,
        seed=own.audit_seed,
        placement=own.placement,
        releases=releases,
        flower=options if options.runtime == Runtime.FLOWER else None,
        node_side=options,
    )
    if saved is not None:
        from fedpers.results.rundir import write_atomic

        saved.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(saved, dumps(result))
    if not algo_args.quiet:
        print(dumps(result, indent=None) if algo_args.json else format_audit(result, score=own.score))
    if saved is not None:
        print(f"audit written to {saved}", file=sys.stderr)
    return 0


def _audit_file(out: Path | None) -> Path | None:
    """Where ``fedpers audit ALGO --out DIR`` saves its result (DIR/audit.json), refused before any
    work when DIR is a file or already holds an audit (never overwritten)."""
    if out is None:
        return None
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {out} is a file; name a directory for audit.json")
    if (out / "audit.json").exists():
        raise ValueError(f"out: {out} already holds an audit.json; name a new directory")
    blocked = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ValueError(f"out: {blocked} is a file, so {out} cannot be created")
    return out / "audit.json"


SCORES = ("threshold", "gaussian")


def headline(result: Mapping[str, Any], score: str = "threshold") -> str:
    """The one line a report leads with: the chosen bound's ε lower bound and its ratio to the proven ε.
    ``threshold``: the largest non-parametric bound (valid for any mechanism or under the GDP claim);
    ``gaussian``: the Gaussian-score lower bound, with its assumption named."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {', '.join(SCORES)}; got {score!r}")
    proven = float(result["proven_epsilon"])
    if score == "gaussian":
        null = result.get("gaussian_score_null")
        gauss = null or result.get("gaussian_score")
        if gauss is None:
            return "  headline (Gaussian score): none (a side of the coins has fewer than 2 canaries)"
        bound = float(gauss["epsilon_lower"])
        what = (
            "Gaussian score against empty slots, assuming i.i.d. Gaussian noise"
            if null
            else "Gaussian score, assuming Gaussian scores"
        )
    else:
        bound = max(
            float(result["epsilon_lower"]),
            float(result["one_run_gdp"]["epsilon_lower"]),
            float(result["independent_gdp"]["epsilon_lower"]),
        )
        what = "threshold, non-parametric"
    ratio = f" = {bound / proven:.2f} × proven ε {proven:.4g}" if proven > 0 else ""
    return f"  headline ({what}): ε ≥ {bound:.4g}{ratio}"


def format_audit(result: Mapping[str, Any], score: str = "threshold") -> str:
    """A short report: the chosen headline bound, then proven ε beside each empirical lower bound,
    and what was tested."""
    from fedpers.audit.scores import gdp_epsilon

    mu = result["proven_mu"]
    one, gdp, ind = result["one_run"], result["one_run_gdp"], result["independent_gdp"]
    proven = f"  proven ε = {result['proven_epsilon']:.4g}" + (f" (μ-GDP, μ = {mu:.4g})" if mu is not None else "")
    if result.get("audited_releases", "all") != "all":
        proven += (
            f" for the audited releases {', '.join(result['audited_releases'])} alone"
            f" (the whole run: ε = {result['run_proven_epsilon']:.4g})"
        )
    lines = [
        f"audit of {result['algorithm']}: {result['runs']} run(s) × {result['canaries_per_run']} canaries, "
        f"confidence {result['confidence']}, δ = {result['delta']:.3g}",
        f"  neighbours: {result['neighbouring']}",
        f"  releases tested: {result['releases_tested']}",
        headline(result, score),
        f"  canaries: {result['canary_design']} (separation μ = {result['canary_mu']:.3f})",
        proven,
        f"  empirical ε lower bound, any mechanism (Steinke et al. 2023): {result['epsilon_lower']:.4g}  [{one['correct']}/{one['guesses']} guesses right]",
        f"  μ-GDP claim rejected up to μ = {gdp['mu_lower']:.4g} (one run, Mahloujifar et al. 2024): ε ≥ {gdp['epsilon_lower']:.4g}",
        f"  μ lower bound, canaries as independent trials (Clopper–Pearson): {ind['mu_lower']:.4g}: ε ≥ {ind['epsilon_lower']:.4g}",
    ]
    gauss = result.get("gaussian_score")
    if gauss is not None:
        lines.append(
            f"  Gaussian-score bound, ASSUMING {gauss['assumption']}:\n    μ = {gauss['mu']:.4g} "
            f"[{gauss['confidence']:g} lower bound {gauss['mu_lower']:.4g}]: ε ≈ {gauss['epsilon']:.4g}, ε ≥ {gauss['epsilon_lower']:.4g}"
        )
    null = result.get("gaussian_score_null")
    if null is not None:
        lines.append(
            f"  null-slot Gaussian-score bound ({null['n_in']} canaries' scores against the version they do not hold, "
            f"{null['null_scores']} empty slots' scores; sd {null['sd_in']:.3f} and {null['sd_null']:.3f}), "
            f"ASSUMING {null['assumption']}:\n    μ = {null['mu']:.4g} [{null['confidence']:g} lower bound "
            f"{null['mu_lower']:.4g}]: ε ≈ {null['epsilon']:.4g}, ε ≥ {null['epsilon_lower']:.4g}"
        )
    if result.get("dp_model", "central") != "central":
        nodes = result.get("nodes") or {}
        where = (
            "each canary alone on its node, scored on that node's own noisy vector (what the server receives)"
            if result["dp_model"] == "local"
            else f"{nodes.get('nodes')} nodes (min_nodes {nodes.get('min_nodes')}, {nodes.get('bits')} bits), scored on "
            "the decoded modular sum (all that secure aggregation shows the server)"
        )
        lines.append(f"  trust model: {result['dp_model']} DP, the nodes' mechanism simulated exactly; {where}")
    if result.get("skellam_gaussian_mu") is not None:
        lines.append(
            f"  Skellam releases: a Gaussian of the same variance and sensitivity would be μ = "
            f"{result['skellam_gaussian_mu']:.4g} (ε = {gdp_epsilon(result['skellam_gaussian_mu'], result['delta']):.4g}); "
            "the proven ε is the Skellam RDP bound's"
        )
    if "placement" in result:
        lines.append(
            f"  placement: {result['placement']}; {result['trials']} canary trials in {result['seconds']:.1f} s"
            + (" through the Flower runtime" if result.get("runtime") == "flower" else "")
        )
    return "\n".join(lines)


AUDIT_FILE = "audit.json"
"""What ``fedpers audit RUN_DIR`` writes into the run directory (the HTML report shows it)."""


def audit_run_dir(
    run_dir: str | Path,
    canaries: int | None,
    runs: int = 1,
    confidence: float = 0.95,
    seed: int = 0,
    placement: str = "auto",
    releases: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """The audit of a finished run's configuration (:func:`fedpers.audit.audit_configuration`) beside
    the (ε, δ) its own ledger records; written to RUN_DIR/audit.json."""
    from fedpers.audit import audit_configuration
    from fedpers.commands.privacy_report import privacy_summary
    from fedpers.results.rundir import dumps, write_atomic

    path = Path(run_dir)
    result = audit_configuration(path, canaries, runs, confidence, seed, placement=placement, releases=releases)
    ledger = privacy_summary(path)
    result["run_dir"] = str(path)
    result["run_ledger"] = {k: ledger.get(k) for k in ("epsilon", "delta", "accountant", "releases", "complete")}
    write_atomic(path / AUDIT_FILE, dumps(result) + "\n")
    return result


def format_run_audit(result: Mapping[str, Any], score: str = "threshold") -> str:
    """The audit's report, with the run's own ledger first."""
    led = result["run_ledger"]
    head = (
        f"run {result['run_dir']}: its ledger records ε = {led['epsilon']:.4g} at δ = {led['delta']:.3g} "
        f"({led['accountant']}, {led['releases']} releases); the audit reruns its configuration on canaries"
    )
    return head + "\n" + format_audit(result, score) + f"\n  written to {result['run_dir']}/{AUDIT_FILE}"
