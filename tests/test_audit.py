"""fedpers audit: lower bounds that hold on honest code and catch planted privacy bugs.

The planted bugs are the three a reviewer fears most: noise scaled by the per-unit bound instead
of the sensitivity (σ halved), a label clip removed, and the disjoint-cohort filter removed (a
user in every round while the ledger charges one). Each must push a lower bound above the proven
value; the honest code must stay below it at every seed tried.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import fedpers.audit as audit_lib
from fedpers import config as config_lib
from fedpers import linalg
from fedpers.audit import bounds as audit_math
from fedpers.audit.scores import released_part
from fedpers.commands.audit import format_audit, headline
from fedpers.experiments import experiment
from fedpers.experiments.fedrep import fedrep_init_fraction
from fedpers.privacy import Privatizer
from fedpers.privacy.ledger import ALL_UNITS
from fedpers.protocols.altmin import AltMinProtocol, Cohorts
from fedpers.protocols.base import Message, client_message

ALTMIN = experiment("altmin")


def altmin_cfg(**values):
    return config_lib.build(ALTMIN.config_type, values)


# ----- the math ------------------------------------------------------------------------------
def test_one_run_bound_is_valid_for_a_known_gaussian_and_grows_with_mu():
    """Scores from an exact μ-GDP test (N(±μ/2, 1)): the (ε, δ) and GDP bounds stay under the
    truth at every seed, and a larger μ gives a larger bound."""
    from fedpers.privacy.accountant import analytic_gaussian_epsilon

    bounds = {}
    for mu in (1.0, 3.0):
        true_eps = analytic_gaussian_epsilon(mu, 1e-5)
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            inc = torch.rand(1000, generator=g) < 0.5
            scores = torch.randn(1000, generator=g, dtype=torch.float64) + mu * (inc.double() - 0.5)
            snj = audit_math.one_run_lower_bound(scores, inc, 1e-5)
            gdp = audit_math.one_run_gdp_lower_bound(scores, inc, 1e-5)
            ind = audit_math.independent_gdp_lower_bound(scores, inc)
            assert snj["epsilon_lower"] <= true_eps and gdp["mu_lower"] <= mu and ind <= mu
            bounds.setdefault(mu, []).append(ind)
    assert min(bounds[3.0]) > max(bounds[1.0])
    assert min(bounds[3.0]) > 2.0  # 1000 independent trials pin μ = 3 within ~0.6


@pytest.mark.parametrize("mu, n", [(0.9, 60), (2.0, 200)])
def test_gaussian_score_estimator_is_unbiased_and_its_bounds_cover(mu, n):
    """Synthetic score pairs N(±μ/2, σ²) (σ unknown to the estimator) with a fair coin each, 200
    repetitions: the mean estimate is μ within 3 standard errors, and each one-sided 95% bound
    covers μ at least at its level (less two binomial standard deviations of 200 trials: 0.92);
    the uncorrected standardised difference is visibly biased at n = 60, the corrected is not."""
    g = torch.Generator().manual_seed(11)
    est, raw, lower_ok, upper_ok = [], [], 0, 0
    for _ in range(200):
        inc = torch.rand(n, generator=g) < 0.5
        scores = 3.0 * (torch.randn(n, generator=g, dtype=torch.float64) + mu * (inc.double() - 0.5)) + 7.0
        r = audit_math.gaussian_score_mu(scores, inc, 0.95)
        est.append(r["mu"])
        raw.append(r["mu"] / (1.0 - 3.0 / (4.0 * (n - 2) - 1.0)))
        lower_ok += r["mu_lower"] <= mu
        upper_ok += r["mu_upper"] >= mu
    e = torch.tensor(est, dtype=torch.float64)
    se = float(e.std()) / 200**0.5
    assert abs(float(e.mean()) - mu) < 3 * se, (float(e.mean()), mu, se)
    assert lower_ok / 200 >= 0.92 and upper_ok / 200 >= 0.92, (lower_ok, upper_ok)
    if n == 60:
        assert float(torch.tensor(raw).mean()) - mu > abs(float(e.mean()) - mu)


def test_p_value_matches_the_binomial_tail_without_delta():
    from scipy import stats

    p = audit_math.one_run_p_value(100, 40, 35, 1.0, 0.0)
    assert p == pytest.approx(stats.binom.sf(34, 40, 1 / (1 + torch.e**-1.0)))
    assert audit_math.one_run_p_value(100, 40, 35, 1.0, 1e-3) > p  # δ only loosens


# ----- the scorer sees only what was published ---------------------------------------------
def test_scorer_receives_only_published_outputs():
    """score_canaries takes the protocol, the Published record and the canaries: nothing else.
    Every published value is a noisy release (it differs from the unnoised sum by noise of the
    recorded σ), and the broadcasts are the protocol's public state."""
    assert list(inspect.signature(audit_lib.score_canaries).parameters) == ["protocol", "published", "canaries"]
    assert {f.name for f in dataclasses.fields(audit_lib.Published)} == {"broadcasts", "releases"}
    cfg = altmin_cfg(epsilon=4.0)
    design = experiment("altmin").canary_design()
    protocol = design.protocol(cfg, 10)
    cans = design.canaries(protocol, torch.Generator().manual_seed(0), 10)
    included = torch.arange(10) % 2 == 0
    units = cans.units(included)
    published, ledger = audit_lib.run_published(protocol, units, audit_lib.PublishingPrivatizer(3))
    assert len(published.releases) == len(ledger) == 1 + 2 * protocol.rounds
    for release, value in published.releases:
        r = release.round
        unnoised = client_message(protocol, r, published.broadcasts[r], units).stats[
            {"init.W": "W"}.get(release.name, release.name[-1])
        ]
        part = released_part(release, value - unnoised)
        z = part / release.noise_std
        assert 0.5 < float(z.std()) < 1.6 and abs(float(z.mean())) < 4 / part.numel() ** 0.5


def test_audit_without_noise_information_cannot_separate():
    """With the DP noise 10⁴× larger (recorded as such), the published outputs carry no signal:
    the bounds are 0, though the unnoised sums would separate the canaries perfectly."""
    cfg = altmin_cfg(epsilon=0.001)
    result = audit_lib.audit(ALTMIN, cfg, 10, runs=5, seed=1)
    assert result["epsilon_lower"] == 0.0 and result["independent_gdp"]["mu_lower"] < result["proven_mu"] + 0.05
    assert result["canary_mu"] < 0.01


def test_canary_count_is_checked_before_any_run():
    with pytest.raises(ValueError, match=r"canaries must be in \[2, 10\]"):
        audit_lib.audit(ALTMIN, altmin_cfg(), 11, placement="orthogonal")
    with pytest.raises(ValueError, match="no random placement"):
        audit_lib.audit(FEDREP, config_lib.build(FEDREP.config_type, {"epsilon": 4.0}), 500, placement="random")
    with pytest.raises(ValueError, match="placement must be one of"):
        audit_lib.audit(ALTMIN, altmin_cfg(), 5, placement="diagonal")
    with pytest.raises(ValueError, match="epsilon must be finite"):
        audit_lib.audit(ALTMIN, altmin_cfg(epsilon=float("inf")), 5)


def test_the_canary_count_defaults_to_ten_or_the_designs_capacity():
    """``--canaries`` need not be guessed: 10 per run, or fewer where the design has fewer orthogonal
    directions (altmin at d = 10: 10; paired canaries take two directions each: 5; d = 4: 4)."""
    assert audit_lib.audit(ALTMIN, altmin_cfg(), runs=1)["canaries_per_run"] == 10
    assert audit_lib.audit(ALTMIN, altmin_cfg(), placement="paired")["canaries_per_run"] == 5
    assert audit_lib.audit(ALTMIN, altmin_cfg(dim=4, rank=2))["canaries_per_run"] == 4


def test_cli_audit_prints_proven_and_lower_bounds(capsys):
    from fedpers.commands.cli import main

    assert main(["audit", "altmin", "--canaries", "6", "--runs", "2", "--epsilon", "3"]) == 0
    out = capsys.readouterr().out
    assert "proven ε = 3" in out and "empirical ε lower bound" in out and "replace-one" in out
    assert "headline (threshold, non-parametric): ε ≥" in out
    flags = ["--canaries", "6", "--runs", "2", "--epsilon", "3", "--releases", "W,b", "--score", "gaussian"]
    assert main(["audit", "altmin", *flags]) == 0
    out = capsys.readouterr().out
    assert "headline (Gaussian score" in out and "for the audited releases W, b alone (the whole run: ε = 3" in out
    with pytest.raises(ValueError, match="score must be one of threshold, gaussian"):
        headline({"proven_epsilon": 1.0}, "median")


def test_cli_audit_out_saves_the_result_once_and_refuses_a_file_or_a_second_audit(tmp_path, capsys):
    """``--out DIR`` saves DIR/audit.json (the printed result); a file in its place or an earlier
    audit there is refused (exit 2) before any audit run, never overwritten."""
    import json

    from fedpers.commands.cli import main

    flags = ["--canaries", "4", "--runs", "1", "--epsilon", "3", "--n-users", "200", "--quiet"]
    assert main(["audit", "altmin", *flags, "--out", str(tmp_path / "a")]) == 0
    saved = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert (
        saved["proven_epsilon"] == pytest.approx(3, rel=1e-3) and capsys.readouterr().out == ""
    )  # --quiet: written, not printed
    before = (tmp_path / "a" / "audit.json").read_bytes()
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "a", tmp_path / "f", tmp_path / "f" / "sub"):
        assert main(["audit", "altmin", *flags, "--out", str(out)]) == 2
        assert "out:" in capsys.readouterr().err
    assert (tmp_path / "a" / "audit.json").read_bytes() == before


# ----- many canaries per run: random directions, interference in the score ----------------------
@pytest.mark.slow
def test_random_canaries_beyond_the_dimension_are_scored_with_their_interference():
    """40 canaries at d = 10 (4 per dimension, far from orthogonal), 5 runs: the scorer's
    standardised scores have variance 1 and means ±separation/2 as its interference-aware model
    says, while the scores standardised by the canary's own noise alone (ignoring the other
    canaries' ±c/2) vary well beyond 1."""
    cfg = altmin_cfg(epsilon=4.0)
    design = ALTMIN.canary_design()
    protocol = design.protocol(cfg, 40)
    coins = torch.Generator().manual_seed(5)
    centred, naive = [], []
    for run in range(5):
        cans = design.random_canaries(protocol, torch.Generator().manual_seed(run), 40)
        included = torch.rand(40, generator=coins) < 0.5
        published, _ = audit_lib.run_published(
            protocol, cans.units(included), audit_lib.PublishingPrivatizer(100 + run)
        )
        scored = audit_lib.canary_scores(protocol, published, cans)
        sign = torch.where(included, 0.5, -0.5).double()
        centred.append(scored.standard - sign * scored.separation)
        own = torch.diagonal(scored.gram).sqrt()
        naive.append(scored.llr / own - sign * own)
    z, zn = torch.cat(centred), torch.cat(naive)
    # scores of overlapping canaries share noise, so 200 of them pin the variance only loosely
    assert abs(float(z.mean())) < 0.2 and 0.6 < float(z.var()) < 1.3, (float(z.mean()), float(z.var()))
    assert float(zn.var()) > float(z.var())  # the interference is there, and accounted


def test_interference_model_of_the_scores_is_exact_for_gaussian_releases():
    """K = 30 canary differences d_j in R^8 (random, overlapping), the release Y = Σ s_j d_j/2 + N(0, I)
    with fair signs s_j, 4000 draws: each canary's standardised score has mean ±separation/2 and
    variance 1 — the model :class:`CanaryScores` states, interference included."""
    g = torch.Generator().manual_seed(3)
    D = torch.randn(30, 8, generator=g, dtype=torch.float64) * 0.4
    gram = D @ D.T
    signs = torch.where(torch.rand(4000, 30, generator=g) < 0.5, 1.0, -1.0).double()
    Y = signs @ D / 2 + torch.randn(4000, 8, generator=g, dtype=torch.float64)
    scored = [audit_lib.CanaryScores(D @ y, gram) for y in Y]
    standard = torch.stack([s.standard for s in scored])
    centred = standard - signs * scored[0].separation / 2
    assert torch.allclose(centred.mean(0), torch.zeros(30, dtype=torch.float64), atol=0.06)
    assert torch.allclose(centred.var(0), torch.ones(30, dtype=torch.float64), atol=0.08)
    naive = torch.stack([s.llr for s in scored]) / torch.diagonal(gram).sqrt() - signs * torch.diagonal(gram).sqrt() / 2
    assert float(naive.var(0).mean()) > 1.5  # ignoring the other canaries would misstate the variance


def test_in_role_and_empty_slot_scores_have_the_laws_the_null_slot_bound_assumes():
    """12 present canaries and 20 empty slots on orthogonal coordinates of one Gaussian release
    (σ = 1, 4000 draws, fair coins): each present canary's score against the version it does not
    hold is N(separation, 1) whichever coin it drew, each empty slot's score N(0, 1); a slot that
    overlaps a present canary is refused (its score would carry that canary's data)."""
    g = torch.Generator().manual_seed(5)
    k, slots = 12, 32
    D = torch.diag(torch.linspace(0.5, 1.5, slots, dtype=torch.float64))  # slot j's c⁺ − c⁻ on e_j
    gram = D @ D.T
    signs = torch.where(torch.rand(4000, k, generator=g) < 0.5, 1.0, -1.0).double()
    Y = torch.cat([signs, torch.zeros(4000, slots - k, dtype=torch.float64)], 1) @ D / 2
    Y = Y + torch.randn(4000, slots, generator=g, dtype=torch.float64)
    every = audit_lib.CanaryScores(Y @ D.T, gram)  # one row of scores per draw
    present = audit_lib.CanaryScores(every.llr[:, :k], gram[:k, :k])
    roles, null = audit_lib.in_role_scores(present, signs > 0), audit_lib.null_scores(every, k)
    assert torch.allclose(roles.mean(0), torch.diagonal(D)[:k], atol=0.06)
    assert torch.allclose(roles.var(0), torch.ones(k, dtype=torch.float64), atol=0.08)
    assert torch.allclose(null.mean(0), torch.zeros(slots - k, dtype=torch.float64), atol=0.06)
    assert torch.allclose(null.var(0), torch.ones(slots - k, dtype=torch.float64), atol=0.08)
    overlap = gram.clone()
    overlap[0, k] = overlap[k, 0] = 0.1
    with pytest.raises(ValueError, match="orthogonal to every present canary"):
        audit_lib.null_scores(audit_lib.CanaryScores(D @ Y[0], overlap), k)


def test_null_slot_bound_finds_the_proven_mu_and_catches_halved_noise(monkeypatch):
    """AltMin's W and b alone (the canaries move them by their full sensitivity) at d = 20: 5 canaries
    and 15 empty slots per run, 12 runs. The null-slot Gaussian-score estimate is within 4 standard
    errors of the proven μ on honest code; with σ halved (ledger unchanged) its lower bound exceeds it."""
    cfg = altmin_cfg(epsilon=5.0, dim=20)
    honest = audit_lib.audit(ALTMIN, cfg, 5, runs=12, releases=("W", "b"))
    null = honest["gaussian_score_null"]
    assert null["n_in"] == 60 and null["null_scores"] == 180
    assert honest["canary_mu"] == pytest.approx(honest["proven_mu"])
    assert abs(null["mu"] - honest["proven_mu"]) < 4 * (1 / 60 + 1 / 180) ** 0.5
    assert "null-slot Gaussian-score bound" in format_audit(honest)
    assert "empty slots" in headline(honest, "gaussian")
    original = Privatizer._perturb

    def perturb(self, release, value, noise):
        return original(self, dataclasses.replace(release, noise_std=release.noise_std / 2), value, noise)

    monkeypatch.setattr(Privatizer, "_perturb", perturb)
    bugged = audit_lib.audit(ALTMIN, cfg, 5, runs=12, releases=("W", "b"))
    assert bugged["gaussian_score_null"]["mu_lower"] > bugged["proven_mu"]


@pytest.mark.slow
def test_honest_random_placement_bounds_stay_below_proven():
    """Random placement, 100 canaries per run at d = 10, 1000 trials, 3 seeds: no bound (nor the
    Gaussian-score lower bound) exceeds the proven value."""
    cfg = altmin_cfg(epsilon=4.0)
    for seed in range(3):
        result = audit_lib.audit(ALTMIN, cfg, 100, runs=10, seed=seed)
        assert result["placement"].startswith("random") and result["trials"] == 1000
        assert max(_bounds(result)) <= result["proven_epsilon"], (seed, _bounds(result))
        assert result["gaussian_score"]["mu_lower"] <= result["proven_mu"]


# ----- honest code stays below; planted bugs go above (slow) --------------------------------
def _bounds(result):
    return result["epsilon_lower"], result["one_run_gdp"]["epsilon_lower"], result["independent_gdp"]["epsilon_lower"]


@pytest.mark.slow
@pytest.mark.parametrize("cohorts, epsilon", [("disjoint", 8.0), ("all", 4.0)])
def test_honest_altmin_lower_bounds_stay_below_proven(cohorts, epsilon):
    cfg = altmin_cfg(epsilon=epsilon, cohorts=cohorts)
    for seed in range(3):
        result = audit_lib.audit(ALTMIN, cfg, 10, runs=50, seed=seed)
        assert max(_bounds(result)) <= result["proven_epsilon"], (seed, _bounds(result))
        assert result["independent_gdp"]["mu_lower"] <= result["proven_mu"]


@pytest.mark.slow
def test_honest_altmin_at_1000_trials_stays_below_proven_at_ten_seeds():
    """The table's budget (10 canaries × 100 runs, ε = 4): at each of 10 seeds no non-parametric
    bound and no Gaussian-score lower bound exceeds the proven value."""
    cfg = altmin_cfg(epsilon=4.0)
    for seed in range(10):
        result = audit_lib.audit(ALTMIN, cfg, 10, runs=100, seed=seed)
        assert max(_bounds(result)) <= result["proven_epsilon"], (seed, _bounds(result))
        assert result["gaussian_score"]["mu_lower"] <= result["proven_mu"], (seed, result["gaussian_score"])


@pytest.fixture
def halved_noise(monkeypatch):
    """Noise scaled by the per-unit bound instead of the sensitivity Δ = 2·bound: σ halved, the
    ledger still records the full σ and event."""
    original = Privatizer._perturb

    def perturb(self, release, value, noise):
        return original(self, dataclasses.replace(release, noise_std=release.noise_std / 2), value, noise)

    monkeypatch.setattr(Privatizer, "_perturb", perturb)


@pytest.fixture
def no_label_clip(monkeypatch):
    monkeypatch.setattr(linalg, "clip_scalar", lambda y, c: y)


@pytest.fixture
def no_cohort_filter(monkeypatch):
    original = AltMinProtocol.client_update

    def update(self, round, broadcast, units):
        if round == 0:
            return original(self, round, broadcast, units)
        x, y = units["x"].to(self.dtype), units["y"].to(self.dtype)
        A, b = self.round_statistics(broadcast["U"].to(self.dtype), x, y)
        return Message({"A": A, "b": b}, int(x.shape[0]))

    monkeypatch.setattr(AltMinProtocol, "client_update", update)


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["halved_noise", "no_label_clip", "no_cohort_filter"])
def test_planted_bug_raises_the_lower_bound_above_proven(bug, request):
    request.getfixturevalue(bug)
    rounds = 8 if bug == "no_cohort_filter" else 2
    cfg = altmin_cfg(epsilon=8.0, rounds=rounds, cohorts=Cohorts.DISJOINT)
    result = audit_lib.audit(ALTMIN, cfg, 10, runs=50, seed=0)
    assert result["independent_gdp"]["epsilon_lower"] > result["proven_epsilon"], (
        bug,
        _bounds(result),
        result["proven_epsilon"],
    )
    assert result["gaussian_score"]["mu_lower"] > result["proven_mu"], (bug, result["gaussian_score"])
    print(bug, _bounds(result), result["proven_epsilon"])


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["halved_noise", "no_label_clip", "no_cohort_filter"])
def test_planted_bug_raises_the_null_slot_bound_above_proven(bug, request):
    """The same planted bugs at d = 20 (10 canaries and 10 empty slots per run, 50 runs): the
    null-slot Gaussian-score μ lower bound exceeds the proven μ."""
    request.getfixturevalue(bug)
    rounds = 8 if bug == "no_cohort_filter" else 2
    cfg = altmin_cfg(epsilon=8.0, rounds=rounds, cohorts=Cohorts.DISJOINT, dim=20)
    result = audit_lib.audit(ALTMIN, cfg, 10, runs=50, seed=0)
    null = result["gaussian_score_null"]
    assert null["null_scores"] == 500 and null["mu_lower"] > result["proven_mu"], (bug, null, result["proven_mu"])


def test_canaries_reach_the_separation_their_design_promises():
    """AltMin canaries differ by the full replace-one sensitivity in W and b and not in A:
    μ_canary = μ_proven·sqrt(2/3) (disjoint cohorts: 2 of 3 releases). NoisyHead canaries differ
    only in the label part of the gradient: μ_canary = μ_proven·C/(C + RG)."""
    result = audit_lib.audit(ALTMIN, altmin_cfg(epsilon=4.0), 4, runs=1)
    assert result["canary_mu"] == pytest.approx(result["proven_mu"] * (2 / 3) ** 0.5, rel=1e-6)
    nh = experiment("noisyhead")
    cfg = config_lib.build(
        nh.config_type,
        {"prompts": 100, "epsilon": 4.0, "calibration": "accountant", "steps": 3, "regime": "low-dim", "dim": 5},
    )
    result = audit_lib.audit(nh, cfg, 9, runs=1)
    p = experiment("noisyhead").canary_design().protocol(cfg, 9)
    assert result["canary_mu"] == pytest.approx(
        result["proven_mu"] * p.clip_c / (p.clip_c + p.proj_r * p.proj_g), rel=1e-6
    )
    assert "prompt" in result["neighbouring"]
    assert max(_bounds(result)) <= result["proven_epsilon"]


def test_altmin_w_and_b_releases_audited_alone_are_reached_at_their_own_proven_mu():
    """Scoring only W and b (the releases the canaries move by their full 2·bound) makes the
    canaries' separation equal the proven μ of those releases: the audit of that sub-composition
    is tight by design. The whole run's proven values are still reported beside it, and the
    left-out release changes nothing but the proven values (its gram share is 0 for these canaries)."""
    whole = audit_lib.audit(ALTMIN, altmin_cfg(epsilon=4.0), 4, runs=1)
    part = audit_lib.audit(ALTMIN, altmin_cfg(epsilon=4.0), 4, runs=1, releases=("W", "b"))
    assert part["canary_mu"] == pytest.approx(part["proven_mu"], rel=1e-9)
    assert part["proven_mu"] == pytest.approx(whole["proven_mu"] * (2 / 3) ** 0.5, rel=1e-6)
    assert part["proven_epsilon"] < part["run_proven_epsilon"] == pytest.approx(whole["proven_epsilon"])
    assert part["run_proven_mu"] == pytest.approx(whole["proven_mu"]) and part["audited_releases"] == ["W", "b"]
    assert part["independent_gdp"]["mu_lower"] == pytest.approx(whole["independent_gdp"]["mu_lower"], rel=1e-9)
    with pytest.raises(ValueError, match="releases must be a non-empty subset of W, A, b; got G"):
        audit_lib.audit(ALTMIN, altmin_cfg(), 4, releases=("G",))


def test_paired_canaries_move_altmins_psd_release_by_its_full_sensitivity():
    """Paired placement (Q2 on one of two orthogonal coordinates, W still sign-flipped): A, blind to
    a flip, now moves by its full √2·bound, so A audited alone is reached at its own proven μ (rank 1:
    A's change is diagonal, which the upper-triangle noise sees in full); b by √2 of its 2·bound, W
    in full: the whole run at sqrt(5/6) of its μ (a sign flip: sqrt(2/3))."""
    cfg = altmin_cfg(epsilon=4.0, rank=1)
    a = audit_lib.audit(ALTMIN, cfg, 5, runs=1, placement="paired", releases=("A",))
    assert a["canary_mu"] == pytest.approx(a["proven_mu"], rel=1e-9) and "pairs" in a["placement"]
    wb = audit_lib.audit(ALTMIN, cfg, 5, runs=1, placement="paired", releases=("W", "b"))
    assert wb["canary_mu"] == pytest.approx(wb["proven_mu"] * 0.75**0.5, rel=1e-9)  # W 1, b 1/2 of 2 shares
    whole = audit_lib.audit(ALTMIN, cfg, 5, runs=1, placement="paired")
    assert whole["canary_mu"] == pytest.approx(whole["proven_mu"] * (5 / 6) ** 0.5, rel=1e-9)  # sign flip: 2/3
    with pytest.raises(ValueError, match=r"canaries must be in \[2, 5\]"):
        audit_lib.audit(ALTMIN, cfg, 6, placement="paired")


# ----- FedRep ---------------------------------------------------------------------------------
FEDREP = experiment("fedrep")


def test_fedrep_canaries_reach_their_promised_separation():
    """FedRep canaries: one round (one block): the init W at f = sqrt((p − j)² + j)/p of the full
    sensitivity, and the round's G at C ("+") against 0 ("−"): μ_canary² = μ_release²·(f² + T/4).
    T ≥ 2 rounds (two blocks: the same data on orthogonal coordinates): W at f/√2, every G √2·C
    apart: μ_canary² = μ_release²·(f²/2 + T/2). μ_proven² = μ_release²·(1 + T). Odd and even m lay
    the pairs out differently; both are checked."""
    shares = {1: lambda f: f**2 + 1 / 4, 2: lambda f: f**2 / 2 + 2 / 2}
    for m, rounds in ((5, 1), (8, 2)):
        share = shares[rounds]
        cfg = config_lib.build(FEDREP.config_type, {"dim": 24, "rounds": rounds, "samples_per_user": m, "epsilon": 4.0})
        p = experiment("fedrep").canary_design().protocol(cfg, 4)
        f = fedrep_init_fraction(p)
        result = audit_lib.audit(FEDREP, cfg, 4, runs=1)
        want = result["proven_mu"] * (share(f) / (1 + rounds)) ** 0.5
        assert result["canary_mu"] == pytest.approx(want, rel=1e-6), (m, rounds)
    with pytest.raises(ValueError, match="samples_per_user"):
        audit_lib.audit(FEDREP, config_lib.build(FEDREP.config_type, {"dim": 12, "samples_per_user": 4, "rank": 2}), 2)


def test_steered_fedrep_canaries_reach_the_g_releases_full_sensitivity():
    """Steered (white-box) FedRep canaries rebuild each round's labels from the broadcast U so that
    G⁻ = −G⁺ at the clip: the G releases alone are reached at their own proven μ, exactly; the
    whole run at sqrt((f²/2 + T)/(1 + T)) of its μ (W keeps the fixed two-block data)."""
    cfg = config_lib.build(FEDREP.config_type, {"dim": 24, "rounds": 2, "samples_per_user": 5, "epsilon": 4.0})
    g = audit_lib.audit(FEDREP, cfg, 4, runs=1, placement="steered", releases=("G",))
    assert g["canary_mu"] == pytest.approx(g["proven_mu"], rel=1e-6) and "steered" in g["placement"]
    with pytest.raises(ValueError, match="no steered placement"):
        audit_lib.audit(ALTMIN, altmin_cfg(), 4, placement="steered")


@pytest.mark.slow
def test_steered_fedrep_canaries_reach_their_promised_separation_over_the_whole_run():
    cfg = config_lib.build(FEDREP.config_type, {"dim": 24, "rounds": 2, "samples_per_user": 5, "epsilon": 4.0})
    whole = audit_lib.audit(FEDREP, cfg, 4, runs=1, placement="steered")
    f = fedrep_init_fraction(FEDREP.canary_design().protocol(cfg, 4))
    assert whole["canary_mu"] == pytest.approx(whole["proven_mu"] * ((f**2 / 2 + 2) / 3) ** 0.5, rel=1e-6)


@pytest.mark.slow
def test_honest_fedrep_lower_bounds_stay_below_proven():
    cfg = config_lib.build(FEDREP.config_type, {"dim": 30, "rounds": 2, "epsilon": 8.0})
    result = audit_lib.audit(FEDREP, cfg, 5, runs=60, seed=0)  # the two-block design holds 5 canaries at d = 30
    assert max(_bounds(result)) <= result["proven_epsilon"], _bounds(result)
    assert result["independent_gdp"]["mu_lower"] <= result["proven_mu"]


# ----- NoisyGD --------------------------------------------------------------------------------
NOISYGD = experiment("noisygd")


def test_noisygd_canaries_reach_their_promised_separation():
    """At W = 0 a canary's two clipped gradients are ±G_c r̂ e_iᵀ: with one step μ_canary = μ_proven
    (the full sensitivity). Over 30 steps W moves little (lr·noise): at least 0.8 of it."""
    cfg = config_lib.build(NOISYGD.config_type, {"feature_dim": 12, "steps": 1, "accountant": "pld"})
    result = audit_lib.audit(NOISYGD, cfg, 12, runs=1)
    assert result["canary_mu"] == pytest.approx(result["proven_mu"], rel=1e-5)
    result = audit_lib.audit(NOISYGD, dataclasses.replace(cfg, steps=30), 12, runs=1)
    assert 0.8 * result["proven_mu"] < result["canary_mu"] <= result["proven_mu"] * (1 + 1e-5)
    assert "example" in result["neighbouring"]
    with pytest.raises(ValueError, match="clip_rule"):
        audit_lib.audit(NOISYGD, dataclasses.replace(cfg, clip_rule="adaptive"), 4)


@pytest.mark.slow
def test_honest_noisygd_lower_bounds_stay_below_proven():
    cfg = config_lib.build(NOISYGD.config_type, {"feature_dim": 20, "steps": 5, "epsilon": 8.0, "accountant": "pld"})
    result = audit_lib.audit(NOISYGD, cfg, 20, runs=25, seed=0)
    print(_bounds(result), result["proven_epsilon"], result["canary_mu"], result["proven_mu"])
    assert max(_bounds(result)) <= result["proven_epsilon"], _bounds(result)
    assert result["independent_gdp"]["mu_lower"] <= result["proven_mu"]


# ----- DPALS ----------------------------------------------------------------------------------
DPALS = experiment("dpals")


def test_dpals_canaries_reach_their_promised_separation():
    """A DPALS canary's two versions rate different items, each at both clips: b differs by √2·Γ_b;
    G by Γ_G·sqrt(t(Û_a) + t(Û_b)), t(u) = (1 + Σu⁴)/2 being a unit block's share in its released
    upper triangle. With one round U is the public initial_U, so the separation is known exactly;
    over more rounds it stays between sqrt(3/8) (t ≥ 1/2) and 1/√2 (t ≤ 1) of the proven μ."""
    cfg = config_lib.build(DPALS.config_type, {"steps": 1, "n_items": 40, "private_center": False})
    p = experiment("dpals").canary_design().protocol(cfg, 20)
    result = audit_lib.audit(DPALS, cfg, 20, runs=1)
    u = p.initial_U.double() / p.initial_U.double().norm(dim=1, keepdim=True)
    t = (1 + (u**4).sum(1)) / 2
    expected = ((2 + t[0::2] + t[1::2]) / p.noise_multiplier**2).sqrt().mean()
    assert result["canary_mu"] == pytest.approx(float(expected), rel=1e-9)
    result = audit_lib.audit(DPALS, dataclasses.replace(cfg, steps=3), 20, runs=1)
    assert (3 / 8) ** 0.5 * result["proven_mu"] - 1e-9 <= result["canary_mu"] <= result["proven_mu"] / 2**0.5 + 1e-9
    with pytest.raises(ValueError, match=r"canaries must be in \[2, 1\]"):  # with round 0 a canary takes 2B = 40 items
        audit_lib.audit(DPALS, dataclasses.replace(cfg, private_center=True), 4)


def test_noisygd_pca_remedy_is_audited_and_paired_canaries_reach_its_second_moments_mu():
    """NoisyGD with the PCA remedy: a canary's second moment R²e_ie_iᵀ is sign-blind, so paired
    canaries (e_a vs e_b) move the released Σ x xᵀ by its full √2·R² — their separation is that
    release's own proven μ exactly; the whole run is audited too (the projection mixes the
    canaries in the gradient steps: interference, so no empty slot is orthogonal to them)."""
    cfg = config_lib.build(
        NOISYGD.config_type, {"epsilon": 4.0, "remedy": "pca", "feature_dim": 20, "steps": 3, "accountant": "pld"}
    )
    alone = audit_lib.audit(NOISYGD, cfg, 5, runs=1, placement="paired", releases=("second_moment",))
    assert alone["canary_mu"] == pytest.approx(alone["proven_mu"], rel=1e-6)
    assert alone["proven_mu"] < alone["run_proven_mu"] and alone["gaussian_score_null"] is not None
    whole = audit_lib.audit(NOISYGD, cfg, 10, runs=1)
    assert 0 < whole["canary_mu"] < whole["proven_mu"] and "PCA remedy" in whole["canary_design"]


def test_dpals_round0_canaries_move_the_sums_and_counts_by_their_promised_share():
    """With round 0 (private centring): canary i rates a block of B items at +BIG or the next block at
    −BIG, so its own share of round 0's (s, c) is exactly 1/2 of μ² (6/8 of s, 2/8 of c). The canaries
    share s's total entry (gram_ij = μ²/4), which the scorer counts as interference:
    separation = (μ²/2)/√(μ²/2 + (K − 1)μ⁴/64). Scoring round 0 alone compares with round 0's own
    proven μ (the ledger's item_sums and item_counts releases)."""
    dp = experiment("dpals")
    cfg = config_lib.build(
        dp.config_type,
        {"epsilon": 4.0, "private_center": True, "n_items": 200, "steps": 1, "clip_embedding": 3.0, "clip_rating": 3.0},
    )
    r0 = audit_lib.audit(dp, cfg, 4, runs=1, releases=("s", "c"))
    mu2 = r0["proven_mu"] ** 2
    assert r0["canary_mu"] == pytest.approx((mu2 / 2) / (mu2 / 2 + 3 * mu2**2 / 64) ** 0.5, rel=1e-6)
    assert r0["proven_mu"] < r0["run_proven_mu"] and "block" in r0["canary_design"]
    assert r0["gaussian_score_null"] is None  # the shared total entry: no empty slot is orthogonal to the canaries
    whole = audit_lib.audit(dp, cfg, 4, runs=1)
    assert r0["canary_mu"] < whole["canary_mu"] < whole["proven_mu"]


@pytest.mark.slow
def test_honest_dpals_lower_bounds_stay_below_proven():
    cfg = config_lib.build(DPALS.config_type, {"steps": 2, "n_items": 100, "epsilon": 8.0, "private_center": False})
    result = audit_lib.audit(DPALS, cfg, 50, runs=10, seed=0)
    print(_bounds(result), result["proven_epsilon"], result["canary_mu"], result["proven_mu"])
    assert max(_bounds(result)) <= result["proven_epsilon"], _bounds(result)
    assert result["independent_gdp"]["mu_lower"] <= result["proven_mu"]


@pytest.mark.slow  # ≈ 20 s: a run, an audit of it and the HTML report
def test_audit_of_a_finished_run_directory_prints_its_ledger_and_reaches_the_report(tmp_path, capsys):
    """`fedpers audit RUN_DIR`: the run's own configuration on canaries, the run's ledger ε beside the
    audit's proven and empirical values, written to RUN_DIR/audit.json and shown by `fedpers report`."""
    from fedpers.commands.cli import main
    from fedpers.commands.report import run_report

    run = tmp_path / "run"
    assert (
        main(
            ["run", "altmin", "--n-users", "200", "--epsilon", "3", "--baselines", "none", "--quiet", "--out", str(run)]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["audit", str(run), "--canaries", "6", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert "its ledger records ε = 3" in out and "proven ε = 3" in out and "Gaussian-score" in out
    saved = __import__("json").loads((run / "audit.json").read_text())
    assert saved["run_ledger"]["epsilon"] == pytest.approx(3.0, rel=1e-3) and saved["trials"] == 12
    assert max(_bounds(saved)) <= saved["proven_epsilon"]
    html = run_report(run)
    assert "<h3>Audit</h3>" in html and "Gaussian-score" in html
    assert main(["audit", str(run), "--canaries", "6", "--epsilon", "9"]) == 2
    assert "the run's own configuration is audited" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("name, k, runs, placement", [("altmin", 5, 200, "paired"), ("fedrep", 8, 125, "steered")])
def test_paired_and_steered_audits_stay_below_proven_and_catch_halved_noise(name, k, runs, placement, monkeypatch):
    """At 1,000 trials the closer canaries stay below the proven ε on honest code (every bound) and
    put the Gaussian-score μ lower bound and the independent-GDP ε above it when σ is halved."""
    exp = experiment(name)
    cfg = config_lib.build(exp.config_type, {"epsilon": 4.0})
    honest = audit_lib.audit(exp, cfg, k, runs=runs, placement=placement)
    assert max(_bounds(honest)) < honest["proven_epsilon"]
    assert honest["gaussian_score"]["mu_lower"] < honest["proven_mu"]
    original = Privatizer._perturb

    def perturb(self, release, value, noise):
        return original(self, dataclasses.replace(release, noise_std=release.noise_std / 2), value, noise)

    monkeypatch.setattr(Privatizer, "_perturb", perturb)
    bugged = audit_lib.audit(exp, cfg, k, runs=runs, placement=placement)
    assert bugged["gaussian_score"]["mu_lower"] > bugged["proven_mu"]
    assert bugged["independent_gdp"]["epsilon_lower"] > bugged["proven_epsilon"]


def test_audit_through_the_flower_runtime_gives_the_local_runtimes_bounds():
    """The same audit (AltMin, W and b alone, 4 canaries and 6 empty slots × 2 runs, seed 0) through
    the Flower runtime's server loop and ClientApp (an in-process Grid of 3 nodes: the canaries reach
    the nodes inside the app) gives the local runtime's scores, bounds and proven ε."""
    from fedpers.configs.runtime import RuntimeOptions
    from tests.flower_support import InProcessGrid

    cfg = altmin_cfg(epsilon=4.0)
    local = audit_lib.audit(ALTMIN, cfg, 4, runs=2, releases=("W", "b"))
    opts = config_lib.build(RuntimeOptions, {"runtime": "flower", "nodes": 3})
    grids = []

    def grid(app, nodes):
        grids.append(InProcessGrid(app, nodes))
        return grids[-1]

    flower = audit_lib.audit(ALTMIN, cfg, 4, runs=2, releases=("W", "b"), flower=opts, grid=grid)
    assert len(grids) == 2 and all(len(g.contexts) == 3 and len(g.sent) >= 3 * 3 for g in grids)
    assert flower["runtime"] == "flower" and local["runtime"] == "local"
    assert "through the Flower runtime" in format_audit(flower)
    assert flower["proven_epsilon"] == local["proven_epsilon"] and flower["canary_mu"] == pytest.approx(
        local["canary_mu"]
    )
    for key in ("gaussian_score", "gaussian_score_null"):
        assert flower[key]["mu"] == pytest.approx(local[key]["mu"], rel=1e-5, abs=1e-6), key
        assert flower[key]["mu_lower"] == pytest.approx(local[key]["mu_lower"], rel=1e-5, abs=1e-6), key
    assert (flower["one_run"]["guesses"], flower["one_run"]["correct"]) == (
        local["one_run"]["guesses"],
        local["one_run"]["correct"],
    )
    assert flower["independent_gdp"]["mu_lower"] == pytest.approx(local["independent_gdp"]["mu_lower"], abs=1e-9)


def test_steered_audit_through_the_flower_runtime_gives_the_local_runtimes_bounds():
    """Steered FedRep canaries (each round's data rebuilt from its broadcast, on the nodes) through the
    Flower runtime's ClientApp on an in-process Grid of 3 nodes: the local runtime's separation, scores
    and bounds, and G still at its full sensitivity (the steering reached the nodes)."""
    from fedpers.configs.runtime import RuntimeOptions
    from tests.flower_support import InProcessGrid

    cfg = config_lib.build(
        FEDREP.config_type, {"dim": 24, "rounds": 2, "samples_per_user": 5, "epsilon": 4.0, "accountant": "rdp"}
    )
    opts = config_lib.build(RuntimeOptions, {"runtime": "flower", "nodes": 3})
    local = audit_lib.audit(FEDREP, cfg, 4, runs=2, placement="steered", releases=("G",))
    flower = audit_lib.audit(
        FEDREP, cfg, 4, runs=2, placement="steered", releases=("G",), flower=opts, grid=InProcessGrid
    )
    assert flower["runtime"] == "flower" and "steered" in flower["placement"]
    assert flower["canary_mu"] == pytest.approx(local["canary_mu"]) == pytest.approx(local["proven_mu"], rel=1e-6)
    assert flower["gaussian_score"]["mu"] == pytest.approx(local["gaussian_score"]["mu"], rel=1e-5, abs=1e-6)
    assert flower["independent_gdp"]["mu_lower"] == pytest.approx(local["independent_gdp"]["mu_lower"], abs=1e-9)


@pytest.mark.slow
def test_audit_through_the_flower_simulation_on_ray_gives_the_local_runtimes_bounds():
    """The same audit through Flower's simulation engine on Ray (2 node actors; the canaries reach
    them inside the ClientApp object) gives the local runtime's bounds for one seed."""
    from fedpers.configs.runtime import RuntimeOptions

    cfg = altmin_cfg(epsilon=4.0)
    local = audit_lib.audit(ALTMIN, cfg, 4, runs=2, releases=("W", "b"))
    opts = config_lib.build(RuntimeOptions, {"runtime": "flower", "nodes": 2, "client_cpus": 1.0})
    flower = audit_lib.audit(ALTMIN, cfg, 4, runs=2, releases=("W", "b"), flower=opts)
    assert flower["runtime"] == "flower"
    for key in ("gaussian_score", "gaussian_score_null"):
        assert flower[key]["mu_lower"] == pytest.approx(local[key]["mu_lower"], rel=1e-5, abs=1e-6), key
    assert _bounds(flower) == pytest.approx(_bounds(local), abs=1e-9)


# ----- distributed and local DP: the nodes add the noise -----------------------------------------
def _node_options(model, **values):
    from fedpers.configs.runtime import RuntimeOptions

    return config_lib.build(RuntimeOptions, {"dp_model": model, "bits": 16, "nodes": 4, **values})


@pytest.mark.parametrize("model", ["distributed", "local"])
def test_node_side_audit_scores_what_the_server_sees_and_reaches_the_nodes_mechanism(model):
    """Under distributed DP the scorer gets each release's decoded modular sum (its noise: the nodes'
    Skellam shares and rounding, std the recorded σ with 2 of 4 nodes' shares required, so shares sized
    for all 4 would show at 1/√2); under local DP each canary's own node vector (one canary per node),
    its own noise of σ = z·B (noise at half its scale would show). AltMin's W and b canaries then separate by
    exactly the nodes' mechanism: local, the proven μ (the per-unit Gaussian of Δ = 2B, the central
    z); distributed, sqrt(Σ (2·B·s)²/V), V the Skellam variance in integer units."""
    from fedpers.privacy.distributed import flatten

    cfg = altmin_cfg(epsilon=4.0, dim=20, accountant="rdp")  # RDP: the PLD accounting would take most of the time
    design = ALTMIN.canary_design()
    options = _node_options(model, min_nodes=2 if model == "distributed" else 0)
    protocol, _, make = audit_lib.node_side_plan(design, cfg, 8, options)
    cans = design.canaries(protocol, torch.Generator().manual_seed(0), 8)
    units = cans.units(torch.arange(8) % 2 == 0)
    published, ledger = audit_lib.run_published_nodes(protocol, units, make(3))
    assert len(published.releases) == len(ledger) == 1 + 2 * protocol.rounds
    at: dict[int, int] = {}
    expected: dict[str, float] = {}  # Σ (2·B·s)²/V over W and b, by the cohort a release touches
    noises = []
    for release, value in published.releases:
        r = release.round
        spec = protocol.stat_specs(r)[at.setdefault(r, 0)]
        at[r] += 1
        one = [
            client_message(protocol, r, published.broadcasts[r], {k: v[i : i + 1] for k, v in units.items()})
            for i in range(8)
        ]
        rows = torch.stack([flatten(m.stats[spec.name].unsqueeze(0), spec.shape, spec.symmetric)[0] for m in one])
        if model == "local":
            assert value.shape == rows.shape  # one noisy vector per node, none summed before the scorer
            sent = torch.tensor([m.count > 0 for m in one])  # a node whose canary is not in the round's cohort sends 0
            noise = (value - rows)[sent] / release.noise_std
            assert release.mechanism == "local_gaussian" and release.noise_std == pytest.approx(
                protocol_z(ledger) * spec.per_unit_bound
            )
        else:
            noise = (flatten(value.unsqueeze(0), spec.shape, spec.symmetric)[0] - rows.sum(0)) / release.noise_std
            assert release.mechanism == "skellam_distributed"
            if spec.name in ("W", "b"):
                term = (2 * release.per_unit_bound * release.params["scale"]) ** 2 / release.event.variance
                expected[release.units] = expected.get(release.units, 0.0) + term
        noises.append(noise.flatten())
    assert 0.93 < float(torch.cat(noises).std()) < 1.07 and torch.cat(noises).numel() > 1500
    result = audit_lib.audit(ALTMIN, cfg, 8, runs=1, releases=("W", "b"), node_side=options)
    assert result["dp_model"] == model and f"trust model: {model} DP" in format_audit(result)
    if model == "local":
        assert result["canary_mu"] == pytest.approx(result["proven_mu"], rel=1e-9)
    else:
        every = expected.pop(ALL_UNITS)  # W: every canary; b: its own cohort's round only
        assert result["proven_mu"] is None and result["canary_mu"] == pytest.approx(
            (every + max(expected.values())) ** 0.5, rel=1e-9
        )
        assert result["canary_mu"] <= result["skellam_gaussian_mu"] <= 1.05 * result["canary_mu"]


def protocol_z(ledger):
    return next(iter(ledger)).event.noise_multiplier


@pytest.mark.slow
def test_local_dp_audit_finds_the_proven_mu_and_catches_noise_at_half_its_scale(monkeypatch):
    """Local DP, AltMin's W and b (5 canaries, each on its node, 15 empty slots, 12 runs): the
    null-slot estimate is within 4 standard errors of the proven μ; with each unit's local noise at
    half its scale (ledger unchanged) its lower bound exceeds it."""
    from fedpers.privacy import distributed as dist

    cfg = altmin_cfg(epsilon=5.0, dim=20)
    honest = audit_lib.audit(ALTMIN, cfg, 5, runs=12, releases=("W", "b"), node_side=_node_options("local"))
    null = honest["gaussian_score_null"]
    assert null["n_in"] == 60 and null["null_scores"] == 180
    assert abs(null["mu"] - honest["proven_mu"]) < 4 * (1 / 60 + 1 / 180) ** 0.5
    original = dist.local_gaussian
    monkeypatch.setattr(dist, "local_gaussian", lambda x, std, g, secure: original(x, std / 2, g, secure))
    bugged = audit_lib.audit(ALTMIN, cfg, 5, runs=12, releases=("W", "b"), node_side=_node_options("local"))
    assert bugged["gaussian_score_null"]["mu_lower"] > bugged["proven_mu"]


def test_node_side_audit_refuses_what_it_cannot_simulate():
    with pytest.raises(ValueError, match="drop --runtime flower"):
        audit_lib.audit(
            ALTMIN, altmin_cfg(), 4, node_side=_node_options("local"), flower=_node_options("local", runtime="flower")
        )
    with pytest.raises(ValueError, match="node_dropout"):
        audit_lib.audit(ALTMIN, altmin_cfg(), 4, node_side=_node_options("distributed", node_dropout=0.1))
    with pytest.raises(ValueError, match="min_nodes must be at most"):
        audit_lib.audit(ALTMIN, altmin_cfg(), 3, node_side=_node_options("distributed", min_nodes=4))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["distributed", "local"])
@pytest.mark.parametrize("name, k, runs, values", [("altmin", 10, 100, {"dim": 40}), ("fedrep", 8, 125, {})])
def test_honest_node_side_audits_stay_below_proven(name, k, runs, values, model):
    """1,000 trials at proven ε = 4, seed 0: no non-parametric bound and no Gaussian-score lower bound
    (in/out or null-slot) exceeds the proven ε of the nodes' mechanism (Skellam: its RDP bound)."""
    exp = experiment(name)
    cfg = config_lib.build(exp.config_type, {"epsilon": 4.0, **values})
    result = audit_lib.audit(exp, cfg, k, runs=runs, node_side=_node_options(model))
    print(
        name, model, _bounds(result), result["gaussian_score"], result["gaussian_score_null"], result["proven_epsilon"]
    )
    assert max(_bounds(result)) <= result["proven_epsilon"]
    for key in ("gaussian_score", "gaussian_score_null"):
        if result[key] is not None:
            assert result[key]["epsilon_lower"] <= result["proven_epsilon"], key


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["shares_for_all_nodes", "local_half_scale"])
def test_planted_node_side_mistake_raises_the_bound_above_proven(bug, monkeypatch):
    """Skellam shares sized V/nodes while the ledger counts V/min_nodes per share (min_nodes = nodes/4:
    a quarter of the recorded variance), or local noise at half its scale: AltMin at ε = 4, d = 20,
    10 canaries and 10 empty slots × 30 runs — the null-slot Gaussian-score ε lower bound exceeds the
    proven ε (the non-parametric bounds need more trials than these 300). With 8 of 8 nodes surviving
    the ledger records 4V, so the proven ε is ≈ 1.8 there."""
    from fedpers.privacy import distributed as dist

    if bug == "shares_for_all_nodes":
        options = _node_options("distributed", nodes=8, min_nodes=2)
        monkeypatch.setattr(
            dist, "noise_share", lambda enc, m, g: dist.skellam_noise((enc.padded,), enc.variance / 8, g)
        )
    else:
        options = _node_options("local")
        original = dist.local_gaussian
        monkeypatch.setattr(dist, "local_gaussian", lambda x, std, g, secure: original(x, std / 2, g, secure))
    result = audit_lib.audit(ALTMIN, altmin_cfg(epsilon=4.0, dim=20), 10, runs=30, node_side=options)
    print(bug, _bounds(result), result["gaussian_score_null"], result["proven_epsilon"])
    assert result["gaussian_score_null"]["epsilon_lower"] > result["proven_epsilon"]


# ----- correlated noise: a stream scored on its decorrelated releases -----------------------------
def _correlated_cfg(**values):
    base = {
        "epsilon": 4.0,
        "steps": 4,
        "cohorts": "cyclic",
        "cycle": 2,
        "noise": "banded",
        "feature_dim": 20,
        "classes": 4,
        "accountant": "rdp",
    }
    return config_lib.build(NOISYGD.config_type, {**base, **values})


def test_correlated_stream_is_scored_on_its_decorrelated_releases():
    """NoisyGD with banded noise over 2 cyclic cohorts: the published steps carry noise σ·C⁻¹z, so the
    raw steps' noise is correlated across steps while C·(Y − X)/σ is i.i.d. N(0, 1) — the form the
    scorer projects on. The canaries (each in its cohort's steps) separate by at most the proven μ of
    the joint mechanism on Cx and, their gradients keeping their direction, by nearly all of it."""
    cfg = _correlated_cfg()
    design = NOISYGD.canary_design()
    protocol = design.protocol(cfg, 12)
    cans = design.canaries(protocol, torch.Generator().manual_seed(0), 12)
    units = cans.units(torch.arange(12) % 2 == 0)
    published, ledger = audit_lib.run_published(protocol, units, audit_lib.PublishingPrivatizer(5))
    stream = [(r, v) for r, v in published.releases if r.mechanism == "correlated_gaussian"]
    assert [int(r.params["step"]) for r, _ in stream] == [0, 1, 2, 3]
    noise = (
        torch.stack(
            [
                (v - client_message(protocol, r.round, published.broadcasts[r.round], units).stats["grad"])
                .double()
                .flatten()
                for r, v in stream
            ]
        )
        / stream[0][0].noise_std
    )
    C = protocol.correlated.strategy.matrix(4).double()
    white = C @ noise
    assert 0.9 < float(white.std()) < 1.1 and abs(float((white[0] * white[1]).mean())) < 0.2
    assert float((noise[0] * noise[1]).mean()) < -0.2  # the raw steps' noise is not independent
    result = audit_lib.audit(NOISYGD, cfg, 12, runs=1)
    assert 0.8 * result["proven_mu"] < result["canary_mu"] <= result["proven_mu"] * (1 + 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("name, noise", [("noisygd", "banded"), ("noisygd", "blt"), ("fedrep", "banded")])
def test_honest_correlated_noise_audits_stay_below_proven(name, noise):
    """About 1,000 trials at proven ε = 4 with 2 cyclic cohorts, seed 0: no bound exceeds the proven ε."""
    if name == "noisygd":
        cfg, k, runs = _correlated_cfg(noise=noise, steps=12, feature_dim=40), 20, 50
    else:
        cfg = config_lib.build(
            FEDREP.config_type, {"epsilon": 4.0, "cohorts": "cyclic", "cycle": 2, "noise": noise, "dim": 120}
        )
        k, runs = 10, 100
    result = audit_lib.audit(experiment(name), cfg, k, runs=runs)
    print(
        name, noise, _bounds(result), result["gaussian_score"], result["gaussian_score_null"], result["proven_epsilon"]
    )
    assert max(_bounds(result)) <= result["proven_epsilon"]
    for key in ("gaussian_score", "gaussian_score_null"):
        if result[key] is not None:
            assert result[key]["epsilon_lower"] <= result["proven_epsilon"], key


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["half_scale", "single_participation"])
def test_planted_correlated_noise_mistake_raises_the_bound_above_proven(bug, monkeypatch):
    """NoisyGD, banded noise over 2 cyclic cohorts, 12 steps, ε = 4, 20 canaries × 50 runs: with the
    stream's noise at half its scale (ledger unchanged), or its sensitivity computed for one
    participation while a user takes part in every other step, the null-slot ε lower bound exceeds
    the proven ε."""
    from fedpers.privacy import correlated

    if bug == "half_scale":
        original = Privatizer._perturb

        def perturb(self, release, value, noise):
            return original(self, dataclasses.replace(release, noise_std=release.noise_std / 2), value, noise)

        monkeypatch.setattr(Privatizer, "_perturb", perturb)
    else:
        honest = correlated.sensitivity

        def first_only(C, patterns):
            one = torch.zeros_like(patterns)
            first = patterns.float().argmax(dim=1)
            one[torch.arange(patterns.shape[0]), first] = 1
            return honest(C, one)

        monkeypatch.setattr(correlated, "sensitivity", first_only)
    result = audit_lib.audit(NOISYGD, _correlated_cfg(steps=12, feature_dim=40), 20, runs=50)
    print(bug, _bounds(result), result["gaussian_score_null"], result["proven_epsilon"])
    assert result["gaussian_score_null"]["epsilon_lower"] > result["proven_epsilon"]


@pytest.mark.slow  # a run, then an audit of it
def test_audit_of_a_local_dp_run_directory_audits_its_trust_model(tmp_path, capsys):
    """A run made under --dp-model local is audited under local DP (its nodes' noise, as it ran), not
    under the central mechanism its config would give without its runtime options."""
    from fedpers.commands.cli import main

    run = tmp_path / "run"
    args = [
        "run",
        "altmin",
        "--n-users",
        "200",
        "--epsilon",
        "3",
        "--baselines",
        "none",
        "--quiet",
        "--accountant",
        "rdp",
    ]
    assert main([*args, "--dp-model", "local", "--nodes", "4", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["audit", str(run), "--canaries", "6", "--runs", "2"]) == 0
    assert "trust model: local DP" in capsys.readouterr().out
    saved = __import__("json").loads((run / "audit.json").read_text())
    assert saved["dp_model"] == "local" and saved["proven_epsilon"] == pytest.approx(3.0, rel=1e-2)


@pytest.mark.slow
def test_steered_audit_through_the_flower_simulation_on_ray_gives_the_local_runtimes_bounds():
    """Steered FedRep canaries through Flower's simulation engine on Ray (2 node actors: the steering
    object is pickled into them with the ClientApp) give the local runtime's bounds for one seed."""
    from fedpers.configs.runtime import RuntimeOptions

    cfg = config_lib.build(
        FEDREP.config_type, {"dim": 24, "rounds": 2, "samples_per_user": 5, "epsilon": 4.0, "accountant": "rdp"}
    )
    local = audit_lib.audit(FEDREP, cfg, 4, runs=2, placement="steered", releases=("G",))
    opts = config_lib.build(RuntimeOptions, {"runtime": "flower", "nodes": 2, "client_cpus": 1.0})
    flower = audit_lib.audit(FEDREP, cfg, 4, runs=2, placement="steered", releases=("G",), flower=opts)
    assert flower["runtime"] == "flower"
    assert flower["gaussian_score"]["mu"] == pytest.approx(local["gaussian_score"]["mu"], rel=1e-5, abs=1e-6)
    assert _bounds(flower) == pytest.approx(_bounds(local), abs=1e-9)
