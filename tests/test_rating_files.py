"""Rating loaders on small files written here in each format; a public item universe; per-user
problems dropped and counted (never refusing the file); malformed files refused before any work."""

import pytest
import torch

from fedpers import config
from fedpers.data import rating_files
from fedpers.experiments.dpals import DpAlsConfig, load_units, n_items, n_users

ROWS = [(10, 5, 4.0), (10, 7, 3.5), (3, 5, 1.0), (3, 9, 5.0), (3, 7, 2.0), (42, 9, 0.5)]


def load(path, **kw):
    rating_files.load_table.cache_clear()
    args = dict(
        fmt="auto",
        user_column="user",
        item_column="item",
        rating_column="rating",
        rating_min=0.0,
        rating_max=5.0,
        seed=1,
        test_fraction=0.0,
        cap=0,
        universe=(5, 7, 9),
    )
    args.update(kw)
    return rating_files.load_table(str(path), **args)


def whole(t):
    """Every user of a table, padded to the widest."""
    return t.units(torch.arange(t.n_users), torch.float64)


def as_set(t):
    users = [3, 10, 42]
    items = [5, 7, 9]
    out = set()
    for j in range(t.n_users):
        u = t.units(torch.tensor([j]), torch.float64)
        for i, r, m in zip(u["items"][0].tolist(), u["ratings"][0].tolist(), u["mask"][0].tolist()):
            if m:
                out.add((users[j], items[i], r))
    return out


def test_movielens_csv_and_dat(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},123\n" for u, i, r in ROWS)
    )
    e = tmp_path / "b"
    e.mkdir()
    (e / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::123\n" for u, i, r in ROWS))
    for path in (d / "ratings.csv", e / "ratings.dat"):
        t = load(path)
        assert (t.n_users, t.n_items) == (3, 3)
        assert as_set(t) == set(ROWS)
        assert whole(t)["mask"].sum(1).tolist() == [3, 2, 1]


def test_generic_csv_with_column_flags(tmp_path):
    p = tmp_path / "r.csv"
    p.write_text("who,what,score\n" + "".join(f"{u},{i},{r}\n" for u, i, r in ROWS))
    t = load(p, user_column="who", item_column="what", rating_column="score")
    assert as_set(t) == set(ROWS)
    with pytest.raises(ValueError, match="user_column: no column 'user'"):
        load(p)


def test_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    p = tmp_path / "r.parquet"
    pd.DataFrame(ROWS, columns=["user", "item", "rating"]).to_parquet(p)
    assert as_set(load(p)) == set(ROWS)


@pytest.mark.parametrize(
    "extra, reason",
    [
        ([(10, 5, 2.0)], "repeat of a (user, item) pair (first kept)"),
        ([(10, 9, float("nan"))], "rating missing, NaN or infinite"),
        ([(10, 9, 9.0)], "rating outside [rating_min, rating_max] = [0, 5]"),
        ([(10, 9, -1.0)], "rating outside [rating_min, rating_max] = [0, 5]"),
        ([(10, 11, 3.0)], "item outside the public item universe"),
    ],
)
def test_one_users_bad_row_is_dropped_and_counted(tmp_path, extra, reason):
    """The issue's break 2: a bad row in one user's ratings used to refuse the file (rc 2) while
    its neighbour ran. Now the row is dropped, counted, and the table keeps its shape."""
    p = tmp_path / "r.csv"
    p.write_text("user,item,rating\n" + "".join(f"{u},{i},{r}\n" for u, i, r in ROWS + extra))
    t = load(p)
    assert as_set(t) == set(ROWS)
    assert (t.n_users, t.n_items) == (3, 3)
    assert t.summary["rows_dropped"] == {reason: 1}
    assert t.summary["rows"] == len(ROWS) + 1 and t.summary["rows_kept"] == len(ROWS)
    assert "not a differentially private release" in t.summary["note"]


def test_a_user_whose_every_row_is_bad_stays_a_unit(tmp_path):
    p = tmp_path / "r.csv"
    rows = [r for r in ROWS if r[0] != 42] + [(42, 9, 77.0)]
    p.write_text("user,item,rating\n" + "".join(f"{u},{i},{r}\n" for u, i, r in rows))
    t = load(p)
    assert t.n_users == 3 and int(whole(t)["mask"][2].sum()) == 0 and t.summary["users_without_ratings"] == 1


@pytest.mark.parametrize(
    "text, match",
    [
        ("user,item,rating\n", "has no rows"),
        ("who,item,rating\n1,5,4.0\n", "user_column: no column 'user'"),
    ],
)
def test_malformed_file_refused(tmp_path, text, match):
    p = tmp_path / "r.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        load(p)


def test_a_text_rating_or_a_ragged_line_drops_its_row_and_the_neighbour_runs_alike(tmp_path):
    """A CSV declares no types: one user's 'four' (or a line with a cell too many) used to refuse
    the file, so the run failed on D and completed on its neighbour. Now that row is dropped and
    counted, and every other user's table is the clean file's."""
    clean = tmp_path / "clean.csv"
    clean.write_text("user,item,rating\n" + "".join(f"{u},{i},{r}\n" for u, i, r in ROWS))
    bad = tmp_path / "bad.csv"
    text = [f"{u},{i},{r}" for u, i, r in ROWS]
    text[1] = "10,7,four"
    text[3] = "3,9,5.0,extra"
    text[4] = "3,7,2\udcff"  # a byte that is not UTF-8
    bad.write_bytes(("user,item,rating\n" + "\n".join(text) + "\n").encode("utf-8", "surrogateescape"))
    a, b = load(clean), load(bad)
    assert b.summary["rows_dropped"] == {"rating not a number": 2, "wrong number of cells": 1}
    assert (b.summary["rows"], b.summary["rows_kept"], b.n_users, b.n_items) == (6, 3, 3, a.n_items)
    wa, wb = whole(a), whole(b)
    for key in ("items", "ratings", "mask"):  # user 42 (index 2), its one rating
        assert torch.equal(wa[key][2, :1], wb[key][2, :1]) and int(wb["mask"][2].sum()) == 1


def test_a_parquet_rating_column_declared_text_is_refused(tmp_path):
    """Parquet declares its column types: text ratings are the file's schema, refused whatever the cells hold."""
    import pandas as pd

    p = tmp_path / "r.parquet"
    pd.DataFrame({"user": [1, 2], "item": [5, 5], "rating": ["4.0", "3.0"]}).to_parquet(p)
    with pytest.raises(ValueError, match="rating_column: column 'rating' of r.parquet is declared .*, not numeric"):
        load(p)


def test_item_universe_is_declared_never_read_off_the_data(tmp_path):
    """The issue's break 1: replacing user 0's ratings with ones on a new item changed
    n_items (U (20, 4) -> (21, 4)). With a declared universe the shapes are the same on D and D′."""
    rows = [(u, 100 + (u * 7 + k) % 20, 1.0 + (u + k) % 5) for u in range(30) for k in range(6)]
    d = tmp_path / "D.csv"
    d.write_text("user,item,rating\n" + "".join(f"{u},{i},{r}\n" for u, i, r in rows))
    d2 = tmp_path / "D2.csv"
    d2.write_text(
        "user,item,rating\n" + "".join(f"{u},{i},{r}\n" for u, i, r in rows if u != 0) + "0,500,3.0\n0,101,4.0\n"
    )
    items = tmp_path / "items.txt"
    items.write_text("".join(f"{i}\n" for i in range(100, 120)))
    assert (
        rating_files.item_universe(items, "") == rating_files.item_universe(None, "100:119") == tuple(range(100, 120))
    )
    tables = [load(p, universe=tuple(range(100, 120))) for p in (d, d2)]
    assert [t.n_items for t in tables] == [20, 20]
    assert tables[1].summary["rows_dropped"] == {"item outside the public item universe": 1}
    assert [t.n_users for t in tables] == [30, 30]
    with pytest.raises(ValueError, match="--items FILE .* or --item-ids LO:HI"):
        load(d, universe=None)
    with pytest.raises(ValueError, match="item_ids must be LO:HI"):
        rating_files.item_universe(None, "a:b")


def test_dpals_release_shapes_identical_on_neighbours(tmp_path):
    """U, G and b of a whole DPALS run have the same shapes on D and on D′ (user 0 rates a new item)."""
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runtime.local import run_local
    from tests.neighbours import TapPrivatizer

    rows = [(u, 100 + (u * 7 + k) % 20, 1.0 + (u + k) % 5) for u in range(30) for k in range(6)]
    shapes = []
    for name, mine in (("D", rows), ("D2", [r for r in rows if r[0] != 0] + [(0, 500, 3.0), (0, 101, 4.0)])):
        p = tmp_path / f"{name}.csv"
        p.write_text("user,item,rating\n" + "".join(f"{u},{i},{r}\n" for u, i, r in mine))
        rating_files.load_table.cache_clear()
        exp = EXPERIMENTS["dpals"]
        cfg = config.build(
            DpAlsConfig,
            {"ratings": str(p), "item_ids": "100:119", "steps": 2, "epsilon": 1.0, "rating_min": 0, "rating_max": 5},
        )
        protocol = exp.protocol(cfg)
        tap = TapPrivatizer(0)
        state = run_local(
            protocol, exp.units(cfg, torch.arange(exp.num_units(cfg))), tap, chunk_size=7, progress=False
        )[0]
        shapes.append((tuple(state["U"].shape), [(r.name, tuple(v.shape)) for r, v in tap.values]))
    assert shapes[0] == shapes[1]
    assert shapes[0][0] == (20, 4)


def test_cap_and_split_are_seeded(tmp_path):
    p = tmp_path / "r.csv"
    rows = [(u, i, float((u + i) % 5)) for u in range(4) for i in range(30)]
    p.write_text("user,item,rating\n" + "".join(f"{u},{i},{r}\n" for u, i, r in rows))
    a = load(p, cap=10, test_fraction=0.3, universe=tuple(range(30)))
    b = load(p, cap=10, test_fraction=0.3, universe=tuple(range(30)))
    assert whole(a)["items"].shape == (4, 10)
    assert torch.equal(a.items, b.items) and torch.equal(a.test, b.test)
    assert int(a.test.sum()) > 0 and not bool((a.test & a.mask).any())


def test_dpals_config_reads_file(tmp_path):
    p = tmp_path / "ratings.csv"
    p.write_text("userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},1\n" for u, i, r in ROWS))
    rating_files.load_table.cache_clear()
    with pytest.raises(ValueError, match="items: a ratings file needs a declared public item universe"):
        config.build(DpAlsConfig, {"ratings": str(p), "center": 3.0, "rating_max": 5.0, "rating_min": 0.0})
    cfg = config.build(
        DpAlsConfig, {"ratings": str(p), "item_ids": "5:9", "center": 3.0, "rating_max": 5.0, "rating_min": 0.0}
    )
    assert (n_users(cfg), n_items(cfg)) == (3, 5)
    u = load_units(cfg, torch.arange(3))
    assert set(u) >= {"ids", "items", "ratings", "mask", "test"}
    assert float(u["ratings"][2][u["mask"][2] | u["test"][2]].sum()) == pytest.approx(0.5 - 3.0)


def test_a_chunk_is_padded_to_its_own_widest_user_and_keeps_every_rating():
    """The table is ragged: one very wide user does not pad every other user's chunk, memory is
    the ratings' (no users × widest array), and a user's ratings are the same whatever chunk it
    is read in."""
    import numpy as np
    import pandas as pd

    rows = [(0, i, 1.0 + i % 5) for i in range(500)] + [(u, u % 7, 2.0) for u in range(1, 200) for _ in range(1)]
    rows += [(u, (u + 1) % 7, 3.0) for u in range(1, 200, 2)]
    frame = pd.DataFrame(rows, columns=["user", "item", "rating"])
    t = rating_files.build_table(frame, np.arange(200), 500, seed=3, test_fraction=0.2, cap=0)
    assert t.items.numel() == len(rows)  # flat: no padding held
    narrow = t.units(torch.arange(1, 200), torch.float64)
    assert narrow["items"].shape == (199, 2)
    every = t.units(torch.arange(200), torch.float64)
    assert every["items"].shape == (200, 500)
    for key in ("items", "ratings", "mask", "test"):
        assert torch.equal(every[key][1:, :2], narrow[key]) and not every[key][1:, 2:].any()
    assert int(every["mask"].sum() + every["test"].sum()) == len(rows)
    assert t.units(torch.tensor([5, 0, 5]), torch.float64)["items"][0].tolist()[:2] == narrow["items"][4].tolist()


def test_a_ratings_file_needs_its_declared_scale_and_out_of_scale_and_repeats_are_counted(tmp_path, capsys):
    """No scale, no run; a 9 on a 1-5 scale and a repeated (user, item) are dropped and counted; the
    printed data summary and the result agree on every count (one source: the run's config)."""
    import json

    from fedpers.commands.cli import main

    rows = [(u, 100 + (u * 7 + k) % 15, 1.0 + (u + k) % 5) for u in range(60) for k in range(8)]
    p = tmp_path / "r.csv"
    p.write_text(
        "user,item,rating\n" + "".join(f"{u},{i},{r}\n" for u, i, r in rows) + "0,101,9.0\n1,102,3.0\n1,102,4.0\n"
    )
    with pytest.raises(ValueError, match="rating_min / rating_max: a ratings file needs its declared rating scale"):
        config.build(DpAlsConfig, {"ratings": str(p), "item_ids": "100:114"})
    out = tmp_path / "run"
    args = [
        "run",
        "dpals",
        "--ratings",
        str(p),
        "--item-ids",
        "100:114",
        "--rating-min",
        "1",
        "--rating-max",
        "5",
        "--epsilon",
        "inf",
        "--steps",
        "1",
        "--out",
        str(out),
        "--quiet",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().err
    result = json.loads((out / "result.json").read_text())
    dropped = result["data"]["rows_dropped"]
    assert dropped["rating outside [rating_min, rating_max] = [1, 5]"] == 1
    assert dropped["repeat of a (user, item) pair (first kept)"] >= 1
    for key in ("train_ratings", "test_ratings"):
        assert result["data"][key] == result[key]
        assert f"{result[key]:,}" in printed or str(result[key]) in printed, (key, printed)
    assert not [w for w in result.get("warnings", []) if w.get("metric") in ("train_ratings", "test_ratings")]
