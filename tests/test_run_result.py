"""One RunResult, every view: the CLI summary, the HTML report, compare, `fedpers privacy`, the
trackers and the JSON show each figure under the same name with the same value, and the noise
multiplier z is the same number in all of them (the ledger's z included). result.json reads back
into a RunResult and is written again byte for byte."""

from __future__ import annotations

import html
import io
import json
import math
import re
from pathlib import Path

import pytest

from fedpers import config as config_lib
from fedpers.commands import summary
from fedpers.commands.cli import print_summary
from fedpers.commands.compare import compare, format_table
from fedpers.commands.privacy_report import privacy_report
from fedpers.commands.report import run_report
from fedpers.commands.tracking import final_metrics
from fedpers.experiments import experiment
from fedpers.privacy.ledger import Release
from fedpers.results.run_result import Privacy, ResultWarning, RunResult
from fedpers.results.rundir import dumps
from fedpers.runner import execute

NOISE_LABEL = "noise multiplier z"
"""The one label of z wherever a reader sees it in words (σ / Δ, half of z, is never shown)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    exp = experiment("altmin")
    cfg = config_lib.build(exp.config_type, {"n_users": 400, "dim": 5, "rounds": 2})
    out = tmp_path_factory.mktemp("run_result") / "run"
    returned = execute(exp, cfg, out=out, progress=False)
    return out, returned


def _cell(v: float) -> str:
    """A figure as the tables write it (written here, not taken from the renderer under test)."""
    return "inf" if math.isinf(v) else f"{v:.4g}"


def _html_text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def _html_table(page: str, after: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the first table after the heading ``after``, cells as text."""
    body = page.split(after, 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>(.*?)</tr>", body)
    cells = [[html.unescape(c) for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", r)] for r in rows]
    return cells[0], cells[1:]


def _text_table(lines: list[str], first: str) -> dict[str, dict[str, str]]:
    """The CLI's metric table as {row name: {column header: cell}} (row names and headers may hold a
    space; headers are separated by at least two); it ends at the first line not starting with a row."""
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    header = lines[start - 1]
    width = len(header) - len(header.lstrip())
    columns = re.split(r"\s{2,}", header.strip())
    table = {}
    for line in lines[start:]:
        if not line.strip() or line.startswith("  ") or ":" in line[:width]:
            break
        table[line[:width].strip()] = dict(zip(columns, line[width:].split()))
    return table


def views(run_dir: Path) -> dict:
    """Every view of the run in run_dir, as a reader (or a program) gets it."""
    result = RunResult.from_dict(json.loads((run_dir / "result.json").read_text()))
    out = io.StringIO()
    print_summary(result, out)
    rows, metrics, _ = compare([run_dir])
    page = run_report(run_dir)
    return {
        "result": result,
        "cli": out.getvalue(),
        "html": page,
        "compare_row": rows[0],
        "compare_text": format_table(rows, metrics),
        "privacy": privacy_report(run_dir),
        "json": json.loads(summary.json_text(result)),
        "trackers": final_metrics(result.to_dict()),
        "ledger": [Release.from_dict(r) for r in json.loads((run_dir / "ledger.json").read_text())],
    }


def check_views(v: dict) -> None:
    """Each figure: one name, one value, in every view."""
    result: RunResult = v["result"]
    p = result.privacy
    assert p is not None and p.epsilon is not None and p.delta is not None and p.noise_multiplier is not None
    cli, text, row, js, tracked = v["cli"], _html_text(v["html"]), v["compare_row"], v["json"], v["trackers"]

    # ε, δ, the target and z: the same words and digits in the CLI and the report, the same
    # numbers in compare, the JSON and the trackers.
    pair = f"(ε, δ) = ({_cell(p.epsilon)}, {_cell(p.delta)})"
    assert pair in cli and pair in text
    for key, label in (("target_epsilon", "target ε"), ("noise_multiplier", NOISE_LABEL)):
        words = f"{label} = {_cell(getattr(p, key))}"
        assert words in cli and words in text, (key, words)
    for key in ("epsilon", "delta", "noise_multiplier"):
        value = getattr(p, key)
        assert row[key] == value and js[key] == value and js["privacy"][key] == value
        assert tracked[f"final/{key}"] == value
    compare_lines = v["compare_text"].splitlines()
    details_at = compare_lines.index("") + 1  # the details table follows the metrics and their notes
    header = re.split(r"\s{2,}", compare_lines[details_at].strip())
    cells = compare_lines[details_at + 1].split()
    assert cells[header.index(NOISE_LABEL)] == _cell(p.noise_multiplier)
    metric_header = re.split(r"\s{2,}", compare_lines[0].strip())

    # Every release's z: the report's ledger, `fedpers privacy` and the run's own z agree (a
    # ledger column of σ / Δ, half of z, or any other quotient fails here).
    assert v["ledger"] and all(r.noise_multiplier == p.noise_multiplier for r in v["ledger"])
    ledger_header, ledger_rows = _html_table(v["html"], "<h3>Ledger</h3>")
    assert NOISE_LABEL in ledger_header and "z" not in [h.strip() for h in ledger_header]
    column = ledger_header.index(NOISE_LABEL)
    assert [r[column] for r in ledger_rows] == [_cell(r.noise_multiplier) for r in v["ledger"]]
    privacy_lines = v["privacy"].splitlines()
    first = next(i for i, line in enumerate(privacy_lines) if NOISE_LABEL in line)
    assert privacy_lines[first].rstrip().endswith(NOISE_LABEL)
    for line, release in zip(privacy_lines[first + 1 :], v["ledger"]):
        assert line.split()[-1] == _cell(release.noise_multiplier), line
    assert "noise_std / sensitivity" not in v["html"]

    # The metrics of the private run and of every baseline, each column headed by its label in words.
    labels = summary.metric_table(result).labels
    cli_table = _text_table(cli.splitlines(), summary.PRIVATE_RUN)
    html_header, html_rows = _html_table(v["html"], "<h2>Metrics against every baseline</h2>")
    html_table = {r[0]: dict(zip(html_header[1:], r[1:])) for r in html_rows}
    rows_by_name = {summary.PRIVATE_RUN: dict(result.metrics), **(result.baselines or {})}
    assert result.metrics and result.baselines and set(cli_table) == set(html_table) == set(rows_by_name)
    for name, figures in rows_by_name.items():
        for key, value in figures.items():
            assert cli_table[name][labels[key]] == html_table[name][labels[key]] == _cell(value), (name, key)
            if name == summary.PRIVATE_RUN:
                assert row[key] == js[key] == tracked[f"final/{key}"] == value
                assert compare_lines[1].split()[metric_header.index(labels[key])] == _cell(value)
            else:
                assert js["baselines"][name][key] == tracked[f"baseline/{name}/{key}"] == value

    # The run's time.
    assert result.seconds is not None
    assert f"in {result.seconds:.1f} s" in cli and f"· {result.seconds:.1f} s" in text
    assert row["seconds"] == js["seconds"] == tracked["final/seconds"] == result.seconds


def test_every_figure_has_one_name_and_one_value_in_every_view(run: tuple[Path, dict]) -> None:
    check_views(views(run[0]))


def test_a_view_that_computes_its_own_noise_figure_is_caught(
    run: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report's old ledger column, σ / Δ (half of z), planted back: the check fails."""

    def sigma_over_sensitivity(releases):
        return [
            [
                r.round,
                r.name,
                r.mechanism,
                r.units,
                r.per_unit_bound,
                r.sensitivity,
                r.noise_std,
                r.noise_std / r.sensitivity,
            ]
            for r in releases
        ]

    monkeypatch.setattr(summary, "ledger_rows", sigma_over_sensitivity)
    with pytest.raises(AssertionError):
        check_views(views(run[0]))


def test_result_json_reads_back_and_is_written_byte_for_byte(run: tuple[Path, dict]) -> None:
    run_dir, returned = run
    text = (run_dir / "result.json").read_text()
    result = RunResult.from_dict(json.loads(text))
    assert dumps(result.to_dict()) + "\n" == text
    assert result.to_dict() == {k: v for k, v in returned.items() if not k.startswith("_")}  # what execute returned
    assert (
        result.privacy is not None
        and result.privacy.accountant == "pld"
        and result.headline == ("epsilon", "delta", "noise_multiplier")
    )
    assert set(result.baselines or {}) and result.plots and result.run_dir == str(run_dir)


def test_any_result_json_round_trips_with_its_odd_entries() -> None:
    """Non-finite numbers (written as strings), plain-text warnings, a privacy section with an
    algorithm's own entries (a sensitivity given as a formula), and keys no section knows: all read and written back unchanged."""
    recorded = {
        "algorithm": "toy",
        "status": "completed",
        "runtime": "flower",
        "epsilon": "inf",
        "delta": 1e-05,
        "loss": "nan",
        "accuracy": 0.5,
        "bound_holds": False,
        "Gamma": [[1.0, 2.0]],
        "data": {"users": 3, "features_used": ["a"]},
        "conditions": {"c": {"holds": False, "value": "inf", "bound": 1, "text": "c < 1"}},
        "dp_claimed": False,
        "refused_because": ["c < 1: inf vs 1"],
        "privacy": {
            "epsilon": "inf",
            "delta": 1e-05,
            "sensitivity": "2·bound",
            "noise_multiplier": 3,
            "epsilon_by_accountant": {"pld": 1.0, "rdp": "inf"},
            "extra": None,
        },
        "seconds": 1.5,
        "warnings": [
            "plain text",
            {"metric": "loss", "private": "nan", "baseline": "b", "baseline_value": 1.0, "text": "t"},
        ],
        "plots": [],
        "run_dir": "/x",
        "something_new": {"k": 1},
    }
    text = dumps(recorded)
    result = RunResult.from_dict(json.loads(text))
    assert dumps(result.to_dict()) == text
    assert math.isinf(result.privacy.epsilon) and result.privacy.noise_multiplier == 3
    assert result.privacy.details == {"sensitivity": "2·bound", "extra": None}
    assert math.isnan(result.metrics["loss"]) and result.metrics["bound_holds"] is False
    assert result.details == {"Gamma": [[1.0, 2.0]], "something_new": {"k": 1}} and result.headline == (
        "epsilon",
        "delta",
    )
    assert result.warnings and result.warnings[0] == "plain text" and isinstance(result.warnings[1], ResultWarning)
    assert RunResult.from_dict({"algorithm": "a"}).to_dict() == {
        "algorithm": "a",
        "status": "completed",
        "runtime": "local",
    }
    assert Privacy.from_dict({}).to_dict() == {}
