"""Private FedRep: sensitivity under worst-case neighbours, scale-safe clipping, accounting,
non-private recovery of U*, and local = Flower for one seed."""

from __future__ import annotations

import math

import pytest
import torch

from fedpers import config
from fedpers.app import make_client_app
from fedpers.experiments import EXPERIMENTS
from fedpers.privacy import ALL_UNITS, event_epsilon
from fedpers.protocols.fedrep import FedRepProtocol
from fedpers.runner import Runtime, RuntimeOptions, execute
from fedpers.runtime.local import run_local
from tests.flower_support import InProcessGrid
from tests.neighbours import TapPrivatizer, adversaries, check_neighbour
from tests.small_runs import FEDREP_SMALL

EXP = EXPERIMENTS["fedrep"]
SMALL = {**FEDREP_SMALL, "rounds": 2}


def setup(values: dict):
    cfg = config.build(EXP.config_type, values)
    protocol = EXP.protocol(cfg)
    units = EXP.units(cfg, torch.arange(cfg.n_users))
    return cfg, protocol, {k: v.clone() for k, v in units.items()}


def first_round_U(protocol, units) -> torch.Tensor:
    states = []
    run_local(
        protocol, units, TapPrivatizer(3), chunk_size=7, progress=False, on_round=lambda rec, st: states.append(st)
    )
    return states[0]["U"][:, 0]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fedrep_worst_case_neighbours(dtype):
    """Replacing one user by huge x, huge y, zero x, x aligned with U, ... moves the init and
    every gradient release by at most its recorded sensitivity, and the run completes."""
    cfg, protocol, units = setup({**SMALL, "dtype": dtype})
    aligned = first_round_U(protocol, units)
    tol = 1e-5 if dtype == "float32" else 1e-9
    largest = 0.0
    for j in (0, 23):
        for label, new in adversaries(units["x"][j], units["y"][j], getattr(torch, dtype), aligned).items():
            outcome = check_neighbour(protocol, units, j, new, {ALL_UNITS}, rel_tol=tol)
            assert outcome.releases == 1 + cfg.rounds, label
            largest = max([largest] + [c / r.sensitivity for r, c in outcome.changes if r.name.endswith(".G")])
    assert largest > 0.25  # the adversaries push a gradient release a good part of its sensitivity 2C


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clipped_gradient_is_bounded_and_exact_below_the_clip(dtype):
    proto = FedRepProtocol(
        n_users=4,
        dim=5,
        rank=2,
        samples_per_user=4,
        rounds=1,
        clip=3.0,
        zeta=2.0,
        learning_rate=1.0,
        noise_multiplier=0.0,
    )
    g = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(5, 2, generator=g, dtype=torch.float64))[0].to(dtype)
    x = torch.randn(4, 4, 5, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(4, 4, generator=g, dtype=torch.float64).to(dtype)
    huge = 1e30 if dtype == torch.float32 else 1e300
    x[1] *= huge
    y[2] *= huge
    x[3] = 0
    G = proto.clipped_gradients(U, x, y)
    assert bool(torch.isfinite(G).all())
    norms = torch.linalg.matrix_norm(G.double())
    assert bool((norms <= 3.0 * (1 + 1e-5)).all()) and float(norms[3]) == 0.0
    assert float(norms[2]) == pytest.approx(3.0, rel=1e-4)  # huge y: a huge gradient, clipped to exactly C
    # huge x: v_j shrinks by the same factor, so G_j = (2/m) Σ x r vᵀ is that of the unscaled user
    unscaled = proto.clipped_gradients(U, x[1:2] / huge, y[1:2])
    torch.testing.assert_close(G[1:2].double(), unscaled.double(), rtol=1e-3, atol=1e-5)
    # an ordinary user well inside the clip gets its exact gradient
    small = FedRepProtocol(**{**proto.__dict__, "clip": 1e6})
    exact = small.gradients(U.double(), x[:1].double(), y[:1].double())
    torch.testing.assert_close(
        small.clipped_gradients(U.double(), x[:1].double(), y[:1].double()), exact, rtol=1e-9, atol=1e-12
    )


def test_fedrep_is_accounted_over_init_and_every_round():
    cfg, protocol, _ = setup({**SMALL, "rounds": 4, "epsilon": 3.0, "delta": 1e-6})
    result = execute(EXP, cfg, write=False, progress=False)
    assert result["privacy"]["releases_per_user"] == 5
    assert result["epsilon"] <= 3.0 and result["epsilon"] == pytest.approx(3.0, rel=1e-2)
    # the init alone at the same noise would be much cheaper: the rounds are counted
    assert event_epsilon(FedRepProtocol.user_event(protocol.noise_multiplier, 1), 1e-6) < 0.6 * 3.0


def test_nonprivate_fedrep_recovers_u_star():
    cfg = config.build(
        EXP.config_type,
        dict(
            n_users=3000,
            dim=10,
            rank=2,
            samples_per_user=6,
            refit_samples=5,
            test_samples=20,
            noise_std=0.01,
            epsilon=math.inf,
            rounds=30,
            learning_rate=1.0,
            seed=4,
        ),
    )
    result = execute(EXP, cfg, write=False, progress=False)
    assert result["subspace_error"] < 1e-2
    assert result["population_mse"] < 2 * result["baselines"]["oracle"]["population_mse"]
    assert result["subspace_error"] < 0.1 * result["baselines"]["private_init_only"]["subspace_error"]


@pytest.mark.slow  # > 10 s; in CI's slow run
def test_private_fedrep_improves_on_its_initialisation():
    cfg = config.build(
        EXP.config_type,
        dict(
            n_users=5000,
            dim=20,
            rank=2,
            samples_per_user=5,
            test_samples=50,
            epsilon=8.0,
            rounds=20,
            learning_rate=1.0,
            seed=1,
        ),
    )
    result = execute(EXP, cfg, write=False, progress=False)
    assert result["subspace_error"] < 0.5 * result["baselines"]["private_init_only"]["subspace_error"]


def test_fedrep_flower_grid_matches_local(tmp_path):
    cfg = config.build(EXP.config_type, {**SMALL, "n_users": 300, "seed": 1})
    local = execute(EXP, cfg, out=tmp_path / "local", progress=False)
    grid = InProcessGrid(make_client_app(), 3)
    flower = execute(
        EXP, cfg, RuntimeOptions(runtime=Runtime.FLOWER, nodes=3), out=tmp_path / "flower", progress=False, grid=grid
    )
    assert flower["runtime"] == "flower"
    for key in ("subspace_error", "population_mse"):
        assert flower[key] == pytest.approx(local[key], rel=1e-6, abs=1e-9), key
    assert (tmp_path / "flower" / "ledger.json").read_text() == (tmp_path / "local" / "ledger.json").read_text()
    torch.testing.assert_close(flower["_state"]["U"], local["_state"]["U"], rtol=1e-6, atol=1e-9)


# ----- the device code path (--kernels device; run here on CPU tensors) -----------------------------------
DEVICE_RUN = {"n_users": 2000, "dim": 10, "rank": 2, "rounds": 3, "baselines": "none"}


def _run(**values) -> dict:
    return execute(EXP, config.build(EXP.config_type, {**DEVICE_RUN, **values}), write=False, progress=False)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        pytest.param({"cohorts": "poisson", "sampling_rate": 0.5, "v_star": "normal"}, marks=pytest.mark.slow),
    ],  # 40 s
)
def test_device_kernels_in_float64_on_cpu_give_the_host_run(extra):
    """float64 on the CPU: the device path draws the host's users (docs/fedrep.md), so the run is the host's."""
    host, device = _run(kernels="host", **extra), _run(kernels="device", **extra)
    for key in ("subspace_error", "population_mse"):
        assert device[key] == pytest.approx(host[key], rel=1e-9), key


@pytest.mark.slow
def test_device_kernels_in_float32_draw_other_users_the_same_for_any_chunking():
    """float32: users drawn per (block, part) on the device, other than the host's float64 users, the same for any chunk size."""
    a = _run(kernels="device", dtype="float32", chunk_size=300)
    b = _run(kernels="device", dtype="float32", chunk_size=2000)
    host = _run(kernels="host", dtype="float32", chunk_size=300)
    assert b["subspace_error"] == pytest.approx(a["subspace_error"], rel=1e-4)
    assert b["population_mse"] == pytest.approx(a["population_mse"], rel=1e-4)
    assert abs(host["population_mse"] - a["population_mse"]) > 1e-4 * host["population_mse"]  # other users


def test_device_path_draws_no_host_user_data(monkeypatch):
    """Every generator of users' data on the device path is made for the run's device (U*, d×k, comes from the host)."""
    from fedpers.data import synthetic

    real, host_keys = synthetic._generator, []

    def recording(seed, *key, device=None):
        if device is None:
            host_keys.append(key)
            return real(seed, *key)
        return real(seed, *key, device=device)

    monkeypatch.setattr(synthetic, "_generator", recording)
    result = _run(kernels="device", dtype="float32", seed=4242)  # a seed no other test draws (no cached blocks)
    assert math.isfinite(result["population_mse"])
    assert host_keys and all(key[0] == synthetic._STREAM_TRUTH for key in host_keys)
    host_keys.clear()
    _run(kernels="host", dtype="float32", seed=4243)
    assert any(key[0] != synthetic._STREAM_TRUTH for key in host_keys)  # the check sees host draws when there are some


@pytest.mark.parametrize(("values", "field_name"), [({"device": "tpu"}, "device"), ({"kernels": "gpu"}, "kernels")])
def test_bad_device_or_kernels_is_refused_naming_the_field(values, field_name):
    with pytest.raises(ValueError, match=field_name):
        config.build(EXP.config_type, values)
