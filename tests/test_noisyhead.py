"""NoisyHead (docs/algorithms.md §2): math, sensitivity, privacy calibration, protocol modes, user level, sweeps, CLI."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedpers import config as config_lib
from fedpers.commands.cli import main
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.noisyhead import NoisyHeadConfig, make_protocol, resolve, sherman_morrison_replace, sweep
from fedpers.experiments.noisyhead import montecarlo as mc
from fedpers.privacy import Privatizer
from fedpers.protocols import noisyhead as nh
from fedpers.protocols.base import Message, verify_message
from fedpers.runner import execute

EXP = EXPERIMENTS["noisyhead"]


PAPER = {"regime": "low-dim", "calibration": "paper", "dim": 5, "prompts": 1000}
"""The §6.1 low-dimensional setting with the paper's calibration (the defaults are the demo task)."""


def build(**values) -> NoisyHeadConfig:
    return config_lib.build(NoisyHeadConfig, {**PAPER, **values})


def small_protocol(**over) -> nh.NoisyHeadProtocol:
    base = dict(
        prompts=50,
        dim=3,
        context=8,
        steps=4,
        step_size=0.05,
        ridge_lambda=0.5,
        clip_c=2.0,
        proj_g=0.6,
        proj_r=3.0,
        noise_multiplier=0.0,
    )
    return nh.NoisyHeadProtocol(**{**base, **over})


def prompt_units(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"ids": torch.arange(x.shape[0]), "x": x.unsqueeze(1), "y": y.unsqueeze(1)}


def random_prompts(
    n: int, L: int, D: int, seed: int = 0, label_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, L + 1, D, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True)
    y = label_scale * torch.randn(n, L + 1, generator=g, dtype=torch.float64)
    return x, y


# ----- the math ------------------------------------------------------------------------------------
def test_theorem41_constants_follow_eq_4_1():
    N, L, D, tau, kappa, lam = 1000, 31, 5, 0.5, 0.1, 5.0
    c = nh.theorem41_constants(N, L, D, tau, kappa, lam)
    nu = 1 + tau**2
    C = math.sqrt(2 * nu * math.log(N * L / kappa))
    assert c.nu == pytest.approx(nu)
    assert c.C == pytest.approx(C)
    assert c.G == pytest.approx(C / math.sqrt(L) * (1 + math.sqrt(math.log(N / kappa)) / D))
    assert c.G0 == pytest.approx(C / math.sqrt(L) * (1 + math.sqrt(math.log(1 / kappa)) / D))
    assert c.R == pytest.approx(C**2 * math.sqrt(N / L) * (1 + math.sqrt(math.log(1 / kappa)) / D) / lam)
    assert c.sigma == pytest.approx(2 * c.G * (c.C + c.R * c.G))


def test_low_dim_regime_reproduces_section_6_1_rules():
    r = resolve(build(prompts=2000, dim=5))
    assert (r.L, r.lam) == (44, 5.0)
    assert r.eta == pytest.approx(3.17 / (5 + r.G**2) ** 2)
    assert r.T == math.ceil(math.log(2000**2.5) / -math.log(1 - r.lam * r.eta))
    h = resolve(build(prompts=900, dim=0, regime="high-dim"))
    assert (h.D, h.L, h.T) == (30, 30, 5)
    assert h.lam == pytest.approx(30.0) and h.eta == pytest.approx(0.07 * 900 * 30 / (900 + 30 * h.G**2) ** 2)
    e = resolve(build(prompts=1000, dim=0, regime="early-stopping", steps=7))
    assert e.eta == pytest.approx(0.02 * e.lam / (3 * (e.lam + e.G**2) ** 2)) and e.T == 7
    rb = resolve(build(prompts=5000, context=500, dim=5, regime="robustness"))
    assert (rb.lam, rb.T) == (0.01, math.ceil(math.log(5000)))
    assert rb.eta == pytest.approx(0.007 / (0.01 + rb.G**2) ** 2)


def test_prompt_vectors_match_the_definition_and_bounds():
    x, y = random_prompts(6, 7, 3, label_scale=5.0)
    C, G = 1.5, 0.4
    z, yq = nh.prompt_vectors(x, y, C, G)
    for k in range(6):
        xs, ys = x[k].numpy(), y[k].numpy()
        Z = np.outer(xs[-1], (np.clip(ys[:-1], -C, C)[:, None] * xs[:-1]).sum(0)) / 7
        Z = Z * min(1.0, G / np.linalg.norm(Z))
        np.testing.assert_allclose(nh.vec_to_gamma(z[k]).numpy(), Z, atol=1e-14)
        gamma = np.random.default_rng(k).standard_normal((3, 3))
        assert float(nh.gamma_to_vec(torch.tensor(gamma)) @ z[k]) == pytest.approx(float((gamma * Z).sum()))
        assert yq[k] == pytest.approx(np.clip(ys[-1], -C, C))
    assert bool((z.norm(dim=-1) <= G * (1 + 1e-12)).all())


def test_worst_case_neighbour_one_step_changes_the_update_by_at_most_the_sensitivity():
    """Replacing one prompt moves (η₀/N)·Σ gradient by ≤ (η₀/N)·2G(C + RG), in both modes."""
    D, L, N = 3, 6, 20
    proto = small_protocol(prompts=N, dim=D, context=L, clip_c=2.0, proj_g=0.5, proj_r=4.0)
    C, G, R = proto.clip_c, proto.proj_g, proto.proj_r
    bound = proto.step_size / N * 2 * G * (C + R * G)
    assert proto.step_sensitivity == pytest.approx(bound)
    x, y = random_prompts(N, L, D, seed=1)
    e1, e2 = torch.eye(D, dtype=torch.float64)[0], torch.eye(D, dtype=torch.float64)[1]
    # Adversarial pair: z̃ = G e1e1ᵀ with ỹ = −C against z̃' = G e2e1ᵀ with ỹ' = +C, Γ = R e1e1ᵀ.
    xa, ya = x.clone(), y.clone()
    xa[0], ya[0] = e1.expand(L + 1, D), torch.full((L + 1,), 1e6)
    ya[0, -1] = -1e6
    xb, yb = x.clone(), y.clone()
    xb[0] = e1.expand(L + 1, D)
    xb[0, -1] = e2
    yb[0] = torch.full((L + 1,), 1e6)
    gammas = [R * nh.gamma_to_vec(torch.outer(e1, e1))]
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        v = torch.randn(D * D, generator=g, dtype=torch.float64)
        gammas.append(R * v / v.norm())
    worst = 0.0
    for mode in nh.Mode:
        p = replace(proto, mode=mode)
        for gamma in gammas:
            grads = []
            for xs, ys in ((xa, ya), (xb, yb)):
                msg = p.client_update(0, {"gamma": gamma}, prompt_units(xs, ys))
                assert verify_message(msg, p.stat_specs(0), N, torch.float64).accepted
                grads.append(
                    msg.stats["A"] @ gamma - msg.stats["b"] if mode is nh.Mode.STATISTICS else msg.stats["grad"]
                )
            change = float((p.step_size / N) * (grads[0] - grads[1]).norm())
            assert change <= bound * (1 + 1e-12)
            worst = max(worst, change)
    # The construction reaches sqrt((RG + C)² + C²)·G ≥ half of the bound: the test is not vacuous.
    assert worst >= 0.5 * bound


def test_one_step_noise_is_spec_z_t():
    """Paper calibration: Var z_t = 2η₀²T²σ² log(1.25T/δ)/(ε²N²) with σ = 2G(C + RG), per entry."""
    cfg = build(prompts=600, dim=4, epsilon=0.7, delta=1e-5, steps=9)
    r, proto = resolve(cfg), make_protocol(cfg)
    sigma = 2 * r.G * (r.C + r.R * r.G)
    spec_var = 2 * r.eta**2 * r.T**2 * sigma**2 * math.log(1.25 * r.T / cfg.delta) / (cfg.epsilon**2 * r.N**2)
    assert proto.noise_std_step**2 == pytest.approx(spec_var, rel=1e-12)
    # Empirically: 4000 seeds of one step from Γ⁰ = 0 with zero statistics, far inside the R-ball.
    p = replace(proto, steps=1, proj_r=1e9)
    zero = Message({"A": torch.zeros(16, 16, dtype=torch.float64), "b": torch.zeros(16, dtype=torch.float64)}, 600)
    draws = torch.stack([p.server_update(0, p.initial_state(), zero, Privatizer(s))[0]["gamma"] for s in range(4000)])
    rel = float(draws.std() / p.noise_std_step)
    assert abs(rel - 1) < 0.04  # 64 000 draws: the std's relative s.e. is 0.3%
    assert abs(float(draws.mean())) < 5 * p.noise_std_step / math.sqrt(draws.numel())


def test_ridge_with_matched_lambda_is_the_limit_of_noise_free_gd():
    x, y = random_prompts(200, 10, 3, seed=5)
    z, yq = nh.prompt_vectors(x, y)
    A, b = nh.gram_statistics(z, yq)
    lam, eta = 0.05, 0.5
    gd = nh.gd(A, b, torch.zeros(9, dtype=torch.float64), 200, lam, eta, 20000)
    matched = nh.ridge(A, b, 200, lam, nh.RidgeScaling.MATCHED)
    paper = nh.ridge(A, b, 200, lam, nh.RidgeScaling.PAPER)
    assert float((gd - matched).norm()) <= 1e-6 * float(matched.norm())
    assert float((gd - paper).norm()) >= 1e-2 * float(paper.norm())  # (2.7)'s λN is not GD's minimiser


def test_sherman_morrison_replace_matches_a_direct_solve():
    g = torch.Generator().manual_seed(0)
    B = torch.randn(4, 6, 6, generator=g, dtype=torch.float64)
    M = B @ B.transpose(1, 2) + 3 * torch.eye(6, dtype=torch.float64)
    rhs, zn, yn = (
        torch.randn(4, 6, generator=g, dtype=torch.float64),
        torch.randn(4, 6, generator=g, dtype=torch.float64),
        torch.randn(4, generator=g, dtype=torch.float64),
    )
    direct = torch.linalg.solve(M + zn.unsqueeze(-1) * zn.unsqueeze(-2), rhs + yn.unsqueeze(-1) * zn)
    assert torch.allclose(sherman_morrison_replace(M, rhs, zn, yn), direct, atol=1e-12)


# ----- the protocol under the runtime -------------------------------------------------------------
@pytest.mark.parametrize("extra", [{}, {"unit": "user", "prompts_per_user": 4, "user_clip": 0.2}])
@pytest.mark.parametrize("epsilon", ["inf", 5.0])
def test_rounds_and_statistics_modes_give_the_same_gamma(extra, epsilon):
    results = {}
    for mode in ("statistics", "rounds"):
        cfg = build(
            prompts=240, dim=3, steps=12, epsilon=epsilon, calibration="accountant", mode=mode, chunk_size=50, **extra
        )
        results[mode] = execute(EXP, cfg, write=False, progress=False)
    a, b = (torch.tensor(results[m]["Gamma"]) for m in ("statistics", "rounds"))
    assert float((a - b).abs().max()) <= 1e-6 * max(1.0, float(a.abs().max()))
    assert results["statistics"]["excess_risk"] == pytest.approx(results["rounds"]["excess_risk"], rel=1e-6, abs=1e-12)
    assert results["statistics"]["privacy"]["epsilon"] == results["rounds"]["privacy"]["epsilon"]


def test_user_level_clips_per_user_and_the_ledger_says_so():
    cfg = build(prompts=240, dim=3, steps=5, epsilon=2.0, unit="user", prompts_per_user=4, user_clip=0.05)
    r, proto = resolve(cfg), make_protocol(cfg)
    assert proto.grad_bound == pytest.approx(0.05 * 4 * r.G * (r.C + r.R * r.G))
    units = EXP.units(cfg, torch.arange(r.units))
    _, _, wa, wb = proto.features(units)
    assert float(wa.min()) < 1 and float(wb.min()) < 1  # ρ = 1/20: the per-user clip acts
    privatizer = Privatizer(0)
    from fedpers.runtime.local import run_local

    run_local(proto, units, privatizer, progress=False)
    assert len(privatizer.ledger) == r.T
    for rel in privatizer.ledger:
        assert rel.per_unit_bound == pytest.approx(proto.grad_bound)
        assert rel.sensitivity == pytest.approx(2 * proto.grad_bound)
    summary = EXP.privacy_summary(cfg, proto, privatizer.ledger)
    assert "user" in summary["neighbouring"] and summary["sensitivity"] == pytest.approx(2 * proto.grad_bound)
    with pytest.raises(ValueError, match="multiple of prompts_per_user"):
        build(prompts=241, unit="user", prompts_per_user=4)
    with pytest.raises(ValueError, match="only with --unit user"):
        build(prompts_per_user=4)


def test_server_drops_a_client_that_exceeds_its_declared_bound():
    proto = small_protocol(mode=nh.Mode.ROUNDS)
    x, y = random_prompts(50, 8, 3)
    gamma = torch.full((9,), 0.5, dtype=torch.float64)
    msg = proto.client_update(0, {"gamma": gamma}, prompt_units(x, y))
    specs = proto.stat_specs(0)
    assert verify_message(msg, specs, 50, torch.float64).accepted
    big = Message({"grad": msg.stats["grad"] / msg.stats["grad"].norm() * 51 * proto.grad_bound}, 50)
    assert not verify_message(big, specs, 50, torch.float64).accepted


def test_calibrations_paper_and_accountant():
    paper = execute(EXP, build(prompts=300, dim=3, steps=20, epsilon=1.0), write=False, progress=False)["privacy"]
    tight = execute(
        EXP, build(prompts=300, dim=3, steps=20, epsilon=1.0, calibration="accountant"), write=False, progress=False
    )["privacy"]
    assert paper["noise_multiplier"] == pytest.approx(nh.paper_noise_multiplier(20, 1.0, 1e-5))
    assert paper["paper_epsilon_same_noise"] == pytest.approx(1.0)
    assert paper["epsilon"] < 0.2  # the per-step composition is very loose: the PLD ε of the same noise
    assert 0.99 <= tight["epsilon"] <= 1.0
    assert tight["noise_multiplier"] < paper["noise_multiplier"] / 5
    assert paper["paper_over_accountant_noise"] == pytest.approx(paper["noise_multiplier"] / tight["noise_multiplier"])


def test_cli_run_writes_constants_with_formulas(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(
        [
            "run",
            "noisyhead",
            "--regime",
            "low-dim",
            "--prompts",
            "300",
            "--dim",
            "3",
            "--context",
            "9",
            "--steps",
            "6",
            "--epsilon",
            "2",
            "--mode",
            "rounds",
            "--init",
            "gaussian",
            "--seed",
            "3",
            "--out",
            str(out),
            "--json",
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "completed" and result["excess_risk"] >= 0
    assert {"nonprivate_gd", "ridge"} <= set(result["baselines"])
    constants = json.loads((out / "constants.json").read_text())
    assert constants["formulas"]["C"] == "C = sqrt(2ν log(NL/κ))" and constants["T"] == 6
    assert constants["C"] == pytest.approx(math.sqrt(2 * math.log(300 * 9)))
    assert len((out / "rounds.jsonl").read_text().splitlines()) == 6
    assert len(json.loads((out / "ledger.json").read_text())) == 6
    rc = main(
        [
            "run",
            "noisyhead",
            "--prompts",
            "300",
            "--clip-c",
            "1.5",
            "--proj-g",
            "0.3",
            "--proj-r",
            "2",
            "--step-size",
            "0.1",
            "--ridge-lambda",
            "0.5",
            "--label-noise",
            "0.2",
            "--steps",
            "3",
            "--out",
            str(tmp_path / "r2"),
            "--json",
        ]
    )
    assert rc == 0
    c2 = json.loads((tmp_path / "r2" / "constants.json").read_text())
    assert (c2["C"], c2["G"], c2["R"], c2["eta"], c2["lambda"]) == (1.5, 0.3, 2.0, 0.1, 0.5)
    assert c2["formulas"]["C"] == "C given"


# ----- Monte-Carlo sweeps ------------------------------------------------------------------------------
def test_batched_engine_is_the_protocol_arithmetic():
    """With one repetition, the batched direct engine and the protocol's server take the same steps and noise."""
    cfg = build(prompts=300, dim=3, epsilon=0.5, steps=7, init="gaussian")
    r = resolve(cfg)
    st = mc.statistics(cfg, 1, "direct")
    gamma0 = make_protocol(cfg).initial_gamma()
    batched = sweep.noisy_gd_direct(st.At, st.bt, gamma0, r, Privatizer(11))[0]
    proto = make_protocol(cfg)
    state, _ = proto.server_update(
        0, proto.initial_state(), Message({"A": st.At[0], "b": st.bt[0]}, 300), Privatizer(11)
    )
    assert torch.allclose(batched, state["gamma"], rtol=0, atol=1e-10)


def test_direct_and_spectral_engines_agree():
    rows = {}
    for engine in ("direct", "spectral"):
        rows[engine] = sweep.sweep_point(build(prompts=400, dim=3, epsilon="inf", steps=15, engine=engine), 4)
    for a, b in zip(rows["direct"], rows["spectral"]):
        for key in ("excess_risk", "gd_excess_risk", "test_mse", "ridge_test_mse", "gd_test_mse"):
            assert a[key] == pytest.approx(b[key], rel=1e-7, abs=1e-14), key
    # With noise the two engines draw it in different bases: equal in distribution only.
    noisy = {
        e: np.mean(
            [
                row["excess_risk"]
                for row in sweep.sweep_point(build(prompts=400, dim=3, epsilon=1.0, steps=15, engine=e), 200)
            ]
        )
        for e in ("direct", "spectral")
    }
    assert noisy["direct"] == pytest.approx(noisy["spectral"], rel=0.15)


def test_sweep_point_rows_and_privacy():
    cfg = build(prompts=500, dim=3, epsilon=0.5)
    rows = EXP.sweep_point(cfg, 6)
    assert len(rows) == 6
    assert len({row["excess_risk"] for row in rows}) == 6
    for row in rows:
        assert row["epsilon_spent"] < 0.5 and row["paper_epsilon"] == pytest.approx(0.5)
        assert row["excess_risk"] > 0 and math.isfinite(row["gd_test_mse"])
    again = EXP.sweep_point(cfg, 6)
    assert [row["excess_risk"] for row in again] == [row["excess_risk"] for row in rows]  # one seed reproduces
    other = EXP.sweep_point(replace(cfg, seed=1), 6)
    assert other[0]["excess_risk"] != rows[0]["excess_risk"]
    with pytest.raises(ValueError, match="engine=direct needs D"):
        sweep.sweep_point(build(prompts=400, dim=17, engine="direct"), 1)


def test_robustness_point_small():
    cfg = build(
        prompts=400, context=40, dim=3, regime="robustness", epsilon=0.5, delta=1e-2, attack_c=2.0, attack_p=2.0
    )
    rows = sweep.sweep_point(cfg, 5)
    for row in rows:
        assert row["robust_ridge"] > 10 * row["robust_noisyhead"]
        assert row["attack_alpha"] == pytest.approx(2 * 400**2)
    result = execute(EXP, cfg, write=False, progress=False)
    assert result["robust_ridge"] > 10 * result["robust_noisyhead"]


# ----- §7 text data ----------------------------------------------------------------------------------
def test_newsgroups_prompts_are_real_posts():
    pytest.importorskip("gensim")
    pytest.importorskip("sklearn")
    from fedpers.data import newsgroups

    bodies, groups = newsgroups.load_posts()
    assert len(bodies) == 200 and set(groups) == {"alt.atheism", "sci.space"}
    tokens = newsgroups.text_tokens(30, 0)
    assert set(tokens.train.tolist()).isdisjoint(tokens.test.tolist())
    assert torch.allclose(tokens.x[tokens.train].norm(dim=-1), torch.ones(len(tokens.train), dtype=torch.float64))
    assert abs(float(tokens.y[tokens.train].mean())) < 1e-9 and float(
        tokens.y[tokens.train].std(unbiased=False)
    ) == pytest.approx(1.0)
    x, y = newsgroups.text_prompts_by_id(0, 1, torch.tensor([3, 700, 4]), 30, 30)
    x2, _ = newsgroups.text_prompts_by_id(0, 1, torch.tensor([4]), 30, 30)
    assert x.shape == (3, 31, 30) and torch.equal(x[2], x2[0])
    rows = {tuple(v.tolist()) for v in x[0]}
    assert len(rows) == 31  # 31 distinct posts per prompt (TF-IDF vectors of distinct posts differ)
    xt, _ = newsgroups.text_prompts_by_id(0, 2, torch.arange(3), 30, 30, test=True)
    test_rows = {tuple(v.tolist()) for v in tokens.x[tokens.test]}
    assert all(tuple(v.tolist()) in test_rows for v in xt.reshape(-1, 30))
    result = execute(
        EXP,
        build(data="newsgroups", prompts=200, dim=30, context=30, regime="early-stopping", steps=10, test_prompts=50),
        write=False,
        progress=False,
    )
    assert result["status"] == "completed" and math.isfinite(result["excess_risk"])


# ----- the device code path (--kernels device; run here on CPU tensors) -----------------------------------
class _RecordingGenerator:
    """Stands in for torch.Generator: records the device each generator is made for (None: not given)."""

    made: list = []

    def __new__(cls, device=None):
        cls.made.append(device)
        return _REAL_GENERATOR(device=device if device is not None else "cpu")


_REAL_GENERATOR = torch.Generator


def _no_host_draws(monkeypatch):
    """Any host-side data generator raises; every torch.Generator made is recorded with its device."""
    from fedpers.data import prompts as prompt_data

    def refuse(*args, **kwargs):
        raise AssertionError("the device path called a host-side generator for data")

    monkeypatch.setattr(prompt_data, "generator", refuse)
    monkeypatch.setattr(mc, "_host_draws", refuse)
    _RecordingGenerator.made = []
    monkeypatch.setattr(torch, "Generator", _RecordingGenerator)
    return _RecordingGenerator.made


@pytest.mark.parametrize("extra", [{}, {"mode": "rounds"}, {"unit": "user", "prompts_per_user": 4, "user_clip": 0.5}])
def test_device_kernels_on_cpu_give_the_host_run(extra):
    """A run's device path draws prompt k on the device from the same (seed, k): on the CPU, the host run exactly."""
    results = {
        k: execute(EXP, build(prompts=400, dim=3, epsilon=1.0, kernels=k, **extra), write=False, progress=False)
        for k in ("host", "device")
    }
    for key in ("excess_risk", "test_mse", "gamma_norm"):
        assert results["device"][key] == pytest.approx(results["host"][key], rel=1e-9, abs=1e-12), key
    assert results["device"]["baselines"]["nonprivate_gd"]["excess_risk"] == pytest.approx(
        results["host"]["baselines"]["nonprivate_gd"]["excess_risk"], rel=1e-9, abs=1e-14
    )


def test_device_run_draws_no_host_data(monkeypatch):
    made = _no_host_draws(monkeypatch)
    result = execute(EXP, build(prompts=300, dim=3, epsilon=1.0, kernels="device"), write=False, progress=False)
    assert math.isfinite(result["excess_risk"])
    assert made and all(d is not None for d in made)  # every generator names its device (the DP noise's: the CPU)


def test_device_sweep_is_the_same_for_any_chunking_and_prefix(monkeypatch):
    """Repetition i's data set depends on (seed, i) alone on the device path."""
    cfg = build(prompts=300, dim=3, epsilon=0.5, kernels="device")
    mc._CACHE.clear()
    whole = mc.statistics(cfg, 20, "direct")
    monkeypatch.setattr(mc, "CHUNK_ELEMENTS", 1)  # one block of REP_BLOCK repetitions per chunk
    mc._CACHE.clear()
    chunked = mc.statistics(cfg, 20, "direct")
    mc._CACHE.clear()
    prefix = mc.statistics(cfg, 11, "direct")
    mc._CACHE.clear()
    for name in ("At", "bt", "A", "gstar", "S", "x_att"):
        assert torch.equal(getattr(whole, name), getattr(chunked, name)), name
        assert torch.equal(getattr(whole, name)[:11], getattr(prefix, name)), name
    assert len({float(v) for v in whole.bt[:, 0]}) == 20  # 20 different data sets


def test_device_sweep_is_the_host_arithmetic_on_the_same_data(monkeypatch):
    """Given the device path's data sets, the host path computes the same rows (both engines)."""
    for engine in ("direct", "spectral"):
        cfg = build(prompts=300, dim=3, epsilon=0.5, engine=engine, init="gaussian")
        mc._CACHE.clear()
        device_rows = sweep.sweep_point(replace(cfg, kernels="device"), 10)
        r = resolve(sweep.split_seed(cfg)[0])
        draws = mc._device_draws(sweep.split_seed(cfg)[0], r, 0, 10, torch.device("cpu"))
        monkeypatch.setattr(mc, "_host_draws", lambda *a, **k: draws)
        mc._CACHE.clear()
        host_rows = sweep.sweep_point(replace(cfg, kernels="host"), 10)
        mc._CACHE.clear()
        monkeypatch.undo()
        for a, b in zip(host_rows, device_rows):
            for key in ("excess_risk", "gd_excess_risk", "test_mse", "ridge_test_mse", "epsilon_spent"):
                assert b[key] == pytest.approx(a[key], rel=1e-9, abs=1e-14), (engine, key)


def test_device_sweep_draws_no_host_data_and_matches_the_host_in_distribution(monkeypatch):
    """Other data sets than the host path's (documented), the same distribution: mean risks within 4 s.e."""
    cfg = build(prompts=400, dim=3, epsilon=1.0, steps=15)
    mc._CACHE.clear()
    host = np.array([row["excess_risk"] for row in sweep.sweep_point(cfg, 200)])
    made = _no_host_draws(monkeypatch)
    mc._CACHE.clear()
    device = np.array([row["excess_risk"] for row in sweep.sweep_point(replace(cfg, kernels="device"), 200)])
    mc._CACHE.clear()
    assert made and all(d is not None for d in made)
    assert not np.allclose(host[:5], device[:5])  # the device path draws its own data sets
    se = math.sqrt(host.var() / host.size + device.var() / device.size)
    assert abs(host.mean() - device.mean()) < 4 * se


@pytest.mark.parametrize(
    ("values", "field_name"),
    [({"device": "tpu"}, "device"), ({"kernels": "gpu"}, "kernels"), ({"device": "cuda:x"}, "device")],
)
def test_bad_device_or_kernels_is_refused_naming_the_field(values, field_name):
    with pytest.raises(ValueError, match=field_name):
        build(prompts=100, **values)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' but no CUDA device"):
            build(prompts=100, device="cuda")


def test_lowdim_sweep_file_accepts_device_and_kernels(tmp_path):
    """`fedpers sweep simulations/noisyhead_lowdim.toml` with device/kernels in [base] runs the device path."""
    import tomllib
    from pathlib import Path

    spec = tomllib.loads((Path(__file__).resolve().parent.parent / "simulations" / "noisyhead_lowdim.toml").read_text())
    text = (
        'name = "lowdim_device"\nalgorithm = "noisyhead"\nrepetitions = 3\nx = "prompts"\nseries = "epsilon"\n'
        'metrics = ["excess_risk"]\n[base]\n'
        + "".join(f"{k} = {v!r}\n" if not isinstance(v, str) else f'{k} = "{v}"\n' for k, v in spec["base"].items())
        + 'device = "cpu"\nkernels = "device"\n[grid]\nprompts = [400]\nepsilon = [1.0]\n'
    )
    (tmp_path / "s.toml").write_text(text)
    assert main(["sweep", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out")]) in (0, None)
    mc._CACHE.clear()
    lines = (tmp_path / "out" / "table.csv").read_text().splitlines()
    assert len(lines) == 1 + 3
    assert json.loads((tmp_path / "out" / "spec.json").read_text())["base"]["kernels"] == "device"
