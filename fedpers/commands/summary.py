"""Every view of a run's result, rendered from one :class:`~fedpers.results.run_result.RunResult`.

The CLI summary (:func:`summary_text`), the HTML report's rows (:func:`privacy_lines`,
:func:`metric_rows`, :func:`ledger_rows`), compare's row (:func:`compare_row`), the trackers'
flat values (:func:`tracker_values`) and the JSON (:func:`json_text`) all come from here, so a
figure has the same value everywhere. Each figure has one key (its name in result.json, used
by the JSON, compare's columns, the trackers and the metric tables) and one label (:data:`LABELS`,
used in prose and the ledger tables); numbers are written by :func:`fmt`. The noise figures are
defined in :mod:`fedpers.results.run_result`: z = 2σ / Δ, σ the noise std, Δ the sensitivity.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from fedpers.privacy.ledger import Release
from fedpers.results.run_result import HEADLINE, NOISE_KEYS, Privacy, RunResult, Scalar, scalar, warning_text
from fedpers.results.rundir import dumps

LABELS: dict[str, str] = {
    "epsilon": "ε",
    "delta": "δ",
    "target_epsilon": "target ε",
    "per_unit_bound": "per-unit bound",
    "sensitivity": "sensitivity Δ",
    "noise_std": "noise std σ",
    "noise_multiplier": "noise multiplier z",
}
"""The one label of each privacy figure wherever a reader sees it in words (a key not here is
its own label)."""

LEDGER_COLUMNS = ("round", "name", "mechanism", "units", *NOISE_KEYS)
"""A ledger table's columns: which release, then its noise figures."""

PRIVATE_RUN = "private run"
"""The metric tables' name for the run itself (beside its baselines)."""


def label(key: str) -> str:
    return LABELS.get(key, key)


def fmt(v: Any) -> str:
    """A figure as every view writes it: 4 significant digits, ``inf``/``nan``, ``-`` for none."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else f"{v:.4g}"
    if isinstance(v, (list, dict)):
        text = json.dumps(v, ensure_ascii=False)
        return text if len(text) < 120 else text[:117] + "…"
    return str(v)


def phrase(key: str, value: Any) -> str:
    """``label = value``: how prose names a figure."""
    return f"{label(key)} = {fmt(value)}"


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float))


def shown_privacy(result: RunResult | None, ledger_summary: Mapping[str, Any]) -> Privacy:
    """The privacy a view shows: the run's own (its accountant over its ledger) once it
    completed, else what the ledger's releases so far give (``privacy_summary``)."""
    if result is not None and result.privacy is not None and result.privacy.epsilon is not None:
        return result.privacy
    return Privacy(
        epsilon=ledger_summary.get("epsilon"),
        delta=ledger_summary.get("delta"),
        accountant=ledger_summary.get("accountant"),
        neighbouring=ledger_summary.get("neighbouring"),
        paper_epsilon_same_noise=ledger_summary.get("paper_epsilon_same_noise"),
    )


def epsilon_delta(p: Privacy) -> str:
    return f"(ε, δ) = ({fmt(p.epsilon)}, {fmt(p.delta)})"


TRUST_MODELS: dict[str, str] = {
    "central": "the server adds the noise to the nodes' exact sums",
    "distributed": "each node adds a share of Skellam noise; the server sees only the modular sum (SecAgg+)",
    "local": "each unit's own Gaussian, added on its node; the server sees each node's noisy sum",
}
"""What each trust model means, in the words every view uses."""


def trust_line(p: Privacy) -> str | None:
    """``trust model: …, bits, composition``: who added the noise and how the (ε, δ) was composed."""
    if p.dp_model is None and p.composition is None:
        return None
    model = p.dp_model or "central"
    text = f"trust model: {model} ({TRUST_MODELS.get(model, model)})"
    plan = p.details.get("trust_model") if isinstance(p.details.get("trust_model"), Mapping) else None
    if p.bits is not None:
        text += f"; {p.bits}-bit sums"
    if plan is not None and model == "distributed":
        text += f", {plan.get('nodes')} nodes, min {plan.get('min_nodes')}, collusion {plan.get('collusion', 0)}"
    if p.composition:
        text += f"; {p.composition}"
    return text


def noise_phrases(p: Privacy) -> list[str]:
    """The target and the run's noise, each as ``label = value`` (those the run recorded)."""
    return [phrase(k, getattr(p, k)) for k in ("target_epsilon", "noise_multiplier") if getattr(p, k) is not None]


def privacy_lines(p: Privacy) -> list[str]:
    """The trust model (who added the noise, bits, composition), what the paper's calibration would claim
    and what other accountants give, for the same noise."""
    trust = trust_line(p)
    lines = [trust] if trust else []
    if p.paper_epsilon_same_noise is not None:
        lines.append(f"the paper's calibration would claim ε = {fmt(p.paper_epsilon_same_noise)} for the same noise")
    others = {k: v for k, v in (p.epsilon_by_accountant or {}).items() if k != p.accountant}
    if others:
        lines.append("same noise, other accountants: " + ", ".join(f"ε = {fmt(v)} by {k}" for k, v in others.items()))
    return lines


def metric_rows(result: RunResult) -> tuple[list[str], list[tuple[str, dict[str, Scalar]]]]:
    """(columns, rows): the private run's metrics and each baseline's, one row each; the private
    run's metrics come first, then any only a baseline has."""
    rows: list[tuple[str, dict[str, Scalar]]] = [(PRIVATE_RUN, dict(result.metrics))]
    for name, row in (result.baselines or {}).items():
        rows.append((name, _figures(row)))
    columns = list(dict.fromkeys(k for _, r in rows for k in r))
    return columns, rows


def _figures(row: Mapping[str, Any]) -> dict[str, Scalar]:
    """A baseline's figures (its entries that are numbers or checks)."""
    return {k: v for k, v in ((k, scalar(x)) for k, x in row.items()) if v is not None}


def ledger_rows(releases: Iterable[Release]) -> list[list[Any]]:
    """One row per release in :data:`LEDGER_COLUMNS`; z is the release's own (its dp-accounting
    event's), none for a release without Gaussian noise."""
    rows = []
    for r in releases:
        z = r.noise_multiplier
        noise = None if math.isinf(z) else z
        rows.append([r.round, r.name, r.mechanism, r.units, r.per_unit_bound, r.sensitivity, r.noise_std, noise])
    return rows


def summary_text(result: RunResult) -> str:
    """The CLI's summary: privacy, the metrics beside every baseline, the preconditions, warnings."""
    seconds = f"{result.seconds:.1f}" if result.seconds is not None else "?"
    lines = [f"\n{result.algorithm} on the {result.runtime} runtime: {result.status} in {seconds} s"]
    p = result.privacy
    if p is not None and p.to_dict():
        line = f"privacy: {epsilon_delta(p)} by {p.accountant or '?'}"
        if p.target_epsilon is not None:
            line += f" for {phrase('target_epsilon', p.target_epsilon)}"
        if p.noise_multiplier is not None:
            line += f"; {phrase('noise_multiplier', p.noise_multiplier)}"
        lines.append(line)
        lines += ["         " + text for text in privacy_lines(p)]
    columns, rows = metric_rows(result)
    if columns:
        width = max(len(name) for name, _ in rows) + 2
        lines.append("\n" + "".ljust(width) + "".join(c.rjust(max(len(c), 10) + 2) for c in columns))
        for name, row in rows:
            lines.append(name.ljust(width) + "".join(fmt(row.get(c)).rjust(max(len(c), 10) + 2) for c in columns))
    lines += [f"skipped {k}: {why}" for k, why in (result.skipped_metrics or {}).items()]
    if result.conditions:
        lines.append("\npreconditions of the privacy guarantee:")
        lines += [
            f"  [{'holds' if c['holds'] else 'FAILS'}] {c['text']}"
            + (f"  ({fmt(c['value'])} vs {fmt(c['bound'])})" if "value" in c else "")
            for c in result.conditions.values()
        ]
    if "dp_claimed" in result.metrics:
        claimed = result.metrics["dp_claimed"]
        lines.append("DP claimed: " + ("yes" if claimed else "NO (" + "; ".join(result.refused_because or ()) + ")"))
    lines += warning_lines(result)
    if result.run_dir is not None:
        lines.append(f"\nrun directory: {result.run_dir}")
    return "\n".join(lines)


def warning_lines(result: RunResult) -> list[str]:
    """Each warning, loudly (a private result no better than a trivial baseline)."""
    return [f"\n!! WARNING: {warning_text(w)}" for w in result.warnings or ()]


def compare_row(result: RunResult, privacy: Privacy, status: str) -> dict[str, Any]:
    """The run as compare shows it: runtime, status, ε, δ, z (from ``privacy``: the run's own,
    or its ledger's so far, :func:`shown_privacy`), time, then its metrics."""
    return {
        "runtime": result.runtime,
        "status": status,
        **{k: getattr(privacy, k) for k in HEADLINE},
        "seconds": result.seconds,
        **result.metrics,
    }


def tracker_values(result: RunResult) -> dict[str, float]:
    """``final/KEY`` for the run's figures (ε, δ, z, its metrics, its time) and
    ``baseline/NAME/KEY`` for each baseline's; finite numbers only (a check counts 1 or 0)."""
    p = result.privacy
    figures: dict[str, Any] = {k: getattr(p, k) for k in result.headline} if p is not None else {}
    figures.update(result.metrics)
    figures["seconds"] = result.seconds
    out = {f"final/{k}": float(v) for k, v in figures.items() if _finite(v)}
    for name, row in (result.baselines or {}).items():
        out.update({f"baseline/{name}/{k}": float(v) for k, v in _figures(row).items() if _finite(v)})
    return out


def _finite(v: Any) -> bool:
    return _scalar(v) and math.isfinite(float(v))


def json_text(result: RunResult) -> str:
    """The result as one line of JSON (``--json``; result.json holds the same object, indented)."""
    return dumps(result.to_dict(), indent=None)


def text_table(
    header: Sequence[str], rows: Iterable[Sequence[Any]], left: Collection[int], sep: str = " "
) -> list[str]:
    """A plain-text table of :func:`fmt` cells; the columns at ``left`` left-aligned, the rest right-aligned."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    return [
        sep.join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [list(header), *cells]
    ]
