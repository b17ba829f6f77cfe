"""Exponential mechanism (docs/algorithms.md §1, Algorithm 4): sampling law, score sensitivity, net, memory refusal, baselines."""

import math

import pytest
import torch
from scipy import stats

from fedpers import config
from fedpers.commands.cli import main
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.expmech import ExpMechConfig, make_protocol
from fedpers.privacy import Privatizer, PureDpEvent
from fedpers.protocols.expmech import (
    constrained_least_squares_loss,
    constrained_solution,
    random_candidates,
    stiefel_net,
    user_scores,
)
from fedpers.runner import execute

EXP = EXPERIMENTS["expmech"]


def build(**values) -> ExpMechConfig:
    return config.build(ExpMechConfig, values)


def tiny_protocol(users: int = 40, candidates: int = 6, **extra):
    cfg = build(
        n_users=users, dim=3, rank=1, samples_per_user=8, candidates="random", num_candidates=candidates, **extra
    )
    proto = make_protocol(cfg)
    return cfg, proto, EXP.units(cfg, torch.arange(users))


def test_sampling_frequencies_follow_the_exponential_mechanism():
    # A handful of candidates, scores from real users; ε chosen so the law is far from a point mass.
    cfg, proto, units = tiny_protocol()
    state = proto.initial_state()
    summed = proto.client_update(0, proto.broadcast(state, 0), units)
    scores = summed.stats["scores"].double()
    spread = float(scores.max() - scores.min())
    assert spread > 0
    epsilon = 3.0 * 2 * proto.sensitivity / spread  # exponent range ≈ 3
    proto = make_protocol(
        build(n_users=40, dim=3, rank=1, samples_per_user=8, candidates="random", num_candidates=6, epsilon=epsilon)
    )
    expected = torch.softmax(-epsilon * scores / (2 * proto.sensitivity), 0)
    assert float(expected.max()) < 0.9 and float(expected.min()) > 0.005
    privatizer = Privatizer(123)
    draws = 20000
    counts = torch.zeros(len(scores))
    for _ in range(draws):
        new_state, _ = proto.server_update(0, state, summed, privatizer)
        counts[int(new_state["index"])] += 1
    chi2 = stats.chisquare(counts.numpy(), (expected * draws).numpy())
    assert chi2.pvalue > 1e-3, (counts, expected * draws)
    assert len(privatizer.ledger) == draws and all(isinstance(r.event, PureDpEvent) for r in privatizer.ledger)
    assert privatizer.ledger.releases[0].sensitivity == pytest.approx(proto.sensitivity)


def test_score_change_of_a_worst_case_neighbour_is_within_4_xi_Lf_C():
    cfg, proto, units = tiny_protocol(users=30, candidates=50)
    cands = proto.initial_state()["candidates"]
    base = proto.client_update(0, {"candidates": cands}, units).stats["scores"]
    g = torch.Generator().manual_seed(5)
    worst = 0.0
    replacements = [
        (torch.zeros(8, 3), torch.zeros(8)),
        (1e6 * torch.ones(8, 3), 1e6 * torch.ones(8)),
        (1e6 * torch.ones(8, 3), -1e6 * torch.ones(8)),
    ] + [
        (torch.randn(8, 3, generator=g) * s, torch.randn(8, generator=g) * t)
        for s in (0.1, 1, 10, 100)
        for t in (0, 1, 10, 1e4)
        for _ in range(5)
    ]
    for x_new, y_new in replacements:
        for j in (0, 17):
            neighbour = {k: v.clone() for k, v in units.items()}
            neighbour["x"][j], neighbour["y"][j] = x_new.double(), y_new.double()
            other = proto.client_update(0, {"candidates": cands}, neighbour).stats["scores"]
            worst = max(worst, float((other - base).abs().max()))
    assert worst <= proto.sensitivity
    assert worst <= proto.max_loss  # each user's term is a mean of clipped squared losses
    assert worst > 0.05 * proto.max_loss  # the adversarial users did move the score


def test_constrained_least_squares_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for k in (1, 2):
        F = torch.randn(40, 8, k, generator=g, dtype=torch.float64)
        y = 3 * torch.randn(40, 8, generator=g, dtype=torch.float64)
        gram, b = F.transpose(1, 2) @ F / 8, (F.transpose(1, 2) @ y.unsqueeze(-1)).squeeze(-1) / 8
        c = (y * y).mean(1)
        loss = constrained_least_squares_loss(gram, b, c, 1.0)
        v = constrained_solution(gram, b, 1.0)
        assert float(torch.linalg.vector_norm(v, dim=-1).max()) <= 1 + 1e-12
        at_v = ((F @ v.unsqueeze(-1)).squeeze(-1) - y).pow(2).mean(1)
        assert torch.allclose(at_v, loss, atol=1e-10)
        V = torch.randn(100000, k, generator=g, dtype=torch.float64)
        V = (
            V
            / torch.linalg.vector_norm(V, dim=1, keepdim=True)
            * torch.rand(100000, 1, generator=g, dtype=torch.float64) ** (1 / k)
        )
        sampled = ((F @ V.T - y.unsqueeze(-1)) ** 2).mean(1).min(-1).values
        assert bool((loss <= sampled + 1e-9).all())
        assert float((sampled - loss).max()) < 0.05 * float(sampled.mean())


def test_k1_closed_form_equals_the_general_solver():
    g = torch.Generator().manual_seed(1)
    x, y = (
        2 * torch.randn(30, 8, 3, generator=g, dtype=torch.float64),
        3 * torch.randn(30, 8, generator=g, dtype=torch.float64),
    )
    cands = random_candidates(3, 1, 20, 0)
    fast = user_scores(cands, x, y, 2.0, 2.0, 2.0)
    f = torch.einsum("uhd,qdk->uqhk", x, cands)
    f = f * torch.clamp(2.0 / torch.linalg.vector_norm(f, dim=-1, keepdim=True), max=1.0)
    yc = y.clamp(-2, 2)
    gram, b = torch.einsum("uqhk,uqhl->uqkl", f, f) / 8, torch.einsum("uqhk,uh->uqk", f, yc) / 8
    general = constrained_least_squares_loss(gram, b, (yc * yc).mean(1, keepdim=True), 2.0)
    assert torch.allclose(fast, general, atol=1e-12)


@pytest.mark.parametrize("dim,rank,width", [(3, 1, 0.2), (3, 2, 0.8)])
def test_net_covers_the_orthonormal_matrices(dim, rank, width):
    net = stiefel_net(dim, rank, width)
    assert torch.allclose(
        net.transpose(1, 2) @ net, torch.eye(rank, dtype=net.dtype).expand(len(net), rank, rank), atol=1e-10
    )
    probes = random_candidates(dim, rank, 3000, 7)
    dist = torch.cdist(probes.reshape(len(probes), -1), net.reshape(len(net), -1)).min(1).values
    assert float(dist.max()) <= width


def test_runs_that_would_not_fit_are_refused_with_the_memory_they_need(capsys, monkeypatch):
    from fedpers import memory

    # 16 GiB free, declared: 10⁹ random candidates (160 GB) would fit a larger host, and run there
    monkeypatch.setattr(memory, "available_bytes", lambda: 16 * 2**30)
    with pytest.raises(ValueError, match=r"needs about .*GiB.*candidates"):
        make_protocol(build(dim=10, rank=2, candidates="random", num_candidates=10**9))
    with pytest.raises(ValueError, match="grid points to enumerate"):
        make_protocol(build(dim=8, rank=2, candidates="net", net_width=0.1))
    with pytest.raises(ValueError, match=r"needs about .* but 1\.0 MiB is available"):
        make_protocol(build(n_users=100, memory_limit_gb=2**-10))
    assert (
        main(
            [
                "run",
                "expmech",
                "--n-users",
                "100",
                "--candidates",
                "random",
                "--num-candidates",
                "1000000000",
                "--quiet",
                "--out",
                "/tmp/never",
            ]
        )
        == 2
    )
    assert "needs about" in capsys.readouterr().err


def test_cli_prints_candidates_and_memory_before_the_run(tmp_path, capsys):
    assert (
        main(["run", "expmech", "--n-users", "200", "--net-width", "0.5", "--quiet", "--out", str(tmp_path / "r")]) == 0
    )
    err = capsys.readouterr().err
    assert "candidates (φ-net of width 0.5" in err and "memory needed about" in err


def test_expmech_and_altmin_compare_on_one_problem():
    shared = dict(n_users=2000, dim=3, rank=1, samples_per_user=16, noise_std=0.1, seed=3)
    em = execute(EXP, build(epsilon=math.inf, net_width=0.3, **shared), write=False, progress=False)
    am = execute(
        EXPERIMENTS["altmin"], config.build(EXPERIMENTS["altmin"].config_type, shared), write=False, progress=False
    )
    for name in ("nonprivate_altmin", "local_only", "oracle"):
        assert em["baselines"][name] == am["baselines"][name]
    assert set(em) >= {"subspace_error", "excess_risk", "test_mse", "epsilon", "delta"}
    # ε = ∞ selects the best-scoring candidate: as good as the net's resolution allows.
    assert em["subspace_error"] <= 0.3
    assert em["epsilon"] == math.inf and em["privacy"]["delta"] == 0.0
