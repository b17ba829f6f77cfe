"""NoisyGD under neural collapse (docs/algorithms.md §3): gradients, zCDP calibration, remedies as releases, the dimension claims."""

import math

import dp_accounting
import pytest
import torch

from fedpers import config
from fedpers.data import neural_collapse as nc
from fedpers.experiments import EXPERIMENTS
from fedpers.experiments.noisygd import NoisyGDConfig, make_protocol
from fedpers.privacy import (
    Accountant,
    Ledger,
    Release,
    event_epsilon,
    ledger_epsilon,
    zcdp_epsilon,
    zcdp_rho,
    zcdp_rho_for,
)
from fedpers.protocols.noisygd import Loss, clipped_gradient_sum
from fedpers.runner import execute

EXP = EXPERIMENTS["noisygd"]


def build(**values) -> NoisyGDConfig:
    return config.build(NoisyGDConfig, values)


def run(**values) -> dict:
    return execute(EXP, build(**values), write=False, progress=False)


@pytest.mark.parametrize("loss", [Loss.CE, Loss.SQUARED])
def test_clipped_gradient_sum_equals_per_example_autograd(loss):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(4, 6, generator=g, dtype=torch.float64)
    x = 2 * torch.randn(20, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (20,), generator=g)
    total, clipped = clipped_gradient_sum(W, x, y, 1.5, loss)
    expected = torch.zeros_like(W)
    count = 0
    for i in range(20):
        w = W.clone().requires_grad_(True)
        logits = w @ x[i]
        if loss is Loss.CE:
            value = torch.nn.functional.cross_entropy(logits.unsqueeze(0), y[i : i + 1])
        else:
            value = 0.5 * ((logits - torch.nn.functional.one_hot(y[i], 4).double()) ** 2).sum()
        (grad,) = torch.autograd.grad(value, w)
        norm = float(torch.linalg.matrix_norm(grad))
        count += norm > 1.5
        expected += grad * min(1.0, 1.5 / norm)
    assert torch.allclose(total, expected, atol=1e-12)
    assert clipped == count > 0


def test_etf_and_class_layout():
    M = nc.etf(0, 10, 50)
    gram = M.T @ M
    assert torch.allclose(gram.diagonal(), torch.ones(10, dtype=gram.dtype), atol=1e-12)
    off = gram[~torch.eye(10, dtype=torch.bool)]
    assert torch.allclose(off, torch.full_like(off, -1 / 9), atol=1e-12)
    counts = nc.class_counts(1000, 10, 0.1)
    assert int(counts.sum()) == 1000 and counts[0] == counts.max() and counts[-1] == counts.min()
    assert float(counts[-1] / counts[0]) == pytest.approx(0.1, rel=0.05)
    assert torch.equal(nc.class_counts(1000, 10, 1.0), torch.full((10,), 100))


def test_units_of_any_slice_match_the_whole_set():
    cfg = build(examples=3000, feature_dim=40, collapse="random")
    whole = EXP.units(cfg, torch.arange(3000))
    ids = torch.tensor([2999, 5, 1024, 1500, 0])
    part = EXP.units(cfg, ids)
    assert torch.equal(part["x"], whole["x"][ids]) and torch.equal(part["y"], whole["y"][ids])


def test_zcdp_calibration_meets_the_target_and_pld_reports_less_for_the_same_noise():
    cfg = build(examples=200, feature_dim=20, steps=10, baselines="none", accountant="zcdp", delta=1e-4)  # the paper's
    result = execute(EXP, cfg, write=False, progress=False)
    priv = result["privacy"]
    rho_target = zcdp_rho_for(1.0, 1e-4)
    assert priv["rho"] == pytest.approx(rho_target, rel=1e-6)
    assert priv["epsilon"] == pytest.approx(1.0, rel=1e-6) == priv["epsilon_zcdp"]
    assert zcdp_epsilon(rho_target, 1e-4) == pytest.approx(1.0, rel=1e-12)
    # T steps of N(0, (zG)²) on a replace-one sum (sensitivity 2G) are T·2/z² zCDP.
    z = priv["noise_multiplier"]
    assert 10 * 2 / z**2 == pytest.approx(rho_target, rel=1e-6)
    assert 0.5 < priv["epsilon_pld"] < 0.8  # the tight accountant: same noise, smaller ε
    pld = execute(
        EXP,
        build(examples=200, feature_dim=20, steps=10, baselines="none", accountant="pld", delta=1e-4),
        write=False,
        progress=False,
    )
    assert 0.999 <= pld["epsilon"] <= 1.0 and pld["noise_multiplier"] < z


def test_zcdp_accounting_of_events():
    assert zcdp_rho(dp_accounting.GaussianDpEvent(2.0)) == pytest.approx(0.5)
    composed = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(2.0)] * 4)
    assert event_epsilon(composed, 1e-5, Accountant.ZCDP) == pytest.approx(2.0 + 2 * math.sqrt(2.0 * math.log(1e5)))
    assert event_epsilon(dp_accounting.NonPrivateDpEvent(), 1e-5, Accountant.ZCDP) == math.inf
    # zCDP is valid but looser than PLD for the same Gaussian noise.
    assert event_epsilon(composed, 1e-5, Accountant.ZCDP) > event_epsilon(composed, 1e-5, Accountant.PLD)


@pytest.mark.parametrize("remedy,name", [("center", "remedy.mean"), ("pca", "remedy.pca")])
def test_remedies_are_releases_in_the_ledger_within_the_budget(remedy, name):
    cfg = build(
        examples=300,
        feature_dim=30,
        steps=5,
        remedy=remedy,
        collapse="offset",
        baselines="none",
        remedy_budget=0.25,
        accountant="zcdp",
        delta=1e-4,
    )
    result = execute(EXP, cfg, write=False, progress=False)
    proto = make_protocol(cfg)
    assert proto.num_rounds == 6
    z_gd, z_r = proto.noise_multiplier, proto.remedy_noise_multiplier
    share = (2 / z_r**2) / (2 / z_r**2 + 5 * 2 / z_gd**2)
    assert share == pytest.approx(0.25, rel=1e-9)
    assert result["privacy"]["epsilon"] == pytest.approx(1.0, rel=1e-6)
    ledger = Ledger(
        [Release(0, name, "gaussian", 1.0, 2.0, 1.0, "all", dp_accounting.GaussianDpEvent(z_r))]
        + [
            Release(s, f"step{s}.grad", "gaussian", 1.0, 2.0, 1.0, "all", dp_accounting.GaussianDpEvent(z_gd))
            for s in range(1, 6)
        ]
    )
    assert ledger_epsilon(ledger, 1e-4, Accountant.ZCDP) == pytest.approx(1.0, rel=1e-6)


def test_without_noise_perfect_collapse_is_learned_and_a_tiny_budget_is_not():
    assert run(examples=500, feature_dim=50, epsilon=math.inf, steps=5, baselines="none")["accuracy"] == 1.0
    weak = run(examples=100, feature_dim=50, epsilon=0.01, steps=5, baselines="all")
    assert weak["accuracy"] < 0.6 and weak["baselines"]["nonprivate_gd"]["accuracy"] == 1.0


@pytest.mark.slow
def test_dimension_dependence_perfect_flat_offset_falls_centring_restores():
    # n = 3000 keeps it quick; the offset's feature norm sqrt(1 + pβ²) grows with p and with it
    # the clipping loss and the noise on every logit, while perfect collapse is dimension-free.
    # Measured (seeds 0-3): perfect 1.0 at p = 10, 1000, 3000; offset 1.0 at p = 10, 0.375 at
    # p = 3000; centred 0.975 at p = 3000.
    def mean_accuracy(p: int, **scenario) -> float:
        accs = [
            run(examples=3000, feature_dim=p, seed=s, baselines="none", remedy_budget=0.5, **scenario)["accuracy"]
            for s in range(3)
        ]
        return sum(accs) / len(accs)

    perfect = {p: mean_accuracy(p) for p in (10, 1000, 3000)}
    assert min(perfect.values()) >= 0.95 and perfect[3000] >= perfect[10] - 0.05
    offset = {p: mean_accuracy(p, collapse="offset") for p in (10, 3000)}
    assert offset[10] >= 0.95 and offset[3000] <= offset[10] - 0.3
    centred = mean_accuracy(3000, collapse="offset", remedy="center")
    assert centred >= offset[3000] + 0.3 and centred >= 0.9


# ----- the device code path (--kernels device; run here on CPU tensors) -----------------------------------
def _final_W(cfg: NoisyGDConfig) -> torch.Tensor:
    from fedpers.experiments.noisygd import load_units
    from fedpers.privacy import Privatizer
    from fedpers.runtime.local import run_local

    units = load_units(cfg, torch.arange(cfg.examples))
    state, _ = run_local(make_protocol(cfg), units, Privatizer(5), chunk_size=700, progress=False)
    return state["W"]


@pytest.mark.parametrize(
    "extra",
    [
        {"collapse": "random", "remedy": "pca"},
        {"collapse": "offset", "remedy": "center", "dtype": "float64", "imbalance": 0.3},
    ],
)
def test_device_kernels_on_cpu_give_the_host_run(extra):
    """The device path draws example i on the device from the same (seed, i): on the CPU, the host's W to float tolerance."""
    base = dict(examples=1500, feature_dim=40, steps=4, epsilon=0.5, **extra)
    host = _final_W(build(kernels="host", **base))
    device = _final_W(build(kernels="device", **base))
    assert float(host.norm()) > 0
    assert torch.allclose(device, host, rtol=1e-6, atol=1e-7)
    a, b = run(kernels="host", test_perturbation=0.3, **base), run(kernels="device", test_perturbation=0.3, **base)
    assert a["accuracy"] == b["accuracy"] and a["baselines"] == b["baselines"]


def test_device_path_draws_no_host_data(monkeypatch):
    """Every data generator of the device path is made for the run's device: a host-side one raises."""
    from fedpers.data import synthetic

    real = synthetic._generator

    def device_only(seed, *key, device=None):
        if device is None:
            raise AssertionError("the device path called a host-side generator for data")
        return real(seed, *key, device=device)

    monkeypatch.setattr(nc, "_generator", device_only)
    result = run(
        kernels="device",
        examples=1200,
        feature_dim=30,
        steps=3,
        collapse="random",
        remedy="center",
        test_perturbation=0.1,
    )
    assert 0.0 <= result["accuracy"] <= 1.0
    with pytest.raises(AssertionError, match="host-side"):
        run(kernels="host", examples=1200, feature_dim=30, steps=3, collapse="random")


@pytest.mark.parametrize(("values", "field_name"), [({"device": "tpu"}, "device"), ({"kernels": "gpu"}, "kernels")])
def test_bad_device_or_kernels_is_refused_naming_the_field(values, field_name):
    with pytest.raises(ValueError, match=field_name):
        build(**values)
