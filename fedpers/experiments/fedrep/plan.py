"""FedRep's users (AltMin's synthetic model, v*_j on the sphere or normal; m training, R refit and S test
samples each, all from (seed, user id)) and its protocol calibrated to (ε, δ), correlated noise included."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from fedpers.config import (
    device_path,
)
from fedpers.configs.fedrep import FedRepConfig, VStar
from fedpers.data import synthetic
from fedpers.data.units import UnitSource
from fedpers.experiments.base import derived_seed
from fedpers.privacy import (
    Calibrations,
    calibrate_noise_multiplier,
    correlated,
)
from fedpers.protocols.fedrep import FedRepProtocol, default_zeta

Tensor = torch.Tensor


def truth(cfg: FedRepConfig) -> Tensor:
    return synthetic.subspace(derived_seed(cfg.seed, "truth"), cfg.dim, cfg.rank)


def load_all(cfg: FedRepConfig, ids: Tensor, test: bool = True) -> dict[str, Tensor]:
    """Users' m train and R refit samples (one draw, split in that order) and, with ``test``,
    their S test samples (x and label noise from a separate stream, so training passes never
    generate them), all from (seed, user id).

    Host path: drawn on the CPU in float64 and copied to ``cfg.device`` in ``cfg.dtype``. Device
    path (``kernels``): drawn on ``cfg.device`` in ``cfg.dtype`` (:func:`synthetic.altmin_users`);
    in float64 on the CPU these are the host's users exactly, in float32 or on a GPU other users
    from the same distribution (the float32/device scheme). U* (d×k, public to the simulator) is
    drawn on the host either way."""
    m, r = cfg.samples_per_user, cfg.refit_samples
    dtype = getattr(torch, cfg.dtype)
    on_device = device_path(cfg.device, cfg.kernels)
    draw = {"dtype": dtype, "device": cfg.device} if on_device else {}
    ids = ids.to(torch.int64).to(cfg.device if on_device else "cpu")
    u = truth(cfg).to(ids.device)
    out = synthetic.altmin_users(derived_seed(cfg.seed, "data"), ids, u, m + r, cfg.noise_std, **draw)
    x, y, v = out["x"], out["y"], out["v_star"]
    if cfg.v_star is VStar.SPHERE:
        # the same draw with v*_j rescaled to the unit sphere (label noise kept as drawn)
        signal = ((x @ u.to(x.dtype)) @ v.unsqueeze(-1)).squeeze(-1)
        norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny)
        v = v / norm
        y = y - signal + signal / norm
    split = {"ids": ids, "v_star": v, "x": x[:, :m], "y": y[:, :m], "x_refit": x[:, m:], "y_refit": y[:, m:]}
    if test:
        # y = 0·x + 1·z with U = 0: the test x and a standard normal z per sample
        noise = synthetic.altmin_users(
            derived_seed(cfg.seed, "test"), ids, torch.zeros_like(u), cfg.test_samples, 1.0, **draw
        )
        xt = noise["x"]
        split["x_test"] = xt
        split["y_test"] = ((xt @ u.to(xt.dtype)) @ v.unsqueeze(-1)).squeeze(-1) + cfg.noise_std * noise["y"]
    return {k: (t.to(cfg.device, dtype) if t.is_floating_point() else t.to(cfg.device)) for k, t in split.items()}


def source(cfg: FedRepConfig, keys: tuple[str, ...] | None = None) -> UnitSource:
    def load(start: int, stop: int) -> dict[str, Tensor]:
        units = load_all(cfg, torch.arange(start, stop), test=keys is None or "x_test" in keys)
        return units if keys is None else {k: v for k, v in units.items() if k in keys}

    return UnitSource(cfg.n_users, load, cfg.device)


def make_protocol(cfg: FedRepConfig, calibrations: Calibrations | None = None) -> FedRepProtocol:
    private = not math.isinf(cfg.epsilon)
    proto = FedRepProtocol(
        n_users=cfg.n_users,
        dim=cfg.dim,
        rank=cfg.rank,
        samples_per_user=cfg.samples_per_user,
        rounds=cfg.rounds,
        clip=cfg.clip if private else math.inf,
        zeta=default_zeta(cfg.rank, cfg.noise_std, cfg.clip_label) if private else math.inf,
        learning_rate=cfg.learning_rate,
        noise_multiplier=0.0,
        dtype_name=cfg.dtype,
        sampling_rate=cfg.sampling_rate,
    )
    proto = replace(proto, cycle=correlated.cycle_of(cfg.cohorts, cfg.cycle))
    share = cfg.clip_budget if private and cfg.clip_rule == "adaptive" else 0.0

    def calibrated(releases: int, rate: float) -> float:
        return calibrate_noise_multiplier(
            lambda z: FedRepProtocol.user_event(z, releases, rate, share),
            cfg.epsilon,
            cfg.delta,
            cfg.accountant,
            calibrations,
            cfg.neighbours,
        )

    if cfg.noise != "independent" and cfg.cohorts == "poisson":
        # b public id blocks taken in turn, each sampled at q·b (b = 1: plain Poisson); amplified accounting
        noise = correlated.sampled_mechanism(
            cfg.noise,
            cfg.rounds,
            cfg.bands,
            cfg.sampling_rate,
            lambda b: calibrated(1 + -(-cfg.rounds // b), min(1.0, cfg.sampling_rate * b)) if private else 1.0,
            cfg.noise_decay,
        )
        proto = replace(proto, cycle=noise.cycle, sampling_rate=noise.sampling_rate, correlated=noise)
    elif cfg.noise != "independent":
        proto = replace(
            proto, correlated=correlated.run_mechanism(cfg.noise, cfg.rounds, cfg.bands, proto.cycle, cfg.noise_decay)
        )
    if not private:
        return proto
    if cfg.clip_rule == "adaptive":
        proto = replace(proto, clip_quantile=cfg.clip_quantile, clip_lr=cfg.clip_lr, count_share=cfg.clip_budget)
    return replace(proto, noise_multiplier=calibrated(proto.releases_per_user(), proto.sampling_rate))


def correlated_summary(protocol: FedRepProtocol) -> dict[str, Any]:
    """The correlated mechanism's public description for the run's privacy summary (empty if independent)."""
    c = protocol.correlated
    return {"noise": "independent"} if c is None else correlated.summary(c)
