"""Every release's bound and sensitivity recomputed from the configuration alone.

The formulas below are written out from docs/algorithms.md (and the tightenings the protocols prove),
not taken from the protocol objects, so a wiring mistake — a statistic noised with another
one's bound, a release attributed to the wrong group, a cohort permutation that is not the
public one — disagrees with them.
"""

from __future__ import annotations

import hashlib
import math

import pytest

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.base import derived_seed
from fedpers.privacy import Ledger
from fedpers.runner import execute
from tests.synthetic_support import cohort_permutation_from_config


def run_ledger(name: str, values: dict, tmp_path) -> tuple[object, Ledger, int]:
    exp = EXPERIMENTS[name]
    cfg = config.build(exp.config_type, values)
    execute(exp, cfg, out=tmp_path / name, progress=False)
    ledger = Ledger.from_json((tmp_path / name / "ledger.json").read_text())
    return cfg, ledger, derived_seed(cfg.seed, "public")


def check(ledger: Ledger, expected: dict[str, tuple[float, float, str]]) -> None:
    assert [r.name for r in ledger] == list(expected)
    zs = set()
    for r in ledger:
        bound, sensitivity, units = expected[r.name]
        assert r.per_unit_bound == pytest.approx(bound, rel=1e-12), r.name
        assert r.sensitivity == pytest.approx(sensitivity, rel=1e-12), r.name
        assert r.units == units, r.name
        if r.mechanism != "exponential":
            zs.add(round(2 * r.noise_std / r.sensitivity, 9))
            assert r.noise_multiplier == pytest.approx(2 * r.noise_std / r.sensitivity, rel=1e-9)
    assert len(zs) <= 2  # one z per kind of release (NoisyGD's remedy has its own)


@pytest.mark.parametrize("cohorts", ["disjoint", "all", "poisson"])
def test_altmin_ledger_from_config(cohorts, tmp_path):
    values = dict(
        n_users=300,
        dim=6,
        rank=2,
        samples_per_user=12,
        rounds=3,
        noise_std=0.2,
        clip_model=0.9,
        clip_label=1.5,
        cohorts=cohorts,
    )
    if cohorts == "poisson":
        values["sampling_rate"] = 0.3
    cfg, ledger, public_seed = run_ledger("altmin", values, tmp_path)
    d, k, q = cfg.dim, cfg.rank, cfg.samples_per_user // 4
    eta, zeta = cfg.clip_model * math.sqrt(d * k), cfg.clip_label * math.sqrt(k + cfg.noise_std**2)
    expected = {"init.W": (q * zeta**2, 2 * q * zeta**2, "all")}
    for t in range(1, cfg.rounds + 1):
        group = f"cohort:{t}" if cohorts == "disjoint" else "all"
        # A_j is PSD: Δ = √2·bound, except Poisson-sampled (a unit is a full bound from absent: 2·bound)
        expected[f"round{t}.A"] = (q * eta**2, (2 if cohorts == "poisson" else math.sqrt(2)) * q * eta**2, group)
        expected[f"round{t}.b"] = (q * eta * zeta, 2 * q * eta * zeta, group)
    check(ledger, expected)
    if cohorts == "disjoint":
        perm, block = cohort_permutation_from_config(cfg, derived_seed(public_seed, "cohorts"))
        digest = hashlib.sha256(perm.numpy().astype("<i8").tobytes()).hexdigest()
        assert {r.params["cohort_digest"] for r in ledger if r.name != "init.W"} == {digest}
        assert {r.params["cohort_block"] for r in ledger if r.name != "init.W"} == {block}
    assert all(r.params["eta"] == pytest.approx(eta) and r.params["zeta"] == pytest.approx(zeta) for r in ledger)


@pytest.mark.parametrize("unit", ["prompt", "user"])
def test_noisyhead_ledger_from_config(unit, tmp_path):
    values = dict(prompts=120, dim=3, context=8, steps=5, epsilon=1.0, unit=unit, test_prompts=20, regime="low-dim")
    if unit == "user":
        values.update(prompts_per_user=3, user_clip=0.5)
    cfg, ledger, _ = run_ledger("noisyhead", values, tmp_path)
    N, L, D, kappa, lam = cfg.prompts, cfg.context, cfg.dim, cfg.kappa, 5.0  # λ = 5: the low-dim regime
    nu = 1 + cfg.label_noise**2
    C = math.sqrt(2 * nu * math.log(N * L / kappa))
    G = C / math.sqrt(L) * (1 + math.sqrt(math.log(N / kappa)) / D)
    R = C**2 * math.sqrt(N / L) * (1 + math.sqrt(math.log(1 / kappa)) / D) / lam
    scale = cfg.user_clip * cfg.prompts_per_user if unit == "user" else 1.0
    bound = scale * G * (C + R * G)
    check(ledger, {f"step{t}": (bound, 2 * bound, "all") for t in range(cfg.steps)})


@pytest.mark.parametrize("remedy", ["none", "center", "pca"])
def test_noisygd_ledger_from_config(remedy, tmp_path):
    values = dict(
        examples=200, feature_dim=12, classes=3, steps=3, collapse="random", beta=0.1, remedy=remedy, test_examples=50
    )
    cfg, ledger, _ = run_ledger("noisygd", values, tmp_path)
    R = 1 + math.sqrt(cfg.feature_dim) * cfg.beta
    expected = {}
    if remedy == "center":
        expected["remedy.mean"] = (R, 2 * R, "all")
    if remedy == "pca":
        expected["remedy.pca"] = (R**2, math.sqrt(2) * R**2, "all")
    expected.update({f"step{t}.grad": (cfg.grad_clip, 2 * cfg.grad_clip, "all") for t in range(1, cfg.steps + 1)})
    check(ledger, expected)


def test_expmech_ledger_from_config(tmp_path):
    cfg, ledger, _ = run_ledger("expmech", dict(n_users=200, net_width=0.6, clip_label=1.5), tmp_path)
    zeta = cfg.clip_label * math.sqrt(cfg.rank + cfg.noise_std**2)
    (release,) = ledger
    assert release.name == "select.U" and release.sensitivity == pytest.approx(zeta**2) and release.units == "all"
    assert release.event.epsilon == cfg.epsilon


@pytest.mark.parametrize(
    "round0",
    [{"private_center": False}, {"private_center": True}, {"head_items": 8}],
    ids=["plain", "private-centre", "head-items"],
)
def test_dpals_ledger_from_config(round0, tmp_path):
    values = dict(
        n_users=60,
        n_items=20,
        rank=2,
        true_rank=2,
        max_count=10,
        steps=2,
        epsilon=2.0,
        items_per_user=6,
        clip_embedding=1.5,
        clip_rating=2.5,
        **round0,
    )
    cfg, ledger, _ = run_ledger("dpals", values, tmp_path)
    B, cv, cr = cfg.items_per_user, cfg.clip_embedding, cfg.clip_rating
    expected = {}
    if round0.get(
        "private_center", True
    ):  # rating vector (√B·c_r) plus its total entry; B indicators plus the count entry
        expected["dpals.item_sums"] = (math.sqrt(2) * math.sqrt(B) * cr, 2 * math.sqrt(2) * math.sqrt(B) * cr, "all")
        expected["dpals.item_counts"] = (math.sqrt(2 * B), 2 * math.sqrt(2 * B), "all")
    gram, rhs = math.sqrt(B) * cv**2, math.sqrt(B) * cr * cv
    names = [r.name for r in ledger]
    assert names == list(expected) + ["dpals.G", "dpals.b"] * cfg.steps
    for r in ledger:
        bound, sensitivity, units = expected.get(r.name) or (
            (gram, 2 * gram, "all") if r.name == "dpals.G" else (rhs, 2 * rhs, "all")
        )
        assert (r.per_unit_bound, r.sensitivity, r.units) == (
            pytest.approx(bound, rel=1e-12),
            pytest.approx(sensitivity, rel=1e-12),
            units,
        ), r.name
    assert len({round(r.noise_multiplier, 9) for r in ledger}) == 1


@pytest.mark.parametrize("cohorts", ["all", "poisson"])
def test_fedrep_ledger_from_config(cohorts, tmp_path):
    values = dict(
        n_users=400,
        dim=6,
        rank=2,
        samples_per_user=5,
        refit_samples=2,
        test_samples=4,
        rounds=3,
        epsilon=2.0,
        clip=4.0,
        clip_label=1.5,
        noise_std=0.1,
        baselines="none",
        cohorts=cohorts,
    )
    if cohorts == "poisson":
        values["sampling_rate"] = 0.3
    cfg, ledger, _ = run_ledger("fedrep", values, tmp_path)
    zeta = cfg.clip_label * math.sqrt(cfg.rank + cfg.noise_std**2)
    init = (cfg.samples_per_user // 2) * zeta**2
    expected = {"init.W": (init, 2 * init, "all")}
    expected.update({f"round{t}.G": (cfg.clip, 2 * cfg.clip, "all") for t in range(1, cfg.rounds + 1)})
    check(ledger, expected)
    sampled = [getattr(r.event, "sampling_probability", None) for r in ledger]
    assert sampled == [None] + ([0.3] * cfg.rounds if cohorts == "poisson" else [None] * cfg.rounds)
