"""Figures say what they show (ε spent, the algorithm's own round axis, baselines, grid ticks,
linear accuracies) and `fedpers compare` puts runs side by side."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from fedpers.commands.cli import main
from fedpers.results.plots import compare_figure, privacy_title, run_figure
from fedpers.sweeps.run import load_spec, plot_metric, sweep_figure

ALTMIN = [
    "run",
    "altmin",
    "--n-users",
    "600",
    "--dim",
    "6",
    "--rank",
    "2",
    "--quiet",
    "--baselines",
    "nonprivate_altmin,oracle",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("runs")
    out = {"altmin": base / "altmin", "noisygd": base / "noisygd"}
    assert main([*ALTMIN, "--out", str(out["altmin"])]) == 0
    assert main(["run", "noisygd", "--quiet", "--out", str(out["noisygd"])]) == 0
    return out


def test_title_carries_the_epsilon_spent_not_the_target() -> None:
    title = privacy_title("noisyhead", {"epsilon": 0.0891, "target_epsilon": 1.0, "delta": 1e-5, "accountant": "pld"})
    assert title == "noisyhead: ε = 0.0891 spent (target 1), δ = 1e-05, pld"
    assert privacy_title("altmin", {"epsilon": 4.0, "target_epsilon": 4.0}) == "altmin: ε = 4 spent"


def test_run_figure_axes_baselines_and_scales() -> None:
    rounds = [{"round": r, "subspace_error": e} for r, e in enumerate([0.5, 0.3, 0.2])]
    fig = run_figure(
        rounds,
        "subspace_error",
        title="t",
        round_axis="round (0 = private initialisation)",
        baselines={"clipped_no_noise": {"subspace_error": 0.1}, "oracle": {"subspace_error": 1e-16}},
    )
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.lines]
    assert labels == ["private run", "clipped no noise (0.1)", "oracle (1e-16, off scale)"]
    assert ax.get_yscale() == "log" and ax.get_ylim()[0] > 1e-3  # the oracle's 1e-16 does not squash the view
    acc = run_figure(
        [{"round": 0, "accuracy": 0.8}, {"round": 1, "accuracy": 0.9}], "accuracy", title="t", round_axis="step"
    )
    assert acc.axes[0].get_yscale() == "linear" and acc.axes[0].get_xlabel() == "step"


def test_per_run_plots_fit_the_algorithm(runs: dict[str, Path]) -> None:
    result = json.loads((runs["noisygd"] / "result.json").read_text())
    assert result["plots"] == ["accuracy.png"]
    from fedpers.experiments import experiment

    assert (
        "initialisation" not in experiment("noisygd").round_axis
        and "initialisation" not in experiment("noisyhead").round_axis
    )
    assert "initialisation" in experiment("altmin").round_axis


def test_sweep_ticks_sit_at_the_grid_values(tmp_path: Path) -> None:
    spec_file = tmp_path / "s.toml"
    spec_file.write_text(
        'algorithm = "altmin"\nx = "n_users"\nseries = "epsilon"\nmetrics = ["subspace_error"]\n[grid]\nn_users = [300, 1000, 3000]\nepsilon = [1.0]\n'
    )
    spec = load_spec(spec_file)
    rows = [{"epsilon": 1.0, "n_users": n, "subspace_error": 1 / n} for n in (300, 1000, 3000)]
    plot_metric(rows, spec, "subspace_error", tmp_path / "f.png")
    fig, slopes = sweep_figure(rows, spec, "subspace_error")
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == [300, 1000, 3000]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["300", "1000", "3000"]
    assert list(slopes.values()) == [pytest.approx(-1.0)]
    assert (tmp_path / "f.png").stat().st_size > 0


def test_compare_table_json_and_figure(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["compare", str(runs["altmin"]), str(runs["noisygd"]), "--json", "--out", str(tmp_path / "c.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["algorithm"]: r for r in out["rows"]}
    assert out["metrics"][:2] == ["excess_risk", "accuracy"]  # each algorithm's primary metric first
    assert rows["altmin"]["epsilon"] == pytest.approx(
        json.loads((runs["altmin"] / "result.json").read_text())["epsilon"]
    )
    assert "accuracy" not in rows["altmin"] and rows["noisygd"]["accuracy"] >= 0.0
    assert rows["altmin"]["status"] == "completed" and (tmp_path / "c.png").stat().st_size > 0
    assert [r["trust_model"] for r in out["rows"]] == ["central", "central"]
    fig = compare_figure(out["rows"], ["excess_risk", "accuracy"])
    assert [ax.get_title() for ax in fig.axes] == ["excess risk (lower is better)", "accuracy (higher is better)"]
    assert fig.axes[1].get_yscale() == "linear"
    assert main(["compare", str(runs["altmin"])]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["run", "ε", "spent"] and "excess risk" in table[0]
    details = table[table.index("") + 1]
    assert (
        details.split()[:5] == ["run", "algorithm", "trust", "model", "runtime"] and len(table) == table.index("") + 3
    )


def test_compare_refuses_what_is_not_a_run(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["compare", str(tmp_path)]) == 2
    assert "not a fedpers run directory" in capsys.readouterr().err
    assert main(["compare", str(runs["altmin"]), "--out", str(tmp_path / "c.pdf")]) == 2
    assert "--out must name a .png file" in capsys.readouterr().err


def test_compare_shows_a_killed_run_as_incomplete_with_its_releases(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import shutil

    killed = tmp_path / "killed"
    shutil.copytree(runs["altmin"], killed)
    for name in ("result.json", "ledger.json"):
        (killed / name).unlink()
    lines = (killed / "rounds.jsonl").read_text().splitlines()
    (killed / "rounds.jsonl").write_text("\n".join(lines[:1]) + "\n")
    assert main(["compare", str(killed), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["status"] == "incomplete (1 rounds)" and row["epsilon"] > 0 and "subspace_error" in row


def test_compare_across_algorithms_is_one_block_each_with_its_own_metrics(
    runs: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    assert main(["compare", str(runs["altmin"]), str(runs["noisygd"])]) == 0
    text = capsys.readouterr().out
    altmin, noisygd = re.split(r"\n\n(?=noisygd \(1 run\):)", text)
    assert altmin.startswith("altmin (1 run):") and noisygd.startswith("noisygd (1 run):")
    assert "excess risk" in altmin and "accuracy" not in altmin
    assert "accuracy" in noisygd and "excess risk" not in noisygd
    for block in (altmin, noisygd):  # no column is blank for every run of its block, in either table
        lines = block.splitlines()
        details = lines.index("") + 1
        for header, row in ((lines[1], lines[2]), (lines[details], lines[details + 1])):
            assert len(re.split(r"\s{2,}", header.strip())) == len(row.split()) and "-" not in row.split()


def test_a_flat_or_single_value_figure_has_plain_readable_ticks() -> None:
    """NoisyHead's statistics mode has one round: a bar against the baselines, not one point on
    an axis labelled "1e−13+4.148723236e−1"; a flat curve keeps plain tick labels too."""
    import matplotlib

    matplotlib.use("Agg")
    fig = run_figure(
        [{"round": 0, "excess_risk": 0.41487232356745884}],
        "excess_risk",
        title="t",
        baselines={"ridge": {"excess_risk": 0.0}, "zero_head": {"excess_risk": 8.9e-7}},
    )
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["private run", "ridge", "zero head"]
    assert [round(p.get_width(), 6) for p in ax.patches] == [0.414872, 0.0, 0.000001]
    fig.canvas.draw()
    assert ax.xaxis.get_major_formatter().get_offset() == ""
    flat = run_figure(
        [{"round": r, "excess_risk": 0.4148723236} for r in range(3)],
        "excess_risk",
        title="t",
        baselines={"ridge": {"excess_risk": 0.0}},
    )
    flat.canvas.draw()
    lo, hi = flat.axes[0].get_ylim()
    assert hi - lo > 1e-3 and flat.axes[0].yaxis.get_major_formatter().get_offset() == ""


def _texts_outside_canvas(fig) -> list[str]:
    """The texts drawn (fully or partly) outside the canvas: a figure's drawn extent is the union of
    its artists' bounding boxes (ticks outside the view are not drawn and do not count)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    out = []
    for ax in fig.axes:
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            texts += [t.label1 for t in axis.get_major_ticks() if t.label1.get_visible() and lo <= t.get_loc() <= hi]
        legend = ax.get_legend()
        texts += legend.get_texts() if legend is not None else []
        for t in texts:
            if not t.get_text() or not t.get_visible():
                continue
            e = t.get_window_extent(renderer)
            if e.width == 0:
                continue
            if e.x0 < canvas.x0 - 1 or e.y0 < canvas.y0 - 1 or e.x1 > canvas.x1 + 1 or e.y1 > canvas.y1 + 1:
                out.append(t.get_text())
    tight = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)
    if tight.x0 < -1 or tight.y0 < -1 or tight.x1 > canvas.x1 + 1 or tight.y1 > canvas.y1 + 1:
        out.append(f"drawn extent {tight.bounds} beyond the canvas {canvas.bounds}")
    return out


def _overlapping_tick_labels(fig: Any) -> list[tuple[str, str]]:
    """Pairs of neighbouring x tick labels of one panel whose drawn boxes overlap."""
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        shown = [t for t in ax.get_xticklabels() if t.get_text() and t.get_visible()]
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in shown]
        out += [(a, b) for (a, ea), (b, eb) in zip(boxes, boxes[1:]) if ea.overlaps(eb)]
    return out


def test_figures_keep_every_text_inside_the_canvas_and_draw_linear_bars():
    """Layout: a per-round curve, a flat curve, a one-value figure and compare's bars, with long
    names, each rendered and every text's bounding box checked against the canvas."""
    from fedpers.results.plots import _plt, value_figure

    plt = _plt()
    rounds = [{"round": i, "accuracy": 1.0} for i in range(1, 31)]
    flat = run_figure(
        rounds,
        "accuracy",
        title="noisygd: ε = 1 (target 1), δ = 1e-05, pld",
        round_axis="NoisyGD step",
        baselines={"chance": {"accuracy": 0.1}, "nonprivate_gd": {"accuracy": 1.0}},
    )
    lo, hi = flat.axes[0].get_ylim()
    assert hi - lo >= 0.05  # a flat line drawn in a readable window, not 0.998-1.002
    one = value_figure(
        "excess_risk",
        0.0054,
        {"zero_head": {"excess_risk": 0.96}, "ridge": {"excess_risk": 0.0}},
        title="noisyhead: ε = 0.9999 (target 1), δ = 1e-05, pld",
    )
    rows = [
        {"run": f"a-very-long-run-directory-name-{i}", "epsilon": float(i), "excess_risk": 10.0**-i, "accuracy": 0.5}
        for i in range(6)
    ]
    bars = compare_figure(rows, ["excess_risk", "accuracy"])
    # excess risk spans five decades: a log axis; accuracy is a score in [0, 1]: linear
    assert [ax.get_yscale() for ax in bars.axes] == ["log", "linear"] and "spent" in bars._suptitle.get_text()
    for fig in (flat, one, bars):
        assert _texts_outside_canvas(fig) == []
        plt.close(fig)


def test_sweep_figure_layout_labels_and_error_bars(tmp_path: Path) -> None:
    """A sweep figure a paper can use: axes named in words with the metric's unit (the swept ε is the
    target), a band only when B ≥ 2 and then said to be ± 2 standard errors, log y where the values span
    decades; ``[plot]`` and the command line's labels replace the defaults without changing the sweep."""
    from matplotlib.collections import PolyCollection

    text = 'algorithm = "altmin"\nx = "epsilon"\nseries = "n_users"\nmetrics = ["subspace_error", "seconds"]\n[grid]\nepsilon = [1.0, 4.0]\nn_users = [300]\n'
    (tmp_path / "s.toml").write_text(text)
    rows = [
        {"epsilon": e, "n_users": 300, "subspace_error": 1 / e**3 + 0.01 * r, "seconds": 1.0 + r}
        for e in (1.0, 4.0)
        for r in range(3)
    ]
    one = load_spec(tmp_path / "s.toml", 1)
    fig, _ = sweep_figure(rows[::3], one, "subspace_error")
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("target ε", "subspace error")
    assert "B = 1" in ax.get_title() and "no error bars" in ax.get_title()
    assert not [c for c in ax.collections if isinstance(c, PolyCollection)] and ax.get_yscale() == "log"
    assert tuple(fig.get_size_inches()) == (6.0, 4.2)
    three = load_spec(tmp_path / "s.toml", 3)
    fig, _ = sweep_figure(rows, three, "subspace_error")
    assert len([c for c in fig.axes[0].collections if isinstance(c, PolyCollection)]) == 1
    assert "B = 3" in fig.axes[0].get_title() and "± 2 standard errors" in fig.axes[0].get_title()
    assert sweep_figure(rows, three, "seconds")[0].axes[0].get_ylabel() == "time (s)"
    (tmp_path / "l.toml").write_text('name = "s"\n' + text + '[plot]\nxlabel = "privacy budget ε"\n')
    labelled = load_spec(tmp_path / "l.toml", 1, {"ylabel": "distance to U*", "title": None})
    ax = sweep_figure(rows[::3], labelled, "subspace_error")[0].axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("privacy budget ε", "distance to U*")
    assert labelled.identity() == one.identity()  # relabelling reuses the sweep's points
    with pytest.raises(ValueError, match="plot.xlabel must be a non-empty string"):
        (tmp_path / "b.toml").write_text(text + "[plot]\nxlabel = 3\n")
        load_spec(tmp_path / "b.toml")


def test_a_sweep_sets_figure_puts_its_members_in_a_grid_each_panel_labelled(tmp_path: Path) -> None:
    """Four members: two rows of panels (never one long row), each with the sweep figure's labels."""
    from fedpers.results.plots import PANELS_ACROSS
    from fedpers.sweeps.sets import members_figure

    members = []
    for i in range(4):
        (tmp_path / f"m{i}.toml").write_text(
            f'name = "m{i}"\nalgorithm = "altmin"\nx = "n_users"\nseries = "epsilon"\nmetrics = ["excess_risk"]\n[grid]\nn_users = [300, 1000]\nepsilon = [1.0]\n'
        )
        members.append(
            (
                load_spec(tmp_path / f"m{i}.toml"),
                [{"epsilon": 1.0, "n_users": n, "excess_risk": 1 / n} for n in (300, 1000)],
            )
        )
    fig = members_figure(members, "excess_risk")
    assert len(fig.axes) == 4 and len({round(ax.get_position().y0, 3) for ax in fig.axes}) == -(-4 // PANELS_ACROSS)
    width, height = fig.get_size_inches()
    assert width <= 6.0 * PANELS_ACROSS and height >= 4.2 * 2
    assert all((ax.get_xlabel(), ax.get_ylabel()) == ("users n", "excess risk") for ax in fig.axes)


@pytest.mark.parametrize(
    ("name", "panels"), [("noisyhead_early_stopping", 2), ("noisyhead_robustness", 2), ("noisyhead_robustness", 4)]
)
def test_noisyheads_own_sweep_layouts_label_bands_and_grid(name: str, panels: int, tmp_path: Path) -> None:
    """NoisyHead's ``[plot] layout`` figures (descent-privacy, robustness), as its sweep files configure them:
    axes named in words from the swept field (the ``[plot]`` labels over them), a band only when B ≥ 2 and then
    said to be ± 2 standard errors, panels in rows of at most three (four attack sizes: two rows), every
    text inside the canvas."""
    from matplotlib.collections import PolyCollection

    from fedpers.experiments.noisyhead.figures import layout_figure
    from fedpers.results.plots import PANELS_ACROSS, _plt

    root = Path(__file__).resolve().parents[1] / "simulations"
    text = (root / f"{name}.toml").read_text()
    if name == "noisyhead_robustness" and panels == 4:
        text = text.replace("attack_c = [2.0, 4.0]", "attack_c = [1.0, 2.0, 3.0, 4.0]")
    (tmp_path / "s.toml").write_text(text)
    metrics = ("excess_risk", "gd_excess_risk", "robust_ridge", "robust_noisyhead", "robust_ridge_naive_solve")

    def rows(spec: Any, seeds: int) -> list[dict[str, Any]]:
        return [
            {spec.x: x, spec.series: s, **{m: (1 + j + r) / (10 + i) for m in metrics}}
            for i, x in enumerate(spec.grid[spec.x])
            for j, s in enumerate(spec.grid[spec.series])
            for r in range(seeds)
        ]

    plt = _plt()
    one = load_spec(tmp_path / "s.toml", 1)
    fig = layout_figure(rows(one, 1), one)
    x_words = {"steps": "steps T", "attack_p": "attack p"}[one.x]
    assert len(fig.axes) == panels and all(ax.get_xlabel() == x_words for ax in fig.axes)
    assert all(ax.get_ylabel() in ("excess risk", "shift (<Γ − Γ_bad, Z>)²") for ax in fig.axes)
    assert len({round(ax.get_position().y0, 3) for ax in fig.axes}) == -(-panels // PANELS_ACROSS)
    assert not [c for ax in fig.axes for c in ax.collections if isinstance(c, PolyCollection)]
    assert "B = 1" in fig._suptitle.get_text() and "no error bars" in fig._suptitle.get_text()
    assert _texts_outside_canvas(fig) == [] and _overlapping_tick_labels(fig) == []
    plt.close(fig)
    three = load_spec(tmp_path / "s.toml", 3, {"xlabel": "x in words", "ylabel": "y in words", "title": "the title"})
    fig = layout_figure(rows(three, 3), three)
    assert all(any(isinstance(c, PolyCollection) for c in ax.collections) for ax in fig.axes)
    assert all((ax.get_xlabel(), ax.get_ylabel()) == ("x in words", "y in words") for ax in fig.axes)
    assert fig._suptitle.get_text() == "the title"
    plt.close(fig)
    unlabelled = load_spec(tmp_path / "s.toml", 3)
    fig = layout_figure(rows(unlabelled, 3), unlabelled)
    assert "B = 3" in fig._suptitle.get_text() and "± 2 standard errors" in fig._suptitle.get_text()
    assert _texts_outside_canvas(fig) == []
    plt.close(fig)
