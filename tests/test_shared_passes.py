"""Baselines in the private run's own passes: the same values as computed on their own, fewer passes."""

from __future__ import annotations

import pytest
import torch

from fedpers import config
from fedpers.data import synthetic
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments import altmin as am
from fedpers.experiments.altmin import evaluation as altmin_evaluation
from fedpers.experiments.common import lowrank_baselines as altmin_baselines
from fedpers.privacy import Privatizer
from fedpers.runner import execute
from fedpers.runtime.local import run_local

EXP = EXPERIMENTS["altmin"]


def run(values: dict) -> dict:
    return execute(EXP, config.build(EXP.config_type, values), write=False, progress=False)


@pytest.mark.parametrize(
    "values",
    [
        dict(n_users=1500, dim=6, rank=2, samples_per_user=8, dtype="float64", seed=3),
        dict(n_users=1500, dim=6, rank=2, samples_per_user=8, dtype="float32", cohorts="all", seed=4),
    ],
)
def test_baselines_in_shared_passes_equal_the_baselines_computed_on_their_own(monkeypatch, values):
    """Every baseline, float64 and float32: clipped-no-noise read in the private run's passes (and the
    non-private AltMin started from it) equals the separate clipped run's, bit for bit."""
    shared = run(values)
    monkeypatch.setattr(am.AltMinEvaluator, "companions", lambda self: [])
    alone = run(values)
    assert set(shared["baselines"]) == set(am.BASELINES)
    assert shared["baselines"] == alone["baselines"]
    assert shared["subspace_error"] == alone["subspace_error"]  # the private run is untouched


def test_the_shadow_run_is_the_clipped_run_and_a_resumed_one_is_refused():
    """ShadowRun's U is run_local's on the clipped protocol (same chunks, same order); a shadow that
    did not see round 0 is not complete, so the evaluator computes the baseline on its own."""
    from fedpers.experiments.common.shared_passes import ShadowRun

    cfg = am.resolve(
        config.build(EXP.config_type, dict(n_users=2000, dim=6, rank=2, samples_per_user=8, chunk_size=300))
    )
    plan = am.resolve_plan(cfg)
    ev = am.AltMinEvaluator(plan, plan.protocol())
    shadow = ev.companions()[0]
    assert isinstance(shadow, ShadowRun)
    run_local(ev.protocol, EXP.unit_source(cfg), Privatizer(1), chunk_size=300, progress=False, companions=[shadow])
    alone, _ = run_local(ev.clipped_protocol(), ev.source, Privatizer(0), chunk_size=300, progress=False)
    assert shadow.complete and torch.equal(shadow.state["U"], alone["U"])
    late = ShadowRun(ev.clipped_protocol(), Privatizer(0))
    late_rounds: list = []
    run_local(
        ev.protocol,
        EXP.unit_source(cfg),
        Privatizer(1),
        chunk_size=300,
        progress=False,
        companions=[_From(1, late, late_rounds)],
    )
    assert "round 1 began before round 0" in late.error and not late.complete


class _From:
    """Hands a companion only the rounds from ``first`` on (what a resumed run's companion sees)."""

    def __init__(self, first, inner, seen):
        self.first, self.inner, self.seen, self.error = first, inner, seen, ""

    def start_round(self, round, broadcast):
        if round >= self.first:
            try:
                self.inner.start_round(round, broadcast)
            except RuntimeError as e:
                self.inner.error = str(e)
                raise

    def chunk(self, round, units, message):
        if round >= self.first:
            self.inner.chunk(round, units, message)

    def end_round(self, round):
        if round >= self.first:
            self.inner.end_round(round)


def test_a_failing_companion_leaves_the_private_run_as_it_is():
    from fedpers.runtime.local import Companion

    class Broken(Companion):
        def start_round(self, round, broadcast):
            pass

        def chunk(self, round, units, message):
            raise MemoryError("no room")

        def end_round(self, round):
            pass

    cfg = am.resolve(config.build(EXP.config_type, dict(n_users=1500, dim=6, rank=2, samples_per_user=8)))
    proto = am.make_protocol(cfg)
    broken = Broken()
    with_it, _ = run_local(proto, EXP.unit_source(cfg), Privatizer(5), progress=False, companions=[broken])
    without, _ = run_local(proto, EXP.unit_source(cfg), Privatizer(5), progress=False)
    assert torch.equal(with_it["U"], without["U"]) and broken.error == "MemoryError: no room"


def test_a_default_run_reads_the_users_one_and_a_half_times_plus_the_reference_rounds(monkeypatch):
    """The bound: a default float32 run (every baseline, disjoint block cohorts) generates 1.5 + R passes
    over the users: the private run's 1 (½ init + ½ over the cohort rounds, clipped-no-noise riding
    along), one per round R of the non-private AltMin (R ≤ 6 here; every other fit, local-only's
    included, is scored in its first), and ½ for scoring the reference's own fit (the second half
    of the samples). Computed on their own the baselines took 1 (clipped-no-noise) + 1 (the
    reference's spectral pass) + 1 (an evaluation pass of its own) − ½ more."""
    rounds: list[int] = []
    original = altmin_baselines.nonprivate_altmin

    def counted(*args, **kw):
        out = original(*args, **kw)
        rounds.append(out[1])
        return out

    monkeypatch.setattr(altmin_evaluation, "nonprivate_altmin", counted)  # where AltMin's evaluator calls it
    values = dict(n_users=8192, dim=6, rank=2, samples_per_user=8, rounds=2, dtype="float32", cohort_block=1024)
    synthetic.reset_counts()
    result = run(values)
    assert set(result["baselines"]) == set(am.BASELINES) and len(rounds) == 1
    assert 2 <= rounds[0] <= 6
    assert synthetic.passes(8192) == pytest.approx(1.0 + rounds[0] + 0.5)


def test_the_warm_started_reference_is_todays_within_its_statistical_error(monkeypatch, statistical_errors):
    """Started from clipped-no-noise and stopped at half its statistical error, the non-private AltMin
    is, within its own standard error (the last round's), the reference the earlier rule (a twentieth
    of it) stopped at, the one it reaches from its own spectral pass and a 12-round one, in no more
    rounds than either rule from the spectral start (float32 users; tests/test_baselines.py holds
    the rule in both dtypes)."""
    from fedpers.metrics import subspace_error

    values = dict(n_users=4000, dim=20, rank=3, samples_per_user=12, seed=4, dtype="float32")
    cfg = am.resolve(config.build(EXP.config_type, values))
    plan = am.resolve_plan(cfg)
    ev = am.AltMinEvaluator(plan, plan.protocol())
    clipped, _ = run_local(ev.clipped_protocol(), ev.source, Privatizer(0), chunk_size=cfg.chunk_size, progress=False)
    u_star = plan.u_star.double()
    warm, warm_rounds = altmin_baselines.nonprivate_altmin(ev.source, cfg.rank, cfg.chunk_size, start=clipped["U"])
    se = statistical_errors[-1]
    spectral, spectral_rounds = altmin_baselines.nonprivate_altmin(ev.source, cfg.rank, cfg.chunk_size)
    monkeypatch.setattr(altmin_baselines, "PRECISION", 0.05)
    before, before_rounds = altmin_baselines.nonprivate_altmin(ev.source, cfg.rank, cfg.chunk_size, start=clipped["U"])
    _, spectral_before_rounds = altmin_baselines.nonprivate_altmin(ev.source, cfg.rank, cfg.chunk_size)
    monkeypatch.setattr(altmin_baselines, "TOLERANCE", 0.0)
    monkeypatch.setattr(altmin_baselines, "PRECISION", 0.0)
    monkeypatch.setattr(altmin_baselines, "MAX_ROUNDS", 12)
    U_12, rounds_12 = altmin_baselines.nonprivate_altmin(ev.source, cfg.rank, cfg.chunk_size)
    assert rounds_12 == 12 and warm_rounds <= min(spectral_rounds, before_rounds) < spectral_before_rounds
    err_12 = subspace_error(U_12, u_star)
    for U in (before, spectral, U_12):
        assert float((warm @ warm.T - U @ U.T).norm()) <= se
    assert abs(subspace_error(warm, u_star) - err_12) <= 0.05 * err_12


FEDREP = EXPERIMENTS["fedrep"]


def run_fedrep(values: dict) -> dict:
    return execute(FEDREP, config.build(FEDREP.config_type, values), write=False, progress=False)


@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=pytest.mark.slow)])
def test_fedrep_baselines_in_shared_passes_equal_the_baselines_computed_on_their_own(monkeypatch, dtype):
    """FedRep's Priv-AltMin (its rounds in FedRep's rounds, on FedRep's chunks) and the non-private
    reference (its spectral pass and first rounds in FedRep's rounds) equal the separate runs'
    (several chunks a pass, float64 and float32): the reference bit for bit, Priv-AltMin's sums
    chunked otherwise (a cohort's users out of every chunk) to float rounding, same ε."""
    from fedpers.experiments import fedrep

    values = dict(
        n_users=900, dim=6, rank=2, samples_per_user=5, rounds=2, chunk_size=450, dtype=dtype, seed=2, accountant="rdp"
    )
    shared = run_fedrep(values)
    monkeypatch.setattr(fedrep.FedRepEvaluator, "companions", lambda self: [])
    alone = run_fedrep(values)
    assert set(shared["baselines"]) == set(alone["baselines"]) >= {"priv_altmin", "nonprivate_altmin"}
    assert shared["baselines"]["nonprivate_altmin"] == alone["baselines"]["nonprivate_altmin"]
    tol = 1e-9 if dtype == "float64" else 1e-4
    for key, value in alone["baselines"]["priv_altmin"].items():
        assert shared["baselines"]["priv_altmin"][key] == (
            pytest.approx(value, rel=tol) if isinstance(value, float) else value
        )
    assert shared["subspace_error"] == alone["subspace_error"]  # the private run is untouched


def test_a_default_fedrep_run_reads_the_training_users_once_a_round_plus_the_references_extra_rounds(monkeypatch):
    """The bound: with every baseline (``--cohorts all``) the training users are read T + 1 times by
    the run (Priv-AltMin's T + 1 rounds and the reference's first T + 1 passes riding along) and
    max(0, R − T) times by the reference alone (R rounds after its spectral pass); on their own the
    baselines read them (T + 1) + (R + 1) times more."""
    from fedpers.experiments.fedrep import experiment as fedrep_experiment
    from fedpers.experiments.fedrep import plan as fedrep_plan

    loads: list[int] = []
    original = fedrep_plan.load_all

    def counted(cfg, ids, test=True):
        if not test:
            loads.append(int(ids.numel()))
        return original(cfg, ids, test)

    monkeypatch.setattr(fedrep_plan, "load_all", counted)  # the source's chunks
    monkeypatch.setattr(fedrep_experiment, "load_all", counted)  # a node's units
    n, T = 1000, 2
    result = run_fedrep(
        dict(n_users=n, dim=8, rank=2, samples_per_user=5, rounds=T, chunk_size=500, seed=1, accountant="rdp")
    )
    R = result["baselines"]["nonprivate_altmin"]["rounds"]
    assert R >= 2 and "epsilon" in result["baselines"]["priv_altmin"]
    assert sum(loads) == n * ((T + 1) + max(0, R - T))
