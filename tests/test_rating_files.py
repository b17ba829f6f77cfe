"""Rating loaders on small files written here in each format, and bad data refused before any work."""
import math

import pytest
import torch

from fedpers import config
from fedpers.data import rating_files
from fedpers.experiments.dpals import DpAlsConfig, load_units, n_items, n_users

ROWS = [(10, 5, 4.0), (10, 7, 3.5), (3, 5, 1.0), (3, 9, 5.0), (3, 7, 2.0), (42, 9, 0.5)]


def load(path, **kw):
    rating_files.load_table.cache_clear()
    args = dict(fmt="auto", user_column="user", item_column="item", rating_column="rating", rating_min=0.0, rating_max=5.0,
                seed=1, test_fraction=0.0, cap=0)
    args.update(kw)
    return rating_files.load_table(str(path), **args)


def as_set(t):
    users = [3, 10, 42]
    items = [5, 7, 9]
    out = set()
    for j in range(t.n_users):
        for i, r, m in zip(t.items[j].tolist(), t.ratings[j].tolist(), t.mask[j].tolist()):
            if m:
                out.add((users[j], items[i], r))
    return out


def test_movielens_csv_and_dat(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},123\n" for u, i, r in ROWS))
    e = tmp_path / "b"
    e.mkdir()
    (e / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::123\n" for u, i, r in ROWS))
    for path in (d / "ratings.csv", e / "ratings.dat"):
        t = load(path)
        assert (t.n_users, t.n_items) == (3, 3)
        assert as_set(t) == set(ROWS)
        assert t.mask.sum(1).tolist() == [3, 2, 1]


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


@pytest.mark.parametrize("rows, match", [
    (ROWS + [(10, 5, 2.0)], "1 of 7 rows repeat a \\(user, item\\) pair"),
    (ROWS + [(11, 5, float("nan"))], "rating column: 1 of 7 rows are NaN"),
    (ROWS + [(11, 5, 9.0), (12, 5, -1.0)], "rating column: 2 of 8 rows outside"),
])
def test_bad_data_refused(tmp_path, rows, match):
    p = tmp_path / "r.csv"
    p.write_text("user,item,rating\n" + "".join(f"{u},{i},{r}\n" for u, i, r in rows))
    with pytest.raises(ValueError, match=match):
        load(p)


def test_cap_and_split_are_seeded(tmp_path):
    p = tmp_path / "r.csv"
    rows = [(u, i, float((u + i) % 5)) for u in range(4) for i in range(30)]
    p.write_text("user,item,rating\n" + "".join(f"{u},{i},{r}\n" for u, i, r in rows))
    a = load(p, cap=10, test_fraction=0.3)
    b = load(p, cap=10, test_fraction=0.3)
    assert a.items.shape == (4, 10)
    assert torch.equal(a.items, b.items) and torch.equal(a.test, b.test)
    assert int(a.test.sum()) > 0 and not bool((a.test & a.mask).any())


def test_dpals_config_reads_file(tmp_path):
    p = tmp_path / "ratings.csv"
    p.write_text("userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},1\n" for u, i, r in ROWS))
    rating_files.load_table.cache_clear()
    cfg = config.build(DpAlsConfig, {"ratings": str(p), "center": 3.0, "rating_max": 5.0, "rating_min": 0.0})
    assert (n_users(cfg), n_items(cfg)) == (3, 3)
    u = load_units(cfg, torch.arange(3))
    assert set(u) >= {"ids", "items", "ratings", "mask", "test"}
    assert float(u["ratings"][2][u["mask"][2] | u["test"][2]].sum()) == pytest.approx(0.5 - 3.0)
