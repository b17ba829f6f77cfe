"""No single unit can break the guarantee: worst-case neighbours through the real server path.

For every algorithm, one unit is replaced by adversarial data (huge, overflowing, zero,
aligned with U, alternating labels, in float32 and float64) and the whole run is driven
again with the reference run's noisy outputs replayed (so every round sees the broadcast
the server actually sent). Each release's pre-noise change must stay within the
sensitivity its ledger entry records, only the unit's own releases may move, and the run
must complete with the same releases (see ``tests/neighbours.py``).
"""

from __future__ import annotations

import pytest
import torch

from fedpers import config
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.base import derived_seed
from fedpers.privacy import ALL_UNITS
from fedpers.runtime.local import run_local
from tests.neighbours import TapPrivatizer, adversaries, check_neighbour, run
from tests.small_runs import FEDREP_SMALL
from tests.synthetic_support import cohort_permutation_from_config

torch.set_num_threads(1)


def setup(name: str, values: dict):
    exp = EXPERIMENTS[name]
    cfg = config.build(exp.config_type, values)
    protocol = exp.protocol(cfg)
    units = exp.units(cfg, torch.arange(exp.num_units(cfg)))
    return cfg, protocol, {k: v.clone() for k, v in units.items()}


def cohort_of_user(cfg, n: int, rounds: int, j: int) -> int:
    """User j's cohort recomputed from the config alone (not from the protocol object)."""
    perm, _ = cohort_permutation_from_config(cfg, derived_seed(cfg.seed, "cohorts"))
    position = int((perm == j).nonzero()[0, 0])
    return position * rounds // n + 1


def first_round_U(protocol, units) -> torch.Tensor:
    """The first column of the U the server broadcasts in round 1."""
    states = []
    run_local(
        protocol, units, TapPrivatizer(3), chunk_size=7, progress=False, on_round=lambda rec, st: states.append(st)
    )
    return states[0]["U"][:, 0]


# ----- AltMin ------------------------------------------------------------------------------
ALTMIN = dict(n_users=40, dim=6, rank=2, samples_per_user=8, rounds=2, epsilon=2.0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("cohorts", ["disjoint", "all"])
def test_altmin_worst_case_neighbours(dtype, cohorts):
    cfg, protocol, units = setup("altmin", {**ALTMIN, "dtype": dtype, "cohorts": cohorts})
    aligned = first_round_U(protocol, units)
    tol = 1e-5 if dtype == "float32" else 1e-9
    for j in (0, 23):
        groups = {ALL_UNITS}
        if cohorts == "disjoint":
            groups.add(f"cohort:{cohort_of_user(cfg, cfg.n_users, cfg.rounds, j)}")
        x, y = units["x"][j], units["y"][j]
        largest = 0.0
        for label, new in adversaries(x, y, getattr(torch, dtype), aligned).items():
            outcome = check_neighbour(protocol, units, j, new, groups, rel_tol=tol)
            assert outcome.releases == 1 + 2 * cfg.rounds, label
            largest = max([largest] + [c / r.sensitivity for r, c in outcome.changes])
        assert largest > 0.25  # the adversaries did push some release a good part of its sensitivity


def test_altmin_overflowing_unit_is_zeroed_and_counted():
    cfg, protocol, units = setup("altmin", {**ALTMIN, "dtype": "float32", "cohorts": "all"})
    units["x"][5] = units["x"][5].double() * 1e39  # not finite in float32
    records = run(protocol, units, TapPrivatizer(0))[1]
    assert [r.zeroed for r in records] == [1, 1, 1]
    assert all(r.units == cfg.n_users for r in records)


def test_one_bad_user_no_longer_aborts_the_run():
    """The issue's reproduction: y × 1e20 in float32 used to raise RoundFailed (A: non-finite)."""
    cfg, protocol, units = setup("altmin", dict(n_users=40, rounds=1, cohorts="all", dtype="float32"))
    units["y"][3] *= 1e20
    state, records = run(protocol, units, TapPrivatizer(0), chunk_size=4096)
    assert torch.isfinite(state["U"]).all() and len(records) == 2
    assert all(r.zeroed == 0 for r in records)  # clipped correctly, not dropped


# ----- NoisyHead ------------------------------------------------------------------------------
NOISYHEAD = dict(prompts=60, dim=3, context=6, steps=4, epsilon=2.0)


@pytest.mark.parametrize(
    "values",
    [
        {"mode": "statistics"},
        {"mode": "rounds"},
        {"mode": "statistics", "unit": "user", "prompts_per_user": 3, "user_clip": 0.5},
        {"mode": "rounds", "unit": "user", "prompts_per_user": 3},
    ],
    ids=["prompt-statistics", "prompt-rounds", "user-statistics", "user-rounds"],
)
def test_noisyhead_worst_case_neighbours(values):
    cfg, protocol, units = setup("noisyhead", {**NOISYHEAD, **values})
    for j in (0, 11):
        for label, new in adversaries(units["x"][j], units["y"][j], torch.float64).items():
            outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS})
            assert outcome.releases == protocol.steps, label


# ----- NoisyGD ------------------------------------------------------------------------------
NOISYGD = dict(examples=60, feature_dim=12, classes=3, steps=3, collapse="random", epsilon=2.0)


@pytest.mark.parametrize("remedy", ["none", "center", "pca"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("loss", ["ce", "squared"])
def test_noisygd_worst_case_neighbours(remedy, dtype, loss):
    cfg, protocol, units = setup("noisygd", {**NOISYGD, "remedy": remedy, "dtype": dtype, "loss": loss})
    tol = 1e-5 if dtype == "float32" else 1e-9
    for j in (0, 31):
        cases = adversaries(units["x"][j], None, getattr(torch, dtype))
        cases["other label"] = {"y": (units["y"][j] + 1) % cfg.classes}
        cases["huge x, other label"] = {**cases["huge x"], "y": (units["y"][j] + 1) % cfg.classes}
        for label, new in cases.items():
            outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS}, rel_tol=tol)
            assert outcome.releases == protocol.num_rounds, label


# ----- exponential mechanism -------------------------------------------------------------------
def test_expmech_worst_case_neighbours():
    cfg, protocol, units = setup("expmech", dict(n_users=30, net_width=0.6, epsilon=2.0))
    U = protocol.candidates()[0, :, 0]
    for j in (0, 17):
        cases = adversaries(units["x"][j], units["y"][j], torch.float64, U.to(units["x"].dtype))
        for label, new in cases.items():
            outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS})
            assert outcome.releases == 1, label


def test_expmech_score_sensitivity_is_reached():
    """ζ² (not the paper's 4ξL_fC) is the sensitivity: x = 0 with y = ±ζ against y = 0 reaches it."""
    cfg, protocol, units = setup("expmech", dict(n_users=20, net_width=0.6, epsilon=2.0, clip_label=50.0))
    zeta = protocol.label_clip
    units["x"][4] = 0.0
    units["y"][4] = 0.0
    new = {"x": torch.zeros_like(units["x"][4]), "y": torch.full_like(units["y"][4], 10 * zeta)}
    outcome = check_neighbour(protocol, units, 4, new, {ALL_UNITS})
    ((release, moved),) = outcome.changes
    assert moved == pytest.approx(zeta**2, rel=1e-9) and release.sensitivity == pytest.approx(zeta**2)
    assert moved > protocol.paper_sensitivity  # ζ > 8.9·L_fC: the paper's 4ξL_fC would be broken


# ----- DP attention ----------------------------------------------------------------------------
def test_dpattention_neighbours_within_the_theorem_and_never_failing():
    """β-neighbours (a column moved by β) keep ||A^{1/2}Ã⁻¹A^{1/2} − I||_F within the recorded 2αβ√n/η;
    arbitrary replacements (outside the neighbour relation) still complete with the same release: one
    column clipped to α moves λ_min(A) by at most α² = 3.3e-5, far inside the promise XXᵀ ⪰ ηI here."""
    cfg, protocol, units = setup("dpattention", dict(columns=3000, seed=1))
    reference = TapPrivatizer(0)
    run(protocol, units, reference, chunk_size=512)
    ((release, A),) = reference.values
    vals, vecs = torch.linalg.eigh(A.double())
    assert float(vals.min()) >= protocol.params.eta  # the precondition the bound needs
    root = (vecs * vals.sqrt()) @ vecs.T
    j = 7
    col = units["x"][j].double()
    directions = [col / col.norm(), -col / col.norm(), vecs[:, 0], vecs[:, -1]]
    for u in directions:
        replayed = TapPrivatizer(0, replay=reference.outputs)
        neighbour = {k: v.clone() for k, v in units.items()}
        neighbour["x"][j] = (col + cfg.beta * u).to(neighbour["x"].dtype)
        run(protocol, neighbour, replayed, chunk_size=512)
        ((_, A2),) = replayed.values
        gap = root @ torch.linalg.inv(A2.double()) @ root - torch.eye(A.shape[0], dtype=torch.float64)
        assert float(torch.linalg.matrix_norm(gap)) <= release.sensitivity
    for label, new in adversaries(units["x"][j], None, torch.float64).items():
        fresh = TapPrivatizer(0)
        neighbour = {k: v.clone() for k, v in units.items()}
        neighbour["x"][j] = new["x"].to(neighbour["x"].dtype)
        run(protocol, neighbour, fresh, chunk_size=512)
        assert len(fresh.ledger) == 1, label
        ((_, A3),) = fresh.values
        assert float(torch.linalg.matrix_norm(A3.double() - A.double())) <= 2 * protocol.params.alpha**2 * (1 + 1e-9), (
            label
        )


# ----- bounds that are reached (so they cannot be tightened further) -------------------------------
def reach_units(
    protocol, units, U: torch.Tensor, j: int, q2_direction: int, y_sign_q2: float = 1.0, y_sign_init: float = 1.0
):
    """User j's data that drives every clip: Q1 aligned with U's first column (v̂ = ±e₁), Q2 along a
    coordinate axis with huge norm, labels far above ζ."""
    m, d = units["x"].shape[1], units["x"].shape[2]
    q = m // 4
    x = torch.zeros(m, d, dtype=units["x"].dtype)
    x[:q] = U[:, 0]
    x[q : 2 * q, q2_direction] = 1e6
    x[2 * q :, 0] = 1.0
    y = torch.full((m,), 1e6, dtype=units["y"].dtype)
    y[q : 2 * q] *= y_sign_q2
    y[2 * q + 1 :: 2] *= y_sign_init
    return {"x": x, "y": y}


def test_altmin_sensitivities_are_reached_within_one_percent():
    """A: √2·|Q2|η² (PSD units, orthogonal rank-one A_j); b: 2|Q2|ηζ; init W: 2(m/4)ζ² — each met by a worst-case pair."""
    cfg, protocol, units = setup("altmin", {**ALTMIN, "cohorts": "all", "rounds": 1})
    U = first_round_U(protocol, units).unsqueeze(-1)
    j = 9
    reach = {}
    for label, (base, new) in {
        "A": (dict(q2_direction=0), dict(q2_direction=1)),
        "b": (dict(q2_direction=0), dict(q2_direction=0, y_sign_q2=-1.0)),
        "W": (dict(q2_direction=0), dict(q2_direction=0, y_sign_init=-1.0)),
    }.items():
        start = {k: v.clone() for k, v in units.items()}
        for k, v in reach_units(protocol, units, U, j, **base).items():
            start[k][j] = v
        outcome = check_neighbour(protocol, start, j, reach_units(protocol, units, U, j, **new), {ALL_UNITS})
        reach.update({r.name: c / r.sensitivity for r, c in outcome.changes if r.name.endswith(label)})
    assert protocol.a_sensitivity == pytest.approx(2**0.5 * protocol.a_bound)
    assert reach["round1.A"] >= 0.99 and reach["round1.b"] >= 0.99 and reach["init.W"] >= 0.99, reach


def test_pca_second_moment_sensitivity_is_reached():
    cfg, protocol, units = setup("noisygd", {**NOISYGD, "remedy": "pca", "dtype": "float64"})
    j = 4
    big = torch.zeros_like(units["x"][j])
    big[0] = 1e6
    other = torch.zeros_like(big)
    other[1] = 1e6
    start = {k: v.clone() for k, v in units.items()}
    start["x"][j] = big
    outcome = check_neighbour(protocol, start, j, {"x": other}, {ALL_UNITS})
    (release, moved), *_ = outcome.changes
    assert release.name == "remedy.pca" and release.sensitivity == pytest.approx(2**0.5 * protocol.feature_bound**2)
    assert moved >= 0.99 * release.sensitivity


# ----- the empirical audit, through the full server path -----------------------------------------
def test_audit_of_the_A_release_through_the_server_path():
    """μ lower bound for round 1's A (noise z·√2·bound/2) on neighbours at exactly its sensitivity:
    released by drive → server_update → Privatizer, 1000 runs per neighbour."""
    from fedpers.audit.bounds import gdp_lower_bound

    cfg, protocol, units = setup("altmin", {**ALTMIN, "n_users": 10, "cohorts": "all", "rounds": 1, "epsilon": 6.0})
    U = first_round_U(protocol, units).unsqueeze(-1)
    j = 2
    d, d_prime = ({k: v.clone() for k, v in units.items()} for _ in range(2))
    for data, direction in ((d, 0), (d_prime, 1)):
        for k, v in reach_units(protocol, units, U, j, q2_direction=direction).items():
            data[k][j] = v
    init = TapPrivatizer(3)
    run(protocol, d, init)
    centres = {}
    for name, data in (("d", d), ("d_prime", d_prime)):
        tap = TapPrivatizer(3, replay=[init.outputs[0]])
        run(protocol, data, tap)
        centres[name] = tap.values[1][1]
    seeds = iter(range(10**6))

    def release(data):
        def draw():
            tap = TapPrivatizer(next(seeds), replay=[init.outputs[0]])
            run(protocol, data, tap, chunk_size=64)
            return tap.outputs[1]

        return draw

    lower = gdp_lower_bound(release(d), release(d_prime), centres["d"], centres["d_prime"], trials=1000)
    claimed = 2.0 / protocol.noise_multiplier
    print(f"audit: μ lower bound {lower:.3f}, claimed {claimed:.3f}")
    assert 0.5 * claimed < lower <= claimed, (lower, claimed)


# ----- DPALS (private matrix completion) -----------------------------------------------------------
@pytest.mark.parametrize(
    "round0",
    [{"private_center": False}, {"private_center": True, "head_items": 12}],
    ids=["no-round0", "private-center"],
)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_dpals_worst_case_neighbours(dtype, round0):
    """One user's ratings replaced by huge, overflowing, alternating or absent ratings on other items;
    with round 0 (private centre, head items) its item sums and counts are releases too."""
    cfg, protocol, units = setup(
        "dpals",
        dict(
            n_users=30,
            n_items=20,
            rank=3,
            true_rank=3,
            items_per_user=5,
            max_count=12,
            steps=2,
            epsilon=1.0,
            dtype=dtype,
            **round0,
        ),
    )
    huge = 1e30 if dtype == "float32" else 1e160
    tol = 1e-5 if dtype == "float32" else 1e-9
    for j in (0, 17):
        ratings, items, mask = units["ratings"][j], units["items"][j], units["mask"][j]
        sign = torch.ones_like(ratings)
        sign[1::2] = -1
        cases = {
            "huge ratings": {"ratings": ratings * 0 + huge},
            "overflowing ratings": {
                "ratings": ratings.double() * 0 + 1e39 if dtype == "float32" else ratings * 0 + 1e300
            },
            "alternating ratings": {"ratings": huge * sign},
            "other items": {"items": (items + 7) % cfg.n_items, "ratings": huge * sign},
            "no ratings": {"mask": torch.zeros_like(mask)},
        }
        for label, new in cases.items():
            outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS}, rel_tol=tol)
            assert outcome.releases >= (4 if round0["private_center"] else 2), (
                label
            )  # (c) equal counts on both neighbours is checked inside


def test_dpals_one_sign_ratings_push_the_total_entries_to_their_bound():
    """Round 0's per-item sums carry a total entry: a user rating B items at +c_r replaced by one
    rating them at −c_r moves the sums by exactly their sensitivity 2·√2·√B·c_r (not only
    alternating signs, which cancel in the total). Counts: B items vs B other items reach
    Γ_c = half of 2Γ_c (replace-one moves indicators, the count entry stays)."""
    B = 5
    cfg, protocol, units = setup(
        "dpals",
        dict(
            n_users=30,
            n_items=20,
            rank=3,
            true_rank=3,
            items_per_user=B,
            max_count=12,
            steps=1,
            epsilon=1.0,
            private_center=True,
        ),
    )
    j = 4
    units["items"][j] = 0
    units["items"][j, :B] = torch.arange(B)
    units["mask"][j] = False
    units["mask"][j, :B] = True
    units["test"][j] = False
    units["ratings"][j] = 0.0
    units["ratings"][j, :B] = 1e6
    reach = {}
    for label, new in {
        "opposite sign, same items": {"ratings": -units["ratings"][j]},
        "same sign, other items": {"items": units["items"][j] + B * (units["mask"][j]).long()},
    }.items():
        outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS})
        for release, moved in outcome.changes:
            reach[(label, release.name)] = moved / release.sensitivity
    assert reach[("opposite sign, same items", "dpals.item_sums")] == pytest.approx(1.0, rel=1e-9)
    assert reach[("same sign, other items", "dpals.item_counts")] == pytest.approx(0.5, rel=1e-9)
    assert reach[("same sign, other items", "dpals.item_sums")] == pytest.approx(0.5, rel=1e-9)


@pytest.mark.parametrize("cohorts", ["all", "poisson"])
def test_fedrep_worst_case_neighbours(cohorts):
    """FedRep's init and gradient releases under every adversary, all users or Poisson-sampled
    (FedRep has no disjoint cohorts; AltMin's are covered above)."""
    values = {**FEDREP_SMALL, "rounds": 2, "cohorts": cohorts}
    if cohorts == "poisson":
        values["sampling_rate"] = 0.6
    cfg, protocol, units = setup("fedrep", values)
    largest = 0.0
    for j in (0, 23):
        for label, new in adversaries(units["x"][j], units["y"][j], torch.float64).items():
            outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS})
            assert outcome.releases == 1 + cfg.rounds, label
            largest = max([largest] + [c / r.sensitivity for r, c in outcome.changes if r.name != "init.W"])
    assert largest > 0.45  # a gradient of norm ≥ C against another: most of 2C


@pytest.mark.parametrize("dtype", ["float32"])  # float64: the same code path, the mutation check caught it in both
def test_dpals_round0_from_the_empty_user_moves_each_release_by_one_bound(dtype):
    """Round 0 from the empty user: a user is at most one bound (Γ_s, Γ_c) away, half the
    replace-one Δ = 2Γ the ledger records. The adversaries rate every slot of their row (L = 12
    items, past the cap B = 5) with ratings of one sign, so the per-user item cap and the total
    entries are both reached: one-sign ratings push the sums to exactly Γ_s (alternating ones
    cancel in the total entry)."""
    L, B = 12, 5
    cfg, protocol, units = setup(
        "dpals",
        dict(
            n_users=30,
            n_items=20,
            rank=3,
            true_rank=3,
            items_per_user=B,
            max_count=L,
            steps=1,
            epsilon=1.0,
            private_center=True,
            dtype=dtype,
        ),
    )
    tol = 1e-5 if dtype == "float32" else 1e-9
    j = 4
    units["mask"][j] = False  # the empty user
    units["test"][j] = False
    huge = 1e30 if dtype == "float32" else 1e160
    full = {"items": torch.arange(L), "mask": torch.ones(L, dtype=torch.bool), "test": torch.zeros(L, dtype=torch.bool)}
    cases = {
        "one sign, huge, every slot": {**full, "ratings": torch.full((L,), huge, dtype=torch.float64)},
        "one sign, at the clip, every slot": {**full, "ratings": torch.full((L,), -3.0)},
        "one sign, small, every slot": {**full, "ratings": torch.full((L,), 1e-3)},
    }
    reach = {}
    for label, new in cases.items():
        outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS}, rel_tol=tol)
        for release, moved in outcome.changes:
            if release.round == 0:
                assert moved <= release.sensitivity / 2 * (1 + tol), (label, release.name, moved / release.sensitivity)
                reach[(label, release.name)] = moved / (release.sensitivity / 2)
    assert reach[("one sign, huge, every slot", "dpals.item_sums")] == pytest.approx(1.0, rel=1e-5)
    assert reach[("one sign, huge, every slot", "dpals.item_counts")] == pytest.approx(1.0, rel=1e-5)
