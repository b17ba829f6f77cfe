"""Bookkeeping that a wrong number would break without any bound being crossed.

- every calibration counts every release the run then makes: ε of the ledger a run writes equals
  the target the noise was calibrated to, for every algorithm and every option that adds a round;
- no run spends privacy and then refuses: every config check fires before the first release;
- resume: the ledger's matching of re-drawn against recorded releases, both branches;
- sampling: the rate the ledger records is the rate the server sampled at (realised cohorts).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedpers import config, linalg
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import Accountant, Ledger, Privatizer, ledger_epsilon
from fedpers.privacy.ledger import Release
from fedpers.runner import execute

torch.set_num_threads(1)

ALTMIN = dict(n_users=300, dim=6, rank=2, samples_per_user=8, rounds=2, epsilon=2.0, baselines="none")
FEDREP = dict(
    n_users=400,
    dim=6,
    rank=2,
    samples_per_user=4,
    refit_samples=2,
    test_samples=4,
    rounds=3,
    epsilon=2.0,
    baselines="none",
)
DPALS = dict(n_users=60, n_items=20, rank=2, true_rank=2, max_count=10, steps=2, epsilon=2.0)
NOISYGD = dict(examples=200, feature_dim=8, classes=3, steps=3, test_examples=40, epsilon=2.0)
NOISYHEAD = dict(
    prompts=120, dim=3, context=8, steps=4, epsilon=2.0, test_prompts=20, calibration="accountant"
)  # paper: more noise by design

PLANS = {
    "altmin disjoint": ("altmin", {**ALTMIN, "cohorts": "disjoint"}),
    "altmin all": ("altmin", {**ALTMIN, "cohorts": "all"}),
    "altmin poisson": ("altmin", {**ALTMIN, "cohorts": "poisson", "sampling_rate": 0.3}),
    "fedrep all": ("fedrep", {**FEDREP, "cohorts": "all"}),
    "fedrep poisson": ("fedrep", {**FEDREP, "cohorts": "poisson", "sampling_rate": 0.25}),
    "dpals": ("dpals", DPALS),
    "dpals private centre": ("dpals", {**DPALS, "private_center": True}),
    "dpals head items": ("dpals", {**DPALS, "head_items": 8}),
    "noisygd centre": ("noisygd", {**NOISYGD, "remedy": "center"}),
    "noisygd pca": ("noisygd", {**NOISYGD, "remedy": "pca"}),
    "noisyhead prompt": ("noisyhead", NOISYHEAD),
    "noisyhead user": ("noisyhead", {**NOISYHEAD, "unit": "user", "prompts_per_user": 3, "user_clip": 0.5}),
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_calibrated_plan_counts_every_release_the_run_makes(plan, tmp_path):
    """The noise is calibrated to ε on the plan's events; the ledger the run writes must give the
    same ε. A release the plan forgot (or one it counted and the run never made) moves it."""
    name, values = PLANS[plan]
    exp = EXPERIMENTS[name]
    cfg = config.build(exp.config_type, values)
    execute(exp, cfg, out=tmp_path / "run", progress=False)
    ledger = Ledger.from_json((tmp_path / "run" / "ledger.json").read_text())
    assert len(ledger) > 0
    spent = ledger_epsilon(
        ledger, cfg.delta, getattr(cfg, "accountant", Accountant.PLD)
    )  # the accountant it calibrated with
    assert spent == pytest.approx(cfg.epsilon, rel=2e-3), (plan, spent, [r.name for r in ledger])


# ----- refusals before the first release -----------------------------------------------------------
def _violations(f: dataclasses.Field) -> list:
    """Values just outside a field's declared range (from its metadata)."""
    meta = f.metadata or {}
    out = []
    for key, bad in (
        ("ge", lambda b: b - 1 if isinstance(b, int) else b - 1e-3),
        ("gt", lambda b: b),
        ("le", lambda b: b + 1),
        ("lt", lambda b: b),
    ):
        if meta.get(key) is not None:
            out.append(bad(meta[key]))
    return out


def _counting_appends(monkeypatch) -> list:
    appended: list = []
    original = Ledger.append

    def append(self, release):
        appended.append(release.name)
        return original(self, release)

    monkeypatch.setattr(Ledger, "append", append)
    return appended


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_every_config_check_refuses_before_the_first_release(name, monkeypatch, tmp_path):
    """Every field's declared range, violated one at a time: refused, and nothing was released."""
    exp = EXPERIMENTS[name]
    appended = _counting_appends(monkeypatch)
    checked = 0
    for f in dataclasses.fields(exp.config_type):
        for bad in _violations(f):
            with pytest.raises(ValueError):
                cfg = config.build(exp.config_type, {f.name: bad})
                execute(exp, cfg, out=tmp_path / f"{f.name}-{bad}", progress=False)
            checked += 1
    assert checked > 0 and appended == []


def test_data_refusals_happen_before_the_first_release(monkeypatch, tmp_path):
    appended = _counting_appends(monkeypatch)
    import pandas as pd

    ratings = tmp_path / "r.csv"
    ratings.write_text("user,item,rating\n1,5,4.0\n2,5,four\n")
    text_ratings = tmp_path / "r.parquet"
    pd.DataFrame({"user": [1, 2], "item": [5, 5], "rating": ["4.0", "3.0"]}).to_parquet(text_ratings)
    long = tmp_path / "d.parquet"
    pd.DataFrame({"user": [u for u in range(6) for _ in range(8)], "y": 1.0, "f0": 0.5, "f1": "x"}).to_parquet(long)
    cases = [
        ("dpals", {"ratings": str(ratings)}, "declared public item universe"),
        (
            "dpals",
            {"ratings": str(text_ratings), "item_ids": "1:9", "rating_min": 1, "rating_max": 5},
            "declared .*not numeric",
        ),
        ("dpals", {"item_ids": "1:9"}, "applies only to --ratings or --dataset"),
        (
            "dpals",
            {"clip_embedding": 0.0, "private_center": True},
            "must be finite",
        ),  # round 0 would release, round 1 refuse
        (
            "dpals",
            {"clip_rating": 0.0, "private_center": True},
            "must be finite",
        ),  # the sums' clip too: refused before round 0
        ("fedrep", {"cohorts": "poisson", "sampling_rate": 1.0}, "sampling_rate"),
        ("altmin", {"data": str(long), "rank": 1}, "'f1' is (string|large_string), not numeric: row 1 holds 'x'"),
        ("altmin", {"data": str(long), "rank": 1, "feature_columns": "f0,f7"}, "no column 'f7'"),
    ]
    for name, values, match in cases:
        exp = EXPERIMENTS[name]
        with pytest.raises(ValueError, match=match):
            execute(exp, config.build(exp.config_type, values), out=tmp_path / "x", progress=False)
    assert appended == []


# ----- resume: the ledger's matching --------------------------------------------------------------
def _releases(n: int, noise: float = 1.0) -> list[Release]:
    p = Privatizer(0)
    for i in range(n):
        p.gaussian_sum(torch.zeros(2), per_unit_bound=1.0, noise_multiplier=noise + i, name=f"r{i}", round=i)
    return list(p.ledger)


def test_resume_redrawn_release_equal_to_the_recorded_one_is_kept_once():
    recorded = _releases(2)
    ledger, written = Ledger(), []
    ledger.on_append = written.append
    ledger.expect([r.to_dict() for r in recorded], Release.to_dict)
    for r in recorded:
        ledger.append(r)
    assert list(ledger) == recorded and written == []  # accounted once, not written again


def test_resume_redrawn_release_that_differs_accounts_both():
    recorded = _releases(2)
    other = _releases(1, noise=5.0)[0]
    ledger, written = Ledger(), []
    ledger.on_append = written.append
    ledger.expect([r.to_dict() for r in recorded], Release.to_dict)
    ledger.append(other)
    assert list(ledger) == [*recorded, other] and written == [other]  # the recorded ones are never dropped


def test_resume_recorded_release_not_redrawn_is_accounted_by_settle():
    recorded = _releases(3)
    ledger = Ledger()
    ledger.expect([r.to_dict() for r in recorded], Release.to_dict)
    ledger.append(recorded[0])
    assert len(ledger) == 1
    ledger.settle()
    assert list(ledger) == recorded
    ledger.settle()
    assert len(ledger) == 3  # settling twice adds nothing


# ----- sampling: recorded rate = sampled rate ------------------------------------------------------
@pytest.mark.parametrize(
    "name, values",
    [
        ("fedrep", {**FEDREP, "n_users": 3000, "rounds": 6, "cohorts": "poisson", "sampling_rate": 0.1}),
        pytest.param(
            "altmin",
            {**ALTMIN, "n_users": 3000, "rounds": 4, "cohorts": "poisson", "sampling_rate": 0.15},
            marks=pytest.mark.slow,
        ),  # fedrep covers the same server-side sampling path in the default suite
    ],
)
def test_ledger_sampling_rate_is_the_rate_the_server_sampled_at(name, values, tmp_path):
    """Pooled realised cohort sizes against Binomial(rounds·n, q_ledger): |z| < 5."""
    exp = EXPERIMENTS[name]
    cfg = config.build(exp.config_type, values)
    result = execute(exp, cfg, out=tmp_path / "run", progress=False)
    ledger = Ledger.from_json((tmp_path / "run" / "ledger.json").read_text())
    rates = {r.event.sampling_probability for r in ledger if hasattr(r.event, "sampling_probability")}
    assert len(rates) == 1
    q = rates.pop()
    counts = [r["units"] for r in result["_rounds"][1:]]
    n = cfg.n_users
    total, trials = sum(counts), n * len(counts)
    z = (total - q * trials) / math.sqrt(trials * q * (1 - q))
    assert abs(z) < 5, (q, counts)


def test_fedrep_estimator_divides_by_the_public_expected_count():
    """The update is U − η·G/(q·n) whatever the realised cohort size (count is never used)."""
    from fedpers.protocols.base import Message

    exp = EXPERIMENTS["fedrep"]
    cfg = config.build(exp.config_type, {**FEDREP, "cohorts": "poisson", "sampling_rate": 0.25, "epsilon": math.inf})
    protocol = exp.protocol(cfg)
    U = torch.linalg.qr(torch.randn(cfg.dim, cfg.rank, dtype=torch.float64))[0]
    G = torch.randn(cfg.dim, cfg.rank, dtype=torch.float64)
    outs = []
    for count in (1, 77, 400):
        msg = Message({"G": G.clone()}, count)
        new, _ = protocol.server_update(1, {"U": U.clone()}, msg, Privatizer(0))
        outs.append(new["U"])
    expected = linalg.orthonormal_basis(U - cfg.learning_rate * G / (0.25 * cfg.n_users))
    for out in outs:
        torch.testing.assert_close(out, expected)
