"""Ragged long-format AltMin data (.parquet/.csv): the same run as the fixed-shape npz when every
user has the same count, the per-user cap bounding a huge user's contribution, nodes reading only
their rows, and bad files refused before any work."""

import math

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from fedpers import config
from fedpers.app import make_client_app
from fedpers.data.long_format import LongFormatFile, quarter_sizes
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.altmin import make_protocol
from fedpers.experiments.base import derived_seed
from fedpers.runner import Runtime, RuntimeOptions, execute
from tests.flower_support import InProcessGrid

EXP = EXPERIMENTS["altmin"]
D, K = 6, 2


def write(path, users, x, y, **extra):
    table = pa.table({"user": users, "y": y, **{f"f{i}": x[:, i] for i in range(x.shape[1])}, **extra})
    if str(path).endswith(".csv"):
        pacsv.write_csv(table, path)
    else:
        pq.write_table(table, path, row_group_size=500)
    return path


def ragged(rng, n, low, high, d=D):
    u = np.linalg.qr(rng.normal(size=(d, K)))[0]
    users, xs, ys = [], [], []
    for j in range(n):
        c = int(rng.integers(low, high + 1))
        x = rng.normal(size=(c, d))
        users += [1000 + 7 * j] * c
        xs.append(x)
        ys.append(x @ u @ rng.normal(size=K) + 0.1 * rng.normal(size=c))
    return np.array(users), np.concatenate(xs), np.concatenate(ys)


def test_ragged_equals_fixed_shape_when_every_user_has_the_same_count(tmp_path):
    """Training rows placed where the public split keeps them give the npz's x, y exactly, so
    the run (U, ledger, test MSE) is the fixed-shape run's."""
    rng = np.random.default_rng(3)
    n, m, t = 400, 8, 2
    x, y = rng.normal(size=(n, m, D)), rng.normal(size=(n, m))
    xt, yt = rng.normal(size=(n, t, D)), rng.normal(size=(n, t))
    np.savez(tmp_path / "fixed.npz", x=x, y=y, x_test=xt, y_test=yt)
    seed, f = 5, t / (m + t)
    probe = LongFormatFile(
        write(tmp_path / "probe.parquet", np.zeros(m + t), np.zeros((m + t, D)), np.zeros(m + t)),
        "user",
        "y",
        (),
        cap=m,
        min_samples=4,
        test_fraction=f,
        seed=derived_seed(derived_seed(seed, "public"), "split"),
    )
    users, rows_x, rows_y = [], [], []
    for j in range(n):
        train, test = probe.split(j, m + t)
        assert len(train) == m and len(test) == t
        bx, by = np.zeros((m + t, D)), np.zeros(m + t)
        bx[train], by[train], bx[test], by[test] = x[j], y[j], xt[j], yt[j]
        users += [j] * (m + t)
        rows_x.append(bx)
        rows_y.append(by)
    long_path = write(tmp_path / "long.parquet", np.array(users), np.concatenate(rows_x), np.concatenate(rows_y))
    common = {"rank": K, "epsilon": 3.0, "rounds": 2, "seed": seed, "baselines": "none", "chunk_size": 128}
    fixed = execute(
        EXP,
        config.build(EXP.config_type, {**common, "data": str(tmp_path / "fixed.npz")}),
        out=tmp_path / "a",
        progress=False,
    )
    long = execute(
        EXP,
        config.build(
            EXP.config_type, {**common, "data": str(long_path), "max_samples_per_user": m, "test_fraction": f}
        ),
        out=tmp_path / "b",
        progress=False,
    )
    assert torch.equal(fixed["_state"]["U"], long["_state"]["U"])
    assert long["test_mse"] == pytest.approx(fixed["test_mse"], rel=1e-12)
    assert (tmp_path / "a" / "ledger.json").read_text() == (tmp_path / "b" / "ledger.json").read_text()
    assert long["data"]["users"] == n and long["data"]["users_below_minimum"] == 0


def test_quarters_cover_any_count():
    for c in range(4, 41):
        sizes = quarter_sizes(c)
        assert sum(sizes) == c and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cap_bounds_a_user_with_ten_thousand_samples(tmp_path, dtype):
    """Worst-case neighbours: user 0 with 10⁴ extreme samples against user 0 with 4 small ones;
    every summed statistic moves by at most its declared sensitivity, and the ledger records the cap."""
    rng = np.random.default_rng(1)
    users, x, y = ragged(rng, 30, 8, 40)
    big = 10_000
    heavy_x = np.zeros((big, D))
    heavy_x[:, 0] = 1e6
    heavy_y = np.full(big, 1e8)
    neighbours = []
    for name, (ux, uy) in {
        "heavy": (heavy_x, heavy_y),
        "light": (rng.normal(size=(4, D)) * 1e-3, rng.normal(size=4)),
    }.items():
        keep = users != users[0]
        path = write(
            tmp_path / f"{name}.parquet",
            np.concatenate([np.full(len(uy), users[0]), users[keep]]),
            np.concatenate([ux, x[keep]]),
            np.concatenate([uy, y[keep]]),
        )
        neighbours.append(str(path))
    cfg = config.build(
        EXP.config_type, {"data": neighbours[0], "rank": K, "epsilon": 2.0, "dtype": dtype, "max_samples_per_user": 16}
    )
    proto = make_protocol(cfg)
    U = torch.linalg.qr(torch.randn(D, K, dtype=torch.float64))[0].to(getattr(torch, dtype))
    sums = []
    for path in neighbours:
        f = LongFormatFile(path, "user", "y", (), cap=16, min_samples=4, test_fraction=0.2, seed=0)
        units = {
            k: (v.to(getattr(torch, dtype)) if v.is_floating_point() else v)
            for k, v in f.rows(torch.arange(f.n)).items()
        }
        init = proto.client_update(0, {}, units).stats["W"]
        A, b = proto.round_statistics(U, units["x"], units["y"])
        sums.append((init.double(), A.double(), b.double()))
    (w1, a1, b1), (w2, a2, b2) = sums
    slack = 1 + 1e-5
    assert float(torch.linalg.matrix_norm(w1 - w2)) <= 2 * proto.init_bound * slack
    assert float(torch.linalg.matrix_norm(a1 - a2)) <= proto.a_sensitivity * slack
    assert float(torch.linalg.vector_norm(b1 - b2)) <= 2 * proto.b_bound * slack
    assert float(torch.linalg.vector_norm(b1 - b2)) > 0.5 * proto.b_bound  # the heavy user does reach its bound
    assert proto.release_params("A")["samples_per_user_cap"] == 16


def test_users_below_minimum_contribute_nothing_and_are_counted(tmp_path):
    rng = np.random.default_rng(2)
    users, x, y = ragged(rng, 50, 2, 30)
    path = write(tmp_path / "d.csv", users, x, y)
    f = LongFormatFile(path, "user", "y", (), cap=16, min_samples=6, test_fraction=0.25, seed=0)
    rows = f.rows(torch.arange(f.n))
    kept = (rows["x"].abs().sum(-1) > 0).sum(1)
    counts = np.bincount(np.searchsorted(f.users, users))
    expected = np.minimum(counts - np.floor(0.25 * counts), 16)
    assert torch.equal(kept, torch.from_numpy(np.where(expected >= 6, expected, 0)).to(kept.dtype))
    assert f.summary()["users_below_minimum"] == int((expected < 6).sum()) > 0
    assert int(rows["test_count"][torch.from_numpy(expected < 6)].sum()) == 0


def test_advice_with_a_file_names_only_flags_that_change_it_and_says_what_the_cap_costs(tmp_path):
    """With a data file n and m are the file's: a lost baseline's advice never names --n-users or
    --samples-per-user, and a declared cap far above the rows the users hold is said to size the noise
    for rows nobody has (and by how much); a cap that fits gets no such warning."""
    rng = np.random.default_rng(5)
    users, x, y = ragged(rng, 120, 9, 10)  # at most 10 rows: 8 training rows after a 0.2 test split
    path = write(tmp_path / "d.csv", users, x, y)
    values = {"data": str(path), "epsilon": 0.2, "rank": K, "baselines": "local_only,private_init_only"}
    padded = execute(EXP, config.build(EXP.config_type, values), write=False, progress=False)
    texts = [w["text"] for w in padded["warnings"]]
    assert texts and not any("--n-users" in t or "--samples-per-user" in t for t in texts)
    cap = [t for t in texts if t.startswith("--max-samples-per-user 64")]
    assert len(cap) == 1 and "hold at most 8" in cap[0] and "8× what a cap of 8" in cap[0] and "declared" in cap[0]
    fits = execute(
        EXP, config.build(EXP.config_type, {**values, "max_samples_per_user": 8}), write=False, progress=False
    )
    assert not [w for w in fits["warnings"] if w.get("metric") == "max_samples_per_user"]


def test_a_node_reads_only_its_users_rows(tmp_path):
    rng = np.random.default_rng(4)
    users, x, y = ragged(rng, 200, 5, 20)
    path = write(tmp_path / "d.parquet", users, x, y)
    whole = LongFormatFile(path, "user", "y", (), cap=16, min_samples=4, test_fraction=0.2, seed=9)
    whole.load_all()
    node = LongFormatFile(path, "user", "y", (), cap=16, min_samples=4, test_fraction=0.2, seed=9)
    ids = torch.arange(50, 70)
    mine = node.rows(ids)
    assert node._table["present"].tolist() == list(range(50, 70))
    assert len(node._table["y"]) == int(np.isin(users, whole.users[50:70]).sum()) < len(users) / 5
    theirs = whole.rows(ids)
    for key in ("x", "y", "test_count"):
        assert torch.equal(mine[key], theirs[key])


def test_flower_grid_matches_local_on_ragged_parquet(tmp_path):
    rng = np.random.default_rng(5)
    users, x, y = ragged(rng, 240, 4, 60)
    path = write(tmp_path / "d.parquet", users, x, y)
    cfg = config.build(
        EXP.config_type,
        {
            "data": str(path),
            "rank": K,
            "epsilon": 4.0,
            "rounds": 2,
            "seed": 2,
            "baselines": "none",
            "max_samples_per_user": 24,
        },
    )
    local = execute(EXP, cfg, out=tmp_path / "local", progress=False)
    flower = execute(
        EXP,
        cfg,
        RuntimeOptions(runtime=Runtime.FLOWER, nodes=3),
        out=tmp_path / "flower",
        progress=False,
        grid=InProcessGrid(make_client_app(), 3),
    )
    torch.testing.assert_close(
        flower["_state"]["U"], local["_state"]["U"], rtol=1e-6, atol=1e-9
    )  # sums split over nodes
    assert flower["test_mse"] == pytest.approx(local["test_mse"], rel=1e-6)
    assert (tmp_path / "flower" / "ledger.json").read_text() == (tmp_path / "local" / "ledger.json").read_text()


def refusal(tmp_path, values, **write_extra):
    rng = np.random.default_rng(6)
    users, x, y = ragged(rng, 20, 8, 12)
    path = write(tmp_path / "d.parquet", users, x, y, **{k: v * len(y) for k, v in write_extra.items()})
    with pytest.raises(ValueError) as e:
        cfg = config.build(EXP.config_type, {"data": str(path), "rank": K, **values})
        make_protocol(cfg)
    return str(e.value), len(y)


def test_bad_long_format_data_is_refused_naming_the_column(tmp_path):
    msg, _ = refusal(tmp_path, {"user_column": "student"})
    assert "user_column" in msg and "'student'" in msg and "f0" in msg
    msg, _ = refusal(tmp_path, {"feature_columns": "f0,f9"})
    assert "feature_columns" in msg and "'f9'" in msg
    msg, _ = refusal(tmp_path, {"feature_columns": "f0,note"}, note=["a"])
    assert "'note'" in msg and "not numeric" in msg
    msg, _ = refusal(tmp_path, {"max_samples_per_user": 10})
    assert "max_samples_per_user" in msg and "multiple of 4" in msg
    msg, _ = refusal(tmp_path, {"test_fraction": 0.0})
    assert "test_fraction" in msg


def test_a_users_non_finite_rows_are_dropped_and_counted_not_refused(tmp_path):
    """One user's NaN/inf row used to refuse the whole file (its neighbour ran)."""
    rng = np.random.default_rng(7)
    users, x, y = ragged(rng, 10, 8, 8)
    clean = LongFormatFile(
        write(tmp_path / "c.csv", users, x, y), "user", "y", (), cap=8, min_samples=4, test_fraction=0.2, seed=0
    )
    x[[3, 17, 40], 2] = [np.nan, np.inf, -np.inf]
    y[5] = math.nan
    for name in ("d.csv", "d.parquet"):
        f = LongFormatFile(
            write(tmp_path / name, users, x, y), "user", "y", (), cap=8, min_samples=4, test_fraction=0.2, seed=0
        )
        s = f.summary()
        assert s["rows_dropped"] == {
            "feature 'f2' missing, NaN or infinite": 3,
            "label 'y' missing, NaN or infinite": 1,
        }
        assert (s["rows"], s["rows_kept"], s["users"]) == (80, 76, 10)
        assert "not a differentially private release" in s["note"]
        rows = f.rows(torch.arange(f.n))
        assert torch.isfinite(rows["x"]).all() and torch.isfinite(rows["y"]).all()
        assert rows["x"].shape == clean.rows(torch.arange(clean.n))["x"].shape
        bad_users = np.searchsorted(f.users, users[[3, 5, 17, 40]])
        good = np.setdiff1d(np.arange(10), bad_users)
        assert torch.equal(rows["x"][good], clean.rows(torch.arange(clean.n))["x"][good])


def test_rows_without_a_user_id_are_dropped_and_counted(tmp_path):
    rng = np.random.default_rng(9)
    users, x, y = ragged(rng, 6, 8, 8)
    table = pa.table(
        {
            "user": pa.array([None if i == 4 else int(u) for i, u in enumerate(users)]),
            "y": y,
            **{f"f{i}": x[:, i] for i in range(D)},
        }
    )
    pq.write_table(table, tmp_path / "d.parquet")
    f = LongFormatFile(tmp_path / "d.parquet", "user", "y", (), cap=8, min_samples=4, test_fraction=0.2, seed=0)
    assert f.summary()["rows_dropped"] == {"missing user id": 1} and f.n == 6


@pytest.mark.parametrize("features, column", [((), "f3"), (("f0", "f3"), "f3"), ((), "y")])
def test_a_text_cell_in_a_csv_drops_its_row_the_neighbour_runs_alike(tmp_path, features, column):
    """A CSV declares no types: one user's 'oops' in a feature or the label used to turn the
    column into text and refuse the file, so the run failed on D and completed on its neighbour
    (the clean file). Now the row is dropped and counted; every other row is read as before."""
    rng = np.random.default_rng(3)
    users, x, y = ragged(rng, 6, 8, 8, d=5)
    clean = write(tmp_path / "clean.csv", users, x, y)
    lines = clean.read_text().splitlines()
    header = lines[0].split(",")
    col = header.index(f'"{column}"') if f'"{column}"' in header else header.index(column)
    cells = lines[7].split(",")
    cells[col] = "oops"
    lines[7] = ",".join(cells)
    path = tmp_path / "d.csv"
    path.write_text("\n".join(lines) + "\n")
    kind = "label" if column == "y" else "feature"
    a, b = (
        LongFormatFile(p, "user", "y", features, cap=8, min_samples=4, test_fraction=0.2, seed=0) for p in (clean, path)
    )
    assert b.summary()["rows_dropped"] == {f"{kind} '{column}' not a number": 1}
    assert (b.summary()["rows"], b.summary()["rows_kept"], b.n, b.dim) == (48, 47, 6, a.dim)
    ra, rb = a.rows(torch.arange(6)), b.rows(torch.arange(6))
    hit = int(np.searchsorted(b.users, users[6]))
    others = [j for j in range(6) if j != hit]
    assert torch.equal(ra["x"][others], rb["x"][others]) and torch.equal(ra["y"][others], rb["y"][others])


def test_a_csv_row_with_the_wrong_number_of_cells_or_a_bad_byte_is_dropped_and_counted(tmp_path):
    """A ragged line (a cell too many or too few) or a byte that is not UTF-8 used to refuse the whole file."""
    rng = np.random.default_rng(4)
    users, x, y = ragged(rng, 5, 8, 8)
    clean = write(tmp_path / "clean.csv", users, x, y)
    lines = clean.read_text().splitlines()
    lines[3] += ",7"
    lines[12] = ",".join(lines[12].split(",")[:-1])
    lines[20] = lines[20][:-1] + "\udcff"  # a byte that is not UTF-8, in a feature
    lines[30] = "\udcfe" + lines[30]  # and in a user id: another user (a unit), as any other id
    path = tmp_path / "d.csv"
    path.write_bytes(("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"))
    f = LongFormatFile(path, "user", "y", (), cap=8, min_samples=4, test_fraction=0.2, seed=0)
    s = f.summary()
    assert s["rows_dropped"] == {"wrong number of cells": 2, "feature 'f5' not a number": 1}
    assert (s["rows"], s["rows_kept"], f.n) == (40, 37, 6)
    assert torch.isfinite(f.rows(torch.arange(6))["x"]).all()


def test_csv_user_ids_are_numbered_like_parquet_ids_and_one_text_id_refuses_nothing(tmp_path):
    """Integer ids in a CSV are numbered in integer order, as the same Parquet column's; a text id
    anywhere in the file (it used to fail the read past pyarrow's type-inference block) gives
    text order, with every row kept."""
    rng = np.random.default_rng(5)
    users, x, y = ragged(rng, 12, 8, 8)
    users = np.where(users == users[0], 5, users)  # 5 < 1007 as integers, not as text
    kw = dict(cap=8, min_samples=4, test_fraction=0.2, seed=0)
    pq_file = LongFormatFile(write(tmp_path / "d.parquet", users, x, y), "user", "y", (), **kw)
    csv_file = LongFormatFile(write(tmp_path / "d.csv", users, x, y), "user", "y", (), **kw)
    assert list(csv_file.users) == list(pq_file.users)
    a, b = pq_file.rows(torch.arange(12)), csv_file.rows(torch.arange(12))
    assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
    text = write(tmp_path / "t.csv", np.array([str(u) for u in users[:-8]] + ["user-x"] * 8), x, y)
    t = LongFormatFile(text, "user", "y", (), **kw)
    assert t.n == 12 and t.summary()["rows_kept"] == 96 and list(t.users) == sorted(t.users)


def test_long_format_flags_refused_without_a_long_format_file():
    with pytest.raises(ValueError, match="user_column applies to .parquet/.csv"):
        config.build(EXP.config_type, {"user_column": "student"})


def test_fewer_users_than_nodes_is_refused(tmp_path):
    rng = np.random.default_rng(8)
    users, x, y = ragged(rng, 5, 8, 10)
    path = write(tmp_path / "d.parquet", users, x, y)
    cfg = config.build(EXP.config_type, {"data": str(path), "rank": K, "rounds": 1, "baselines": "none"})
    with pytest.raises(ValueError, match=r"nodes=8 exceeds the 5 units"):
        execute(
            EXP,
            cfg,
            RuntimeOptions(runtime=Runtime.FLOWER, nodes=8),
            write=False,
            progress=False,
            grid=InProcessGrid(make_client_app(), 8),
        )


def test_a_label_of_1e9_is_counted_and_warned_about_not_silent(tmp_path):
    """One label of 1e9 among labels of order 1: kept (the private run clips it at ζ) but counted
    in the data summary, and the result warns that the non-private baselines fit it as it is
    (it made local_only's test MSE about 1e14 without a word)."""
    rng = np.random.default_rng(11)
    users, x, y = ragged(rng, 60, 12, 12)
    clean = LongFormatFile(
        write(tmp_path / "c.csv", users, x, y), "user", "y", (), cap=16, min_samples=4, test_fraction=0.2, seed=0
    )
    assert clean.summary()["labels_beyond_robust_range"] == 0
    y[7] = 1e9
    path = write(tmp_path / "o.csv", users, x, y)
    s = LongFormatFile(path, "user", "y", (), cap=16, min_samples=4, test_fraction=0.2, seed=0).summary()
    assert s["labels_beyond_robust_range"] == 1
    lo, hi = s["label_robust_range"]
    assert lo < y[np.arange(len(y)) != 7].min() and y[np.arange(len(y)) != 7].max() < hi < 1e9
    cfg = config.build(EXP.config_type, {"data": str(path), "rank": K, "rounds": 2, "baselines": "local_only"})
    result = execute(EXP, cfg, write=False, progress=False)
    (w,) = [w for w in result["warnings"] if w["metric"] == "labels"]
    assert w["count"] == 1 and "1 label(s) lie beyond the robust range" in w["text"] and "baselines" in w["text"]
    assert result["data"]["labels_beyond_robust_range"] == 1
