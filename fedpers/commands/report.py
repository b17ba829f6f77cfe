"""`fedpers report RUN_DIR|SWEEP_DIR`: one self-contained HTML page a reader opens.

A run's page: the (ε, δ) proven and by which accountant, the privacy ledger release by
release, the metrics beside every baseline (with any warning that the private result loses
to a trivial one), the data summary when the run recorded one, the configuration, the
figures inline (base64 PNG, so the page travels alone) and the provenance. A sweep's page:
its specification, its table, its figures and provenance. Nothing is fetched at view time.
"""

from __future__ import annotations

import base64
import csv
import html
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedpers.commands.summary import fmt
from fedpers.results.run_result import warning_text

STYLE = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}td,th{border:1px solid #ddd;padding:.2em .5em;text-align:right}
th{background:#f4f4f4}td.l,th.l{text-align:left}.warn{background:#fff3cd;border:1px solid #e0b000;padding:.5em;margin:.5em 0}
.eps{font-size:1.3em;font-weight:bold}img{max-width:100%;border:1px solid #eee;margin:.5em 0}code,pre{font-size:.85em}
.note{font-size:.8em;color:#555;margin:.1em 0}
"""


def _e(v: Any) -> str:
    return html.escape(str(v))


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], left: int = 1) -> str:
    """An HTML table; the first ``left`` columns are text (left-aligned)."""
    head = "".join(f'<th class="{"l" if i < left else ""}">{_e(h)}</th>' for i, h in enumerate(header))
    body = "".join(
        "<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{_e(fmt(c))}</td>' for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    name = _e(path.name)
    return (
        f'<figure><img alt="{name}" data-figure="{name}" src="data:image/png;base64,{data}">'
        f"<figcaption>{name}</figcaption></figure>"
    )


def _page(title: str, sections: list[str]) -> str:
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{_e(title)}</h1>" + "".join(sections) + "</body></html>\n"
    )


def _numbers(d: Mapping[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("_")
    }


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _audit_section(path: Path) -> str:
    """``fedpers audit RUN_DIR``'s result, where one was written: proven beside empirical."""
    import json

    from fedpers.commands.audit import AUDIT_FILE

    if not (path / AUDIT_FILE).is_file():
        return ""
    a = json.loads((path / AUDIT_FILE).read_text())
    gauss = a.get("gaussian_score") or {}
    rows = [
        ["proven ε (the audit's canary population)", a.get("proven_epsilon")],
        ["empirical ε, any mechanism (Steinke et al. 2023)", a.get("epsilon_lower")],
        ["empirical ε, one-run GDP (Mahloujifar et al. 2024)", (a.get("one_run_gdp") or {}).get("epsilon_lower")],
        ["empirical ε, canaries as independent trials", (a.get("independent_gdp") or {}).get("epsilon_lower")],
        [
            "Gaussian-score ε lower bound (an assumption: " + str(gauss.get("assumption")) + ")",
            gauss.get("epsilon_lower"),
        ],
    ]
    return (
        "<h3>Audit</h3>"
        + f"<p>{_e(a.get('trials'))} canary trials ({_e(a.get('runs'))} runs × {_e(a.get('canaries_per_run'))}), "
        + f"confidence {_e(a.get('confidence'))}; canaries: {_e(a.get('canary_design'))}</p>"
        + table(["bound", "ε"], rows)
    )


def run_report(run_dir: str | Path) -> str:
    """The HTML page of one run directory (complete or not); its figures are rendered by
    :mod:`fedpers.commands.summary`, as the CLI and compare show them."""
    from fedpers.commands import summary
    from fedpers.commands.privacy_report import privacy_summary
    from fedpers.commands.tracking import flatten
    from fedpers.privacy.ledger import Release
    from fedpers.results.run_result import RunResult
    from fedpers.results.rundir import read_run

    path = Path(run_dir)
    run = read_run(path)
    result = RunResult.from_dict(run["result"]) if run["complete"] else None
    cfg = run["config"]
    ledger = privacy_summary(path)
    status = result.status if result is not None else f"INCOMPLETE ({len(run['rounds'])} rounds recorded)"
    runtime = result.runtime if result is not None else cfg.get("runtime", {}).get("runtime", "?")
    seconds = result.seconds if result is not None else None
    sections = [
        f"<p>algorithm <b>{_e(cfg.get('algorithm'))}</b> · status <b>{_e(status)}</b> · runtime {_e(runtime)}"
        + (f" · {seconds:.1f} s" if seconds is not None else "")
        + "</p>"
    ]
    privacy = summary.shown_privacy(result, ledger)
    lines = [
        f'<p class="eps" id="epsilon">{_e(summary.epsilon_delta(privacy))}</p>',
        f"<p>by the {_e(privacy.accountant)} accountant over {ledger['releases']} release(s), neighbouring: "
        f"{_e(privacy.neighbouring)}" + "".join(f"; {_e(p)}" for p in summary.noise_phrases(privacy)) + ".</p>",
        *(f"<p>{_e(line[0].upper() + line[1:])}.</p>" for line in summary.privacy_lines(privacy)),
    ]
    releases = [Release.from_dict(r) for r in ledger["ledger"]]
    header = [summary.label(c) for c in summary.LEDGER_COLUMNS]
    lines.append("<h3>Ledger</h3>" + table(header, summary.ledger_rows(releases), left=4))
    lines.append(_audit_section(path))
    sections.append("<h2>Privacy</h2>" + "".join(lines))

    block = ""
    if result is not None:
        t = summary.metric_table(result)
        block = table(
            ["", *(t.labels[c] for c in t.columns)], ([name, *(row.get(c) for c in t.columns)] for name, row in t.rows)
        )
        block += "".join(f'<p class="note">{_e(note)}</p>' for note in t.notes)
        for w in result.warnings or ():
            block = f'<div class="warn">WARNING: {_e(warning_text(w))}</div>' + block
        if result.baselines_skipped:
            block += f"<p>baselines skipped: {_e(', '.join(result.baselines_skipped))}</p>"
        if t.details:
            block += "<h3>Details</h3>" + table(
                ["", "value"], ([label, summary.detail_value(v)] for label, v in t.details)
            )
    elif run["rounds"]:
        block += "<p>Last recorded round:</p>" + table(["metric", "value"], _numbers(run["rounds"][-1]).items())
    sections.append("<h2>Metrics against every baseline</h2>" + block)

    if result is not None and result.data is not None:
        sections.append("<h2>Data summary</h2>" + table(["field", "value"], result.data.items()))
    if result is not None and result.conditions:
        sections.append(
            "<h2>Preconditions of the guarantee</h2>"
            + table(
                ["condition", "holds"],
                ([c.get("text"), c.get("holds")] for c in result.conditions.values()),
            )
        )
    figures = [path / p for p in (result.plots or ()) if (path / p).is_file()] if result is not None else []
    if figures:
        sections.append("<h2>Figures</h2>" + "".join(image(f) for f in figures))
    sections.append("<h2>Configuration</h2>" + table(["field", "value"], sorted(flatten(cfg).items())))
    constants = run.get("constants")
    if isinstance(constants, Mapping) and constants:
        sections.append("<h3>Derived constants</h3>" + table(["constant", "value"], constants.items()))
    sections.append(_provenance(path))
    return _page(f"fedpers run {path.name}", sections)


def _provenance(path: Path) -> str:
    record = _read_json(path / "provenance.json")
    if not isinstance(record, Mapping):
        return "<h2>Provenance</h2><p>no provenance.json</p>"
    from fedpers.commands.tracking import flatten

    return "<h2>Provenance</h2>" + table(["field", "value"], sorted(flatten(record).items()))


def sweep_report(sweep_dir: str | Path) -> str:
    """The HTML page of a finished sweep directory."""
    from fedpers.commands.tracking import flatten

    out = Path(sweep_dir)
    summary = _read_json(out / "sweep.json")
    if not isinstance(summary, Mapping):
        raise ValueError(f"report: {out} holds no finished sweep (no sweep.json)")
    spec = summary.get("spec", {})
    sections = [
        (
            f"<p>algorithm <b>{_e(spec.get('algorithm'))}</b> · x = {_e(spec.get('x'))} · series = {_e(spec.get('series'))} · "
            f"{_e(summary.get('rows'))} rows ({_e(summary.get('points_run'))} points run, {_e(summary.get('points_reused'))} reused) · "
            f"{_e(spec.get('repetitions', 1))} repetition(s) per point</p>"
        )
    ]
    sections.append("<h2>Specification</h2>" + table(["field", "value"], sorted(flatten(spec).items())))
    if (out / "table.csv").is_file():
        with open(out / "table.csv", newline="") as f:
            rows = list(csv.reader(f))
        if rows:
            sections.append(
                "<h2>Table</h2>" + table(rows[0], ([_number_or_text(c) for c in r] for r in rows[1:]), left=0)
            )
    slopes = summary.get("slopes") or {}
    if slopes:
        sections.append(
            "<h2>Log-log slopes</h2>"
            + table(
                ["metric", "series", "slope"], ((m, s, v) for m, per in slopes.items() for s, v in per.items()), left=2
            )
        )
    figures = [out / f for f in summary.get("figures", []) if (out / f).is_file()]
    if figures:
        sections.append("<h2>Figures</h2>" + "".join(image(f) for f in figures))
    sections.append(_provenance(out))
    return _page(f"fedpers sweep {spec.get('name', out.name)}", sections)


def _number_or_text(c: str) -> Any:
    try:
        return float(c) if any(ch in c for ch in ".eE") or c.lower() in ("inf", "nan") else int(c)
    except ValueError:
        return c


def write_report(directory: str | Path, out: str | Path | None = None) -> Path:
    """Write the page of a run or a sweep directory (default: DIR/report.html); returns its path."""
    from fedpers.results.rundir import write_atomic

    path = Path(directory)
    if (path / "sweep.json").is_file():
        text = sweep_report(path)
    elif (path / "config.json").is_file():
        text = run_report(path)
    else:
        raise ValueError(f"report: {path} is neither a run directory (config.json) nor a finished sweep (sweep.json)")
    target = Path(out) if out is not None else path / "report.html"
    write_atomic(target, text)
    return target
