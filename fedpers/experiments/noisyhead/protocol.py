"""NoisyHead's numbers resolved from its config (the §6 regime's λ, η₀ and T; Theorem 4.1's C, G, R), the
noise calibrated to (ε, δ), and the protocol built from them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting
import torch

from fedpers import linalg
from fedpers.configs.noisyhead import (
    DEMO,
    Init,
    Mode,
    NoisyHeadConfig,
    Regime,
    Unit,
)
from fedpers.configs.privacy import Calibration
from fedpers.data import prompts as prompt_data
from fedpers.experiments.base import derived_seed
from fedpers.experiments.noisyhead.data import resolve_shape
from fedpers.privacy import (
    Calibrations,
    calibrate_noise_multiplier,
    check_rule_meets_target,
    correlated,
)
from fedpers.privacy.accountant import (
    accountant_name,
)
from fedpers.privacy.adaptive_clip import share_multiplier
from fedpers.protocols import noisyhead as nh
from fedpers.protocols.noisyhead import FORMULAS, NoisyHeadProtocol

# λ, the step-size constant c in η₀ = c·λ/(λ + G²)², and the rule for T, per regime.
REGIME_LAMBDA = {
    Regime.LOW_DIM: ("5", lambda n, d: 5.0),
    Regime.HIGH_DIM: ("N/D", lambda n, d: n / d),
    Regime.EARLY_STOPPING: ("N/D", lambda n, d: n / d),
    Regime.ROBUSTNESS: ("0.01", lambda n, d: 0.01),
    Regime.DEMO: (f"{DEMO.ridge_lambda:g}", lambda n, d: DEMO.ridge_lambda),
}
REGIME_STEP = {
    Regime.LOW_DIM: (3.17 / 5, "η₀ = 3.17/(5 + G²)² (= 0.634·λ/(λ + G²)²)"),
    Regime.HIGH_DIM: (0.07, "η₀ = 0.07·λ/(λ + G²)² (= 0.07ND/(N + DG²)² at λ = N/D)"),
    Regime.EARLY_STOPPING: (0.02 / 3, "η₀ = 0.02λ/(3(λ + G²)²)"),
    Regime.ROBUSTNESS: (0.7, "η₀ = 0.7·λ/(λ + G²)² (= 0.007/(0.01 + G²)² at λ = 0.01)"),
}
REGIME_STEPS = {
    Regime.LOW_DIM: "T = ⌈log(N^{5/2}) / −log(1 − λη₀)⌉",
    Regime.HIGH_DIM: "T = 5",
    Regime.EARLY_STOPPING: "T = ⌈log N / −log(1 − λη₀)⌉ (Proposition 4.1 with r = N)",
    Regime.ROBUSTNESS: "T = ⌈log N⌉",
    Regime.DEMO: f"T = {DEMO.steps}",
}


@dataclass(frozen=True)
class Resolved:
    """Every number a run uses, with the formula that produced it."""

    N: int
    L: int
    D: int
    lam: float
    eta: float
    T: int
    consts: nh.HeadConstants
    C: float
    G: float
    R: float
    noise_multiplier: float
    P: int
    rho: float
    formulas: dict[str, str]
    correlated: correlated.CorrelatedNoise | None = None
    """Poisson-sampled correlated noise: the mechanism chosen with the noise (its groups and their
    sampling rate decide the calibration); None otherwise (the protocol builds it)."""

    @property
    def units(self) -> int:
        return self.N // self.P


_RESOLVED: dict[NoisyHeadConfig, tuple[Resolved, Calibrations]] = {}


def resolve(cfg: NoisyHeadConfig, calibrations: Calibrations | None = None) -> Resolved:
    """Derived numbers of a (frozen, hashable) config; cached per config because calibration runs
    the accountant. ``calibrations`` serves a config's first resolution (a Flower node: the
    server's noise multiplier) and is told the noise multiplier on every later one."""
    if cfg not in _RESOLVED:
        used = calibrations if calibrations is not None else Calibrations()
        _RESOLVED[cfg] = (_resolve(cfg, used), used)
        while len(_RESOLVED) > 64:
            _RESOLVED.pop(next(iter(_RESOLVED)))
    r, used = _RESOLVED[cfg]
    if calibrations is not None and calibrations is not used:
        for key, z in used.table.items():
            calibrations.table.setdefault(key, z)
        from fedpers.privacy.distributed import RecordingCalibrations

        if isinstance(calibrations, RecordingCalibrations):  # a node-side plan solves the question asked: ask it again
            return _resolve(cfg, calibrations)  # (answered from the table just copied)
    return r


def _resolve(cfg: NoisyHeadConfig, calibrations: Calibrations) -> Resolved:
    N, L, D = resolve_shape(cfg)
    demo = cfg.regime is Regime.DEMO
    formulas: dict[str, str] = {}
    formulas["L"] = f"L = {cfg.context}" if cfg.context else (f"L = {L} (demo)" if demo else "L = ⌊√N⌋")
    formulas["D"] = f"D = {cfg.dim}" if cfg.dim else "D = ⌊√N⌋"
    if cfg.ridge_lambda:
        lam, formulas["lambda"] = cfg.ridge_lambda, "λ given (--ridge-lambda)"
    else:
        text, rule = REGIME_LAMBDA[cfg.regime]
        lam, formulas["lambda"] = rule(N, D), f"λ = {text} ({cfg.regime.value})"
    consts = nh.theorem41_constants(N, L, D, cfg.label_noise, cfg.kappa, lam)
    C = cfg.clip_c or (DEMO.clip_c if demo else consts.C)
    G = cfg.proj_g or (DEMO.proj_g if demo else consts.G)
    R = cfg.proj_r or (DEMO.proj_r if demo else consts.R)
    for key, given, value in (("C", cfg.clip_c, C), ("G", cfg.proj_g, G), ("R", cfg.proj_r, R)):
        formulas[key] = f"{key} given" if given else (f"{key} = {value:g} (demo)" if demo else FORMULAS[key])
    formulas["nu"], formulas["G0"] = FORMULAS["nu"], FORMULAS["G0"]
    if cfg.step_size:
        eta, formulas["eta"] = cfg.step_size, "η₀ given (--step-size)"
    elif demo:
        eta, formulas["eta"] = DEMO.step_size, f"η₀ = {DEMO.step_size:g} (demo)"
    else:
        c, text = REGIME_STEP[cfg.regime]
        eta, formulas["eta"] = c * lam / (lam + G**2) ** 2, text
    if not 0 < 2 * lam * eta < 2:
        raise ValueError(f"step_size: need 0 < 2λη₀ < 2 for GD to contract; got λ={lam:.4g}, η₀={eta:.4g}")
    if cfg.steps:
        T, formulas["T"] = cfg.steps, "T given (--steps)"
    else:
        T, formulas["T"] = _regime_steps(cfg.regime, N, lam, eta), REGIME_STEPS[cfg.regime]
    P = cfg.prompts_per_user if cfg.unit is Unit.USER else 1
    rho = cfg.user_clip if cfg.unit is Unit.USER else 1.0
    steps_per_unit = -(-T // correlated.cycle_of(cfg.cohorts, cfg.cycle))
    rate = cfg.sampling_rate
    share = cfg.clip_budget if cfg.clip_rule == "adaptive" else 0.0
    chosen = None
    if cfg.noise != "independent" and cfg.sampling_rate < 1:
        # b public id blocks of units taken in turn, each sampled at q·b (b = 1: plain Poisson); amplified
        def step_z(b: int) -> float:
            if math.isinf(cfg.epsilon):
                return 1.0
            steps, at = -(-T // b), min(1.0, cfg.sampling_rate * b)
            return calibrate_noise_multiplier(
                lambda z: step_event(z, steps, at, share),
                cfg.epsilon,
                cfg.delta,
                cfg.accountant,
                calibrations,
                cfg.neighbours,
            )

        chosen = correlated.sampled_mechanism(
            cfg.noise, T, cfg.bands, cfg.sampling_rate, step_z, _workload_decay(cfg, lam, eta)
        )
        steps_per_unit, rate = chosen.sensitivity.participations, chosen.sampling_rate
    if math.isinf(cfg.epsilon):
        z, formulas["noise_multiplier"] = 0.0, "ε = inf: no noise"
    elif cfg.calibration is Calibration.PAPER:
        z, formulas["noise_multiplier"] = (
            nh.paper_noise_multiplier(steps_per_unit, cfg.epsilon, cfg.delta),
            "z = 2T sqrt(2 log(1.25T/δ))/ε (paper: each step (ε/T, δ/T))",
        )
        check_rule_meets_target(
            "the paper's per-step (ε/T, δ/T) classical Gaussian noise",
            step_event(z, steps_per_unit, cfg.sampling_rate, 0.0),
            cfg.epsilon,
            cfg.delta,
            cfg.accountant,
        )
    else:
        z = calibrate_noise_multiplier(
            lambda z: step_event(z, steps_per_unit, rate, share),
            cfg.epsilon,
            cfg.delta,
            cfg.accountant,
            calibrations,
            cfg.neighbours,
        )
        sampled = f" Poisson-sampled at q = {cfg.sampling_rate:g}" if cfg.sampling_rate < 1 else ""
        formulas["noise_multiplier"] = (
            f"smallest z with ε({accountant_name(cfg.accountant)}, T-fold Gaussian{sampled}) ≤ target"
        )
    formulas["noise_std_step"] = "std of z_t entries = (η₀/N)·z·ρP·G(C + RG)"
    return Resolved(N, L, D, lam, eta, T, consts, C, G, R, z, P, rho, formulas, chosen)


def _regime_steps(regime: Regime, n: int, lam: float, eta: float) -> int:
    if regime is Regime.DEMO:
        return DEMO.steps
    if regime is Regime.HIGH_DIM:
        return 5
    if regime is Regime.ROBUSTNESS:
        return max(1, math.ceil(math.log(n)))
    rate = -math.log(1 - lam * eta) if lam * eta < 1 else math.inf
    target = 2.5 * math.log(n) if regime is Regime.LOW_DIM else math.log(n)
    return max(1, math.ceil(target / rate))


def step_event(
    noise_multiplier: float, steps: int, sampling_rate: float = 1.0, count_share: float = 0.0
) -> dp_accounting.DpEvent:
    """What one unit is touched by: T Gaussian releases with the same noise multiplier, each
    Poisson-sampled at q when q < 1. With adaptive clipping (``count_share`` f > 0) a step is a gradient
    release at z/√(1 − f) and a count at z/√f; on one Poisson sample the two are one sampled Gaussian z
    (the ledger's accountant merges them so), so only the unsampled event changes."""
    g: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(noise_multiplier)
    if count_share > 0 and sampling_rate >= 1:
        g = dp_accounting.ComposedDpEvent(
            [
                dp_accounting.GaussianDpEvent(share_multiplier(noise_multiplier, 1.0 - count_share)),
                dp_accounting.GaussianDpEvent(share_multiplier(noise_multiplier, count_share)),
            ]
        )
    if sampling_rate < 1:
        g = dp_accounting.PoissonSampledDpEvent(sampling_rate, g)
    return dp_accounting.SelfComposedDpEvent(g, steps)


def initial_gamma(cfg: NoisyHeadConfig, r: Resolved) -> tuple[float, ...]:
    if cfg.init is Init.ZERO:
        return ()
    g = prompt_data.generator(derived_seed(cfg.seed, "init"))
    v = 0.1 * torch.randn(r.D * r.D, generator=g, dtype=torch.float64)
    return tuple(linalg.clip_vectors(v, r.R).tolist())


def make_protocol(
    cfg: NoisyHeadConfig, r: Resolved | None = None, mode: Mode | None = None, calibrations: Calibrations | None = None
) -> NoisyHeadProtocol:
    r = r or resolve(cfg, calibrations)
    return NoisyHeadProtocol(
        prompts=r.N,
        dim=r.D,
        context=r.L,
        steps=r.T,
        step_size=r.eta,
        ridge_lambda=r.lam,
        clip_c=r.C,
        proj_g=r.G,
        proj_r=r.R,
        noise_multiplier=r.noise_multiplier,
        mode=mode or cfg.mode,
        prompts_per_unit=r.P,
        unit_clip=r.rho,
        gamma0=initial_gamma(cfg, r),
        unit_name=cfg.unit.value,
        sampling_rate=(r.correlated.sampling_rate if r.correlated is not None else cfg.sampling_rate)
        if (mode or cfg.mode) is Mode.ROUNDS
        else 1.0,
        cycle=r.correlated.cycle if r.correlated is not None else correlated.cycle_of(cfg.cohorts, cfg.cycle),
        correlated=r.correlated
        if r.correlated is not None or cfg.noise == "independent"
        else correlated.run_mechanism(cfg.noise, r.T, cfg.bands, cfg.cycle, workload_decay(cfg, r)),
        **(
            {"clip_quantile": cfg.clip_quantile, "clip_lr": cfg.clip_lr, "count_share": cfg.clip_budget}
            if cfg.clip_rule == "adaptive" and (mode or cfg.mode) is Mode.ROUNDS
            else {}
        ),
    )


def workload_decay(cfg: NoisyHeadConfig, r: Resolved) -> float:
    """λ_w of the correlated noise's workload: the one given, or (auto) GD's contraction 1 − 2λη₀ (the
    step Γ ← (1 − 2λη₀)Γ − (η₀/N)(g + noise) carries past noise forward by that factor, the projection
    aside); refused before any release when auto gives a value outside (0, 1]."""
    return _workload_decay(cfg, r.lam, r.eta)


def _workload_decay(cfg: NoisyHeadConfig, lam: float, eta: float) -> float:
    if cfg.noise_decay:
        return cfg.noise_decay
    decay = 1.0 - 2.0 * lam * eta
    if not 0.0 < decay <= 1.0:
        raise ValueError(
            f"noise_decay auto: GD's contraction 1 − 2λη₀ = {decay:.4g} is not in (0, 1]; give --noise-decay in (0, 1]"
        )
    return decay
