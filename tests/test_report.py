"""`fedpers report`: one self-contained HTML page of a run or a sweep, checked for its content."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
import subprocess

import pytest

from fedpers.commands.cli import main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "run"
    assert main(["run", "altmin", "--n-users", "400", "--dim", "5", "--rounds", "2", "--quiet", "--out", str(out)]) == 0
    return out


def _text(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def test_run_report_content(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text()
    result = json.loads((run_dir / "result.json").read_text())
    ledger = json.loads((run_dir / "ledger.json").read_text())
    text = _text(page)
    assert f"(ε, δ) = ({result['epsilon']:.4g}, {result['delta']:.4g})" in text
    assert "pld accountant" in text and f"over {len(ledger)} release(s)" in text
    assert all(r["name"] in text for r in ledger)  # every release of the ledger
    for name in result["baselines"]:  # every baseline beside the private run
        assert re.search(rf"<td class=\"l\">{re.escape(name)}</td>", page)
    assert f"{result['excess_risk']:.4g}" in text
    figures = re.findall(r'data-figure="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    assert sorted(f for f, _ in figures) == sorted(result["plots"]) and figures
    for name, data in figures:  # the inline image is the run's own PNG, byte for byte
        assert base64.b64decode(data) == (run_dir / name).read_bytes()
    assert "n_users" in text and "Provenance" in text and "python" in text.lower()
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched at view time


def test_report_shows_warning_and_data_block(run_dir, tmp_path):
    from fedpers.commands.report import run_report

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    result = json.loads((copy / "result.json").read_text())
    result["warnings"] = [{"text": "the private excess_risk is worse than local_only: raise --n-users"}]
    result["data"] = {"users": 400, "features_used": ["f1", "f2"], "users_dropped": 3}
    (copy / "result.json").write_text(json.dumps(result))
    text = _text(run_report(copy))
    assert "WARNING: the private excess_risk is worse than local_only: raise --n-users" in text
    assert "Data summary" in text and "users_dropped" in text and '["f1", "f2"]' in text


def test_sweep_report(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text(
        'name = "tiny"\nalgorithm = "altmin"\nx = "epsilon"\nseries = "dim"\nmetrics = ["excess_risk"]\n'
        '[base]\nn_users = 400\nbaselines = "none"\n[grid]\ndim = [5]\nepsilon = [1.0, 8.0]\n'
    )
    assert main(["sweep", str(spec), "--out", str(tmp_path / "sw"), "--quiet"]) == 0
    assert main(["report", str(tmp_path / "sw"), "--out", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    text = _text(page)
    assert "fedpers sweep tiny" in text and "excess_risk" in text
    assert page.count("data:image/png;base64,") == len(
        json.loads((tmp_path / "sw" / "sweep.json").read_text())["figures"]
    )
    assert len(re.findall(r"<tr>", page.split("<h2>Table</h2>")[1].split("</table>")[0])) == 3  # header + 2 points


def test_report_refuses_other_directories(tmp_path):
    assert main(["report", str(tmp_path)]) == 2


@pytest.mark.slow
def test_report_renders_in_a_headless_browser(run_dir, tmp_path):
    """The page as a real browser draws it: the ε is on screen and every figure decodes."""
    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        pytest.skip("no headless Chromium installed")
    from fedpers.commands.report import write_report

    page = write_report(run_dir, tmp_path / "r.html")
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert f"{result['epsilon']:.4g}" in _text(dom)
    assert len(re.findall(r"<img ", dom)) == len(result["plots"])
