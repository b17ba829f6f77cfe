"""`fedpers run noisygd`: last-layer NoisyGD on neural-collapse features (docs/algorithms.md §3), zCDP accounting."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import dp_accounting
import torch

from fedpers import memory
from fedpers.config import (
    device_path,
)
from fedpers.configs.noisygd import BASELINES, Collapse, NoisyGDConfig, Remedy, baseline_names
from fedpers.configs.privacy import Accountant, accountant_name
from fedpers.data import neural_collapse as nc
from fedpers.experiments.base import Evaluator, Experiment, Trivial, derived_seed
from fedpers.experiments.hooks import LABEL_OVERSHOOT, Canaries, CanaryDesign
from fedpers.privacy import (
    ALL_UNITS,
    Calibrations,
    Ledger,
    Privatizer,
    UnsupportedEvent,
    calibrate_noise_multiplier,
    correlated,
    ledger_epsilon,
    zcdp_rho,
    zcdp_rho_for,
)
from fedpers.protocols.base import State
from fedpers.protocols.noisygd import NoisyGDProtocol
from fedpers.runtime.local import run_local

Tensor = torch.Tensor


def feature_bound(cfg: NoisyGDConfig) -> float:
    """R: ||M_k + v|| ≤ 1 + ||v|| = 1 + √p·β for every training feature of the data model."""
    if cfg.feature_bound > 0:
        return cfg.feature_bound
    beta = 0.0 if cfg.collapse is Collapse.PERFECT else cfg.beta
    return 1.0 + math.sqrt(cfg.feature_dim) * beta


def budget_split(cfg: NoisyGDConfig, steps: int | None = None) -> tuple[float, float]:
    """Unit-free factors (a, b): GD steps get multiplier a·z₁, the remedy b·z₁, so that
    T/a² + 1/b² = 1/z₁² (Gaussian μ² and zCDP ρ both add as 1/z²): z₁ is the single-release
    multiplier the whole budget would buy; the remedy gets the share ``remedy_budget``. ``steps``: the
    steps an example takes part in (default :func:`participations`)."""
    steps = participations(cfg) if steps is None else steps
    if cfg.remedy is Remedy.NONE:
        return math.sqrt(steps), 0.0
    f = cfg.remedy_budget
    return math.sqrt(steps / (1 - f)), 1 / math.sqrt(f)


def participations(cfg: NoisyGDConfig) -> int:
    """Steps an example takes part in: T, or ⌈T/K⌉ under a K-cycle."""
    return -(-cfg.steps // correlated.cycle_of(cfg.cohorts, cfg.cycle))


def run_event(z1: float, cfg: NoisyGDConfig, steps: int | None = None, rate: float = 1.0) -> dp_accounting.DpEvent:
    """What one example is touched by: its ``steps`` (default :func:`participations`) gradient releases,
    each Poisson-sampled at ``rate`` < 1, and the remedy's release."""
    steps = participations(cfg) if steps is None else steps
    a, b = budget_split(cfg, steps)
    step: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(a * z1)
    if rate < 1.0:
        step = dp_accounting.PoissonSampledDpEvent(rate, step)
    events: list[dp_accounting.DpEvent] = [step] * steps
    if b:
        events.append(dp_accounting.GaussianDpEvent(b * z1))
    return dp_accounting.ComposedDpEvent(events)


def make_protocol(
    cfg: NoisyGDConfig, *, private: bool = True, calibrations: Calibrations | None = None
) -> NoisyGDProtocol:
    proto = NoisyGDProtocol(
        classes=cfg.classes,
        feature_dim=cfg.feature_dim,
        examples=cfg.examples,
        steps=cfg.steps,
        lr=cfg.lr,
        grad_clip=cfg.grad_clip if private else math.inf,
        noise_multiplier=0.0,
        remedy=cfg.remedy,
        feature_bound=feature_bound(cfg) if private else math.inf,
        remedy_noise_multiplier=0.0,
        loss=cfg.loss,
        dtype_name=cfg.dtype,
        cycle=correlated.cycle_of(cfg.cohorts, cfg.cycle),
        sampling_rate=cfg.sampling_rate if cfg.cohorts == "poisson" else 1.0,
    )
    noisy = private and not math.isinf(cfg.epsilon)

    def calibrated(steps: int, rate: float) -> float:
        return calibrate_noise_multiplier(
            lambda z: run_event(z, cfg, steps, rate),
            cfg.epsilon,
            cfg.delta,
            cfg.accountant,
            calibrations,
            cfg.neighbours,
        )

    if cfg.noise != "independent" and cfg.cohorts == "poisson":
        # b public id blocks taken in turn, each sampled at q·b (b = 1: plain Poisson); amplified accounting.
        # The choice weighs each candidate by its step multiplier a·z₁ (the remedy's share fixed).
        def step_multiplier(b: int) -> float:
            steps = -(-cfg.steps // b)
            return budget_split(cfg, steps)[0] * calibrated(steps, min(1.0, cfg.sampling_rate * b)) if noisy else 1.0

        noise = correlated.sampled_mechanism(
            cfg.noise, cfg.steps, cfg.bands, cfg.sampling_rate, step_multiplier, cfg.noise_decay
        )
        proto = replace(proto, cycle=noise.cycle, sampling_rate=noise.sampling_rate, correlated=noise)
    elif cfg.noise != "independent":
        proto = replace(
            proto, correlated=correlated.run_mechanism(cfg.noise, cfg.steps, cfg.bands, proto.cycle, cfg.noise_decay)
        )
    if not noisy:
        return proto
    z1 = calibrated(proto.participations(), proto.sampling_rate)
    a, b = budget_split(cfg, proto.participations())
    if cfg.clip_rule == "adaptive":
        # each step's μ² splits 1 − f : f between the gradient sum and the count (same total as a·z₁)
        f = cfg.clip_budget
        proto = replace(proto, clip_quantile=cfg.clip_quantile, clip_lr=cfg.clip_lr, count_share=f)
        return replace(proto, noise_multiplier=a * z1 / math.sqrt(1 - f), remedy_noise_multiplier=b * z1)
    return replace(proto, noise_multiplier=a * z1, remedy_noise_multiplier=b * z1)


def load_units(cfg: NoisyGDConfig, ids: Tensor, *, test: bool = False) -> dict[str, Tensor]:
    """Examples with these ids on ``cfg.device``: drawn on the host and copied, or on the device
    path drawn there from the same keys (on the CPU the same features; on a GPU other ones)."""
    out = nc.features(
        derived_seed(cfg.seed, "data"),
        ids,
        classes=cfg.classes,
        dim=cfg.feature_dim,
        examples=cfg.test_examples if test else cfg.examples,
        collapse=cfg.collapse,
        beta=cfg.beta,
        imbalance=cfg.imbalance,
        dtype=getattr(torch, cfg.dtype),
        test=test,
        test_perturbation=cfg.test_perturbation if test else 0.0,
        device=cfg.device if device_path(cfg.device, cfg.kernels) else None,
    )
    return {k: v.to(cfg.device) for k, v in out.items()}


def accuracy(protocol: NoisyGDProtocol, state: Any, test: dict[str, Tensor], classes: int) -> dict[str, float]:
    pred, y = protocol.predict(state, test["x"]), test["y"]
    correct = (pred == y).double()
    per_class = [float(correct[y == k].mean()) for k in range(classes) if bool((y == k).any())]
    return {"accuracy": float(correct.mean()), "balanced_accuracy": sum(per_class) / len(per_class)}


def shared_baselines(cfg: NoisyGDConfig) -> tuple[str, ...]:
    """Non-private GD on the same data, when asked for (the chance row costs nothing)."""
    return ("nonprivate_gd",) if "nonprivate_gd" in baseline_names(cfg.baselines) else ()


class NoisyGDEvaluator(Evaluator):
    def __init__(self, cfg: NoisyGDConfig, protocol: NoisyGDProtocol) -> None:
        self.cfg, self.protocol = cfg, protocol
        self.test = load_units(cfg, torch.arange(cfg.test_examples), test=True)
        self.reused: dict[str, dict[str, Any]] = {}

    def reuse_baselines(self, rows: Mapping[str, Mapping[str, Any]]) -> None:
        unknown = sorted(set(rows) - set(shared_baselines(self.cfg)))
        if unknown:
            raise ValueError(f"reuse_baselines: {unknown} are not shared baselines of this run")
        self.reused = {name: dict(row) for name, row in rows.items()}

    def round_metrics(self, round: int, state: State) -> dict[str, float]:
        if round < self.protocol.remedy_rounds:
            return {}
        return accuracy(self.protocol, state, self.test, self.cfg.classes)

    def final(self, state: State) -> dict[str, Any]:
        out: dict[str, Any] = accuracy(self.protocol, state, self.test, self.cfg.classes)
        majority = float(torch.bincount(self.test["y"].long().cpu(), minlength=self.cfg.classes).max()) / max(
            int(self.test["y"].numel()), 1
        )
        out["baselines"] = {
            "chance": {"accuracy": majority, "balanced_accuracy": 1.0 / self.cfg.classes}
        }  # always the most frequent class
        if "chance" not in baseline_names(self.cfg.baselines):
            del out["baselines"]["chance"]
        if "nonprivate_gd" in self.reused and "nonprivate_gd" in baseline_names(self.cfg.baselines):
            # computed by another run of this data and seed (a sweep's)
            out["baselines"]["nonprivate_gd"] = self.reused["nonprivate_gd"]
            out["baselines_reused"] = ["nonprivate_gd"]
        elif "nonprivate_gd" in baseline_names(self.cfg.baselines):
            nonprivate = make_protocol(self.cfg, private=False)
            units = load_units(self.cfg, torch.arange(self.cfg.examples))
            np_state, _ = run_local(nonprivate, units, Privatizer(0), chunk_size=self.cfg.chunk_size, progress=False)
            out["baselines"]["nonprivate_gd"] = accuracy(nonprivate, np_state, self.test, self.cfg.classes)
        out["baselines_skipped"] = [name for name in BASELINES if name not in out["baselines"]]
        return out


# ----- optional hook: audit canaries -------------------------------------------------------------
def audit_protocol(cfg: NoisyGDConfig, k: int, calibrations: Calibrations | None = None) -> NoisyGDProtocol:
    """The configured protocol for ``k`` canary examples (feature coordinates must stay unmixed; with
    cyclic cohorts a canary takes part in its cohort's steps; with correlated noise the scorer
    decorrelates the stream)."""
    if cfg.clip_rule != "fixed":
        raise ValueError(
            "clip_rule: the noisygd audit's canaries sit at a fixed clip; audit without --clip-rule adaptive"
        )
    return make_protocol(replace(cfg, examples=k, chunk_size=max(k, 1)), calibrations=calibrations)


def audit_canaries(protocol: NoisyGDProtocol, generator: torch.Generator, count: int) -> Canaries:
    """Canary example i: feature ±s·e_i ("+"/"−"), label i mod K, s = 1.5·G_c/sqrt(1 − 1/K) so the
    gradient clip binds at W = 0 (||r|| = sqrt(1 − 1/K) for cross-entropy, 1 for squared loss).
    At step 1 (W = 0) the residual r is the same in both versions, so the clipped gradients are
    ±G_c r̂ e_iᵀ: 2G_c apart, the full replace-one sensitivity. Later steps: r(±W x) differs a
    little as W moves (lr·noise small: near-full). The centring remedy's feature sum sees ±R e_i
    (clip R binds): full sensitivity too. The PCA remedy's second moment R²e_ie_iᵀ is the same in both
    versions (PSD, sign-blind: ``--placement paired`` puts "−" on e_j and moves it by its full
    √2·R²), and its projection x P̂ mixes the canaries' coordinates in the gradient steps: they
    overlap there, which the scorer counts as interference."""
    p = protocol
    if count > p.feature_dim:
        raise ValueError(f"canaries must be <= feature_dim={p.feature_dim}; got {count}")
    scale = LABEL_OVERSHOOT * p.grad_clip / math.sqrt(1.0 - 1.0 / p.classes)
    if p.remedy is not Remedy.NONE:
        scale = max(scale, LABEL_OVERSHOOT * p.feature_bound)
    x = scale * torch.eye(p.feature_dim, dtype=torch.float64)[:count]
    ids = torch.arange(count)
    y = ids % p.classes
    dtype = p.dtype
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y},
        {"ids": ids, "x": (-x).to(dtype), "y": y},
        "feature ±s·e_i per canary example; clipped gradient ±G_c r̂ e_iᵀ (2G_c apart at W = 0)"
        + (
            "; PCA remedy: second moment equal in both versions, gradients mixed by the projection (interference)"
            if p.remedy is Remedy.PCA
            else ""
        ),
    )


CANARY_DESIGN = CanaryDesign(
    audit_protocol,
    lambda p: p.feature_dim,
    audit_canaries,
    "every step's noisy clipped-gradient sum (and the remedy's release: the feature sum or the second moment)",
    "replace-one example (a canary's two versions are the same example with its feature negated)",
)


class NoisyGDExperiment(Experiment[NoisyGDConfig, NoisyGDProtocol]):
    """Last-layer NoisyGD on neural-collapse features (zCDP accounting, converted to (ε, δ))."""

    round_axis = "round (the remedy's release first if --remedy is set, then gradient steps)"

    name = "noisygd"
    privacy_fields = ("epsilon", "delta", "accountant", "neighbours", "noise", "bands", "noise_decay")

    def shared_baselines(self, cfg: NoisyGDConfig) -> tuple[str, ...]:
        return shared_baselines(cfg)

    result_keys = ("accuracy", "balanced_accuracy")
    baseline_names = BASELINES
    config_type = NoisyGDConfig

    def trivial_baselines(self, cfg: NoisyGDConfig) -> list[Trivial]:
        why = (
            "the noise swamps the clipped gradients: too few examples for this ε at this feature dimension "
            "(raise --examples or --epsilon, lower --feature-dim, or try --remedy center|pca)"
        )
        return [
            Trivial("accuracy", "chance", higher_is_better=True, why=why),
            Trivial("balanced_accuracy", "chance", higher_is_better=True, why=why),
        ]

    primary_metric = "accuracy"

    def protocol(self, cfg: NoisyGDConfig, calibrations: Calibrations | None = None) -> NoisyGDProtocol:
        self.plan(cfg)
        return make_protocol(cfg, calibrations=calibrations)

    def plan(self, cfg: NoisyGDConfig) -> list[str]:
        """Features (train and test, kept by the evaluator too), one chunk's gradients, the p×p PCA moment."""
        item = 4 if cfg.dtype == "float32" else 8
        p, K = cfg.feature_dim, cfg.classes
        need = {
            "features": (cfg.examples + cfg.test_examples) * (p + 1) * item * 2,
            "working": min(cfg.chunk_size, cfg.examples) * (p + K) * item * 4 + p * p * 8 * 3,
        }
        return memory.check_fits("noisygd", need, "use fewer examples or a smaller --feature-dim")

    def num_units(self, cfg: NoisyGDConfig) -> int:
        return cfg.examples

    def units(self, cfg: NoisyGDConfig, ids: Tensor) -> dict[str, Tensor]:
        return load_units(cfg, ids)

    def evaluator(self, cfg: NoisyGDConfig, protocol: NoisyGDProtocol) -> NoisyGDEvaluator:
        return NoisyGDEvaluator(cfg, protocol)

    def privacy_summary(self, cfg: NoisyGDConfig, protocol: NoisyGDProtocol, ledger: Ledger) -> dict[str, Any]:
        from fedpers.privacy import skellam

        # ρ of the worst-off example: its cohort's releases and every "all" release; Skellam: RDP only, no ρ
        groups = [
            dp_accounting.ComposedDpEvent([r.event for r in ledger.touching(g)]) for g in ledger.groups() or [ALL_UNITS]
        ]
        sampled = protocol.poisson  # zCDP has no amplification: no ρ for a sampled run
        rho = (
            math.nan
            if sampled or any(skellam.contains_skellam(e) for e in groups)
            else max(zcdp_rho(e, cfg.neighbours) for e in groups)
        )
        name = accountant_name(cfg.accountant)
        by_accountant: dict[str, float] = {}
        for a in [*(a.value for a in Accountant), name]:
            try:  # every built-in accountant that accounts this ledger (a sampled one: pld; rdp under add-remove)
                by_accountant.setdefault(a, ledger_epsilon(ledger, cfg.delta, a))
            except UnsupportedEvent:
                if a == name:
                    raise
        out = {
            "epsilon": by_accountant[name],
            "delta": cfg.delta,
            "target_epsilon": cfg.epsilon,
            "accountant": name,
            "neighbouring": f"{cfg.neighbours.value} example",
            "neighbours": cfg.neighbours.value,
            "noise_multiplier": protocol.noise_multiplier,
            "noise_std_grad": protocol.noise_std(),
            "rho": rho,
            "noise": "independent",
            "steps_per_example": protocol.participations(),
            "rho_per_step": (cfg.neighbours.sensitivity_factor**2 / (2.0 * protocol.noise_multiplier**2))
            * (1 / (1 - protocol.count_share))
            if protocol.noise_multiplier > 0
            else math.inf,
            "epsilon_zcdp": by_accountant.get("zcdp", math.nan),
            "epsilon_pld": by_accountant["pld"],
            "sampling": correlated.sampling_text(
                cfg.cohorts, cfg.sampling_rate, protocol.cycle, protocol.sampling_rate
            ),
            **({} if protocol.correlated is None else correlated.summary(protocol.correlated)),
            "epsilon_by_accountant": by_accountant,
            "zcdp_conversion": "ε = ρ + 2·sqrt(ρ·log(1/δ)) (Bun & Steinke 2016, Prop. 1.3)",
            "zcdp_rho_for_target": zcdp_rho_for(cfg.epsilon, cfg.delta) if math.isfinite(cfg.epsilon) else math.inf,
        }
        if cfg.remedy is not Remedy.NONE:
            out["remedy_noise_multiplier"] = protocol.remedy_noise_multiplier
            out["remedy_noise_std"] = protocol.remedy_noise_std(cfg.neighbours)
        return out

    def plot_keys(self) -> tuple[str, ...]:
        return ("accuracy",)

    def describe(self, cfg: NoisyGDConfig, protocol: NoisyGDProtocol) -> dict[str, Any]:
        return {
            "grad_clip": protocol.grad_clip,
            "noise_multiplier": protocol.noise_multiplier,
            "noise_std_grad": protocol.noise_std(),
            "paper_noise_std_add_remove": protocol.noise_std() / 2,
            "note": "the paper's N(0, G²/(2ρ)) is for add/remove neighbours; replace-one doubles the sensitivity, so σ = 2G/sqrt(2ρ)",
            "remedy": protocol.remedy.value,
            "feature_bound": protocol.feature_bound,
            "remedy_noise_multiplier": protocol.remedy_noise_multiplier,
            "remedy_noise_std": protocol.remedy_noise_std(cfg.neighbours),
            "model_dim": protocol.model_dim,
        }

    def canary_design(self) -> CanaryDesign | None:
        return CANARY_DESIGN

    def reduced_config(self) -> dict[str, Any]:
        return {"examples": 1000, "feature_dim": 20, "steps": 5, "test_examples": 200}
