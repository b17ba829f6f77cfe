"""`fedpers run noisyhead`: prompt-level DP pretraining of a linear attention head (docs/algorithms.md §2).

The config names the §6 setting (``regime``) that supplies λ, η₀ and T when they are not given,
derives C, G, G₀, R, σ from Theorem 4.1 unless given, calibrates the noise (the paper's per-step
(ε/T, δ/T) classical Gaussian, or the tight PLD accountant), and reports the test excess risk
against the ridge solution Γ*, the non-private GD after the same T, test MSEs and the privacy.
Monte-Carlo sweeps (``fedpers sweep simulations/noisyhead_*.toml``) go through
:meth:`~fedpers.experiments.noisyhead_mc.NoisyHeadMonteCarloExperiment.sweep_point` (the registered
experiment), which batches all repetitions
(:mod:`fedpers.experiments.noisyhead_mc`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import dp_accounting
import torch

from fedpers import linalg, memory
from fedpers.config import (
    Neighbours,
    device_path,
)
from fedpers.configs.noisyhead import (
    DEMO,
    AttackNoise,
    DataSource,
    Init,
    Mode,
    NoisyHeadConfig,
    Regime,
    RidgeScaling,
    Unit,
)
from fedpers.configs.privacy import Calibration
from fedpers.data import prompts as prompt_data
from fedpers.experiments.base import Evaluator, Experiment, Trivial, derived_seed
from fedpers.experiments.hooks import LABEL_OVERSHOOT, Canaries, CanaryDesign
from fedpers.privacy import (
    Calibrations,
    Ledger,
    Privatizer,
    calibrate_noise_multiplier,
    correlated,
    ledger_epsilon,
)
from fedpers.privacy.accountant import (
    accountant_name,
)
from fedpers.privacy.adaptive_clip import share_multiplier
from fedpers.protocols import noisyhead as nh
from fedpers.protocols.noisyhead import FORMULAS, NoisyHeadProtocol

Tensor = torch.Tensor
STREAM_TRAIN, STREAM_TEST = 1, 2


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


# ----- data ------------------------------------------------------------------------------------
def prompts(cfg: NoisyHeadConfig, ids: Tensor, test: bool = False) -> tuple[Tensor, Tensor]:
    """Prompts (x (n, L+1, D), y (n, L+1)) with these ids on ``cfg.device``; prompt k depends only on (seed, k).

    Host path: drawn on the CPU and copied. Device path (``kernels``): synthetic prompts drawn on
    the device from the same keys (on the CPU the very same prompts; on a GPU other ones from the
    same distribution); real text is read on the host and copied.
    """
    r = resolve_shape(cfg)
    stream = STREAM_TEST if test else STREAM_TRAIN
    if cfg.data is DataSource.NEWSGROUPS:
        from fedpers.data import newsgroups

        x, y = newsgroups.text_prompts_by_id(cfg.seed, stream, ids, r[1], r[2], test=test)
    elif device_path(cfg.device, cfg.kernels):
        return prompt_data.prompts_by_id(cfg.seed, stream, ids, r[1], r[2], cfg.label_noise, device=cfg.device)
    else:
        x, y = prompt_data.prompts_by_id(cfg.seed, stream, ids, r[1], r[2], cfg.label_noise)
    return x.to(cfg.device), y.to(cfg.device)


def resolve_shape(cfg: NoisyHeadConfig) -> tuple[int, int, int]:
    """N, L, D: a 0 context is ⌊√N⌋ (the demo regime's own L in the demo regime), a 0 dim ⌊√N⌋."""
    root = math.isqrt(cfg.prompts)
    context = DEMO.context if cfg.regime is Regime.DEMO else root
    return cfg.prompts, cfg.context or context, cfg.dim or root


def load_units(cfg: NoisyHeadConfig, ids: Tensor) -> dict[str, Tensor]:
    """Units with these ids: unit u holds prompts uP..uP+P−1 (P = 1 at the prompt level)."""
    P = cfg.prompts_per_user if cfg.unit is Unit.USER else 1
    ids = ids.to(cfg.device, torch.int64)
    prompt_ids = (ids.unsqueeze(-1) * P + torch.arange(P, device=ids.device)).reshape(-1)
    x, y = prompts(cfg, prompt_ids)
    return group_units(x, y, P, ids)


def group_units(x: Tensor, y: Tensor, P: int, ids: Tensor | None = None) -> dict[str, Tensor]:
    """Prompts (n·P, L+1, D) -> units (n, P, L+1, D) with their ids (default 0..n−1)."""
    n = x.shape[0] // P
    ids = torch.arange(n, device=x.device) if ids is None else ids
    return {"ids": ids, "x": x.reshape(n, P, *x.shape[1:]), "y": y.reshape(n, P, y.shape[-1])}


# ----- evaluation ------------------------------------------------------------------------------
def sherman_morrison_replace(M_i: Tensor, rhs_i: Tensor, z_new: Tensor, y_new: Tensor) -> Tensor:
    """(M_i + z zᵀ)⁻¹(rhs_i + y z), stably, from the well-conditioned M_i; batched.

    Needed for the robustness attack: ||z'||² reaches 1e18 while M_i's eigenvalues are O(N), so a
    direct solve of the perturbed system is at the edge of float64 (condition number ~1e16).
    """
    chol = torch.linalg.cholesky(M_i)
    g0 = torch.cholesky_solve(rhs_i.unsqueeze(-1), chol).squeeze(-1)
    u = torch.cholesky_solve(z_new.unsqueeze(-1), chol).squeeze(-1)
    s = (z_new * u).sum(-1)
    return g0 + u * ((y_new - (z_new * g0).sum(-1)) / (1 + s)).unsqueeze(-1)


def attack_prompt(x: Tensor, y: Tensor, mu: float, alpha: float) -> tuple[Tensor, Tensor]:
    """(5.1): x' = x + μ·1 on all L+1 tokens, y' = y + α on the L context labels (the query label is kept)."""
    y2 = y.clone()
    y2[..., :-1] = y2[..., :-1] + alpha
    return x + mu, y2


class NoisyHeadEvaluator(Evaluator):
    """Γ*, non-private GD and test metrics from the raw (unclipped) data of all N prompts."""

    def __init__(self, cfg: NoisyHeadConfig, protocol: NoisyHeadProtocol) -> None:
        self.cfg, self.protocol, self.r = cfg, protocol, resolve(cfg)
        N = self.r.N
        x, y = prompts(cfg, torch.arange(N, device=cfg.device))
        self.z, self.yq = nh.prompt_vectors(x, y)
        self.A, self.b = nh.gram_statistics(self.z, self.yq)
        self.gamma_star = nh.ridge(self.A, self.b, N, self.r.lam, cfg.ridge_scaling)
        xt, yt = prompts(cfg, torch.arange(cfg.test_prompts, device=cfg.device), test=True)
        self.z_test, self.y_test = nh.prompt_vectors(xt, yt)
        self._train = (x, y)

    def excess(self, gamma: Tensor, ref: Tensor | None = None) -> float:
        ref = self.gamma_star if ref is None else ref
        return float(((self.z_test @ (gamma.to(self.z_test) - ref)) ** 2).mean())

    def mse(self, gamma: Tensor) -> float:
        return float(((self.y_test - self.z_test @ gamma.to(self.z_test)) ** 2).mean())

    def round_metrics(self, round: int, state: Any) -> dict[str, float]:
        return {"excess_risk": self.excess(state["gamma"])}

    def theorem_bound(self) -> float:
        """Right side of (4.2): G₀²((1 − η₀λ)^T R² + σ²η₀²D T² log(2T/δ)/(N²ε²)), σ = 2G(C + RG)."""
        r, cfg = self.r, self.cfg
        sigma = 2 * r.G * (r.C + r.R * r.G)
        scale = (r.N * cfg.epsilon) ** 2  # 0.0 once ε is so small that (Nε)² underflows: the bound is vacuous
        noise = (
            0.0
            if math.isinf(cfg.epsilon)
            else sigma**2 * r.eta**2 * r.D * r.T**2 * math.log(2 * r.T / cfg.delta) / scale
            if scale > 0
            else math.inf
        )
        return r.consts.G0**2 * ((1 - r.eta * r.lam) ** r.T * r.R**2 + noise)

    def final(self, state: Any) -> dict[str, Any]:
        gamma = state["gamma"].to(self.z_test)
        r = self.r
        gamma0 = self.protocol.initial_gamma().to(self.z_test)
        gamma_gd = nh.gd(self.A, self.b, gamma0, r.N, r.lam, r.eta, r.T)
        out: dict[str, Any] = {
            "excess_risk": self.excess(gamma),
            "test_mse": self.mse(gamma),
            "gamma_norm": float(torch.linalg.vector_norm(gamma)),
            "theorem41_bound": self.theorem_bound(),
            "Gamma": nh.vec_to_gamma(gamma).tolist(),
        }
        out["baselines"] = {
            "ridge": {
                "excess_risk": 0.0,
                "test_mse": self.mse(self.gamma_star),
                "gamma_norm": float(torch.linalg.vector_norm(self.gamma_star)),
            },
            "nonprivate_gd": {"excess_risk": self.excess(gamma_gd), "test_mse": self.mse(gamma_gd)},
            "zero_head": {
                "excess_risk": self.excess(torch.zeros_like(gamma)),
                "test_mse": self.mse(torch.zeros_like(gamma)),
            },
        }
        if self.cfg.attack_c > 0:
            out.update(self.robustness())
        return out

    def robustness(self) -> dict[str, float]:
        """§6.3 for this seed: rerun NoisyHead and the ridge with one prompt perturbed as in (5.1)."""
        from fedpers.runtime.local import run_local

        cfg, r = self.cfg, self.r
        i = int(torch.randint(r.N, (1,), generator=prompt_data.generator(derived_seed(cfg.seed, "attack"))))
        alpha = cfg.attack_c * r.N**cfg.attack_p
        x, y = self._train
        xb, yb = attack_prompt(x[i], y[i], cfg.attack_mu, alpha)
        zb, _ = nh.prompt_vectors(xb, yb)
        k = self.z.shape[-1]
        M_i = (
            self.A
            - torch.outer(self.z[i], self.z[i])
            + cfg.ridge_scaling.factor * r.lam * r.N * torch.eye(k, dtype=torch.float64, device=self.z.device)
        )
        ridge_bad = sherman_morrison_replace(M_i, self.b - self.yq[i] * self.z[i], zb, self.yq[i])
        x2, y2 = x.clone(), y.clone()
        x2[i], y2[i] = xb, yb
        units = group_units(x2, y2, r.P)
        # The runner's DP-noise seed is the server's secret, so the clean run is redone here
        # with the attacked run's noise (shared) or with independent noise.
        proto = replace(self.protocol, mode=Mode.STATISTICS)
        seed = derived_seed(cfg.seed, "robustness-noise")
        clean, _ = run_local(proto, group_units(x, y, r.P), Privatizer(seed, neighbours=cfg.neighbours), progress=False)
        if cfg.attack_noise is not AttackNoise.SHARED:
            seed = derived_seed(cfg.seed, "robustness-noise-attacked")
        state, _ = run_local(proto, units, Privatizer(seed, neighbours=cfg.neighbours), progress=False)
        return {
            "robust_noisyhead": self.excess(clean["gamma"], state["gamma"]),
            "robust_ridge": self.excess(self.gamma_star, ridge_bad),
            "attack_alpha": alpha,
            "attacked_prompt": i,
        }


# ----- the experiment --------------------------------------------------------------------------
# ----- optional hook: audit canaries -------------------------------------------------------------
def audit_protocol(cfg: NoisyHeadConfig, k: int, calibrations: Calibrations | None = None) -> NoisyHeadProtocol:
    """The configured protocol (its N, C, G, R and noise) in rounds mode: each step's gradient is a
    release the auditor sees, and statistics mode releases the same Γ̂ for the same noise."""
    if cfg.cohorts != "all" or cfg.noise != "independent":
        raise ValueError("cohorts/noise: the noisyhead audit's canaries take part in every step with independent noise")
    if cfg.clip_rule != "fixed":
        raise ValueError(
            "clip_rule: the noisyhead audit's canaries sit at the analytic bound; audit without --clip-rule adaptive"
        )
    if cfg.unit.value != "prompt" or cfg.sampling_rate != 1.0:
        raise ValueError(
            "unit/sampling_rate: the noisyhead audit has prompt-level, unsampled canaries; use --unit prompt without --sampling-rate"
        )
    return make_protocol(cfg, mode=Mode.ROUNDS, calibrations=calibrations)


def audit_canaries(protocol: NoisyHeadProtocol, generator: torch.Generator, k: int) -> Canaries:
    """Canary i on the coordinate (a, b) = divmod(i, D) of Γ: context tokens e_b with labels 1.5C,
    query e_a, so Z̃_i = G·e_a e_bᵀ (projection binds); the query label is ±1.5C (ỹ = ±C). Each
    step's gradient (<Γ, Z̃> − ỹ) Z̃ then differs by 2CG between the versions, of the bound's
    2G(C + RG): the <Γ, Z̃> part is the same in both (the data cannot know Γ in advance)."""
    p = protocol
    D, L = p.dim, p.context
    x = torch.zeros(k, 1, L + 1, D, dtype=torch.float64)
    y = torch.full((k, 1, L + 1), LABEL_OVERSHOOT * p.clip_c, dtype=torch.float64)
    idx = torch.arange(k)
    a, b = idx // D, idx % D
    eye = torch.eye(D, dtype=torch.float64)
    x[:, 0, :L] = eye[b][:, None, :]
    x[:, 0, L] = eye[a]
    y_minus = y.clone()
    y_minus[:, 0, L] = -LABEL_OVERSHOOT * p.clip_c
    dtype = p.dtype
    return Canaries(
        {"ids": idx, "x": x.to(dtype), "y": y.to(dtype)},
        {"ids": idx, "x": x.to(dtype), "y": y_minus.to(dtype)},
        "coordinate (a, b) of Γ per canary; Z̃ at its projection radius G, query label ±C",
    )


CANARY_DESIGN = CanaryDesign(
    audit_protocol,
    lambda p: p.dim**2,
    audit_canaries,
    "every step's noisy gradient (rounds mode; statistics mode releases the same Γ̂ law)",
    "replace-one prompt (a canary's two versions are the same prompt with a different query label)",
)


class NoisyHeadExperiment(Experiment[NoisyHeadConfig, NoisyHeadProtocol]):
    """NoisyHead: prompt-level DP gradient descent on a linear attention head (docs/algorithms.md §2)."""

    round_axis = "round (--mode rounds: one gradient step each)"

    name = "noisyhead"
    result_keys = (
        "excess_risk",
        "test_mse",
        "gamma_norm",
        "theorem41_bound",
        "robust_noisyhead",
        "robust_ridge",
        # a sweep's vectorised points (noisyhead_mc.sweep_point) also give these
        "gd_excess_risk",
        "ridge_test_mse",
        "gd_test_mse",
        "robust_ridge_naive_solve",
        "epsilon_spent",
        "paper_epsilon",
        "ridge_lambda",
        "step_size",
        "steps",
    )
    baseline_names = ("ridge", "nonprivate_gd", "zero_head")
    config_type = NoisyHeadConfig

    def trivial_baselines(self, cfg: NoisyHeadConfig) -> list[Trivial]:
        why = "the gradient noise swamps the signal: too few prompts N for this ε (raise --prompts or --epsilon"
        if cfg.calibration is Calibration.PAPER:
            why += "; --calibration accountant adds the smallest noise that meets (ε, δ), the paper's per-step rule adds far more"
        return [Trivial("excess_risk", "zero_head", why=why + ")")]

    def result_warnings(self, cfg: NoisyHeadConfig, result: Mapping[str, Any]) -> list[dict[str, Any]]:
        warnings = super().result_warnings(cfg, result)
        base = result.get("baselines", {})
        ridge, zero = base.get("ridge", {}).get("test_mse"), base.get("zero_head", {}).get("test_mse")
        if warnings and isinstance(ridge, float) and isinstance(zero, float) and ridge > 0.99 * zero:
            for w in warnings:  # the target itself is no better than predicting 0: say so, it is the real reason
                w["text"] += (
                    f"; note that the ridge target Γ* itself predicts no better than the zero head (test MSE "
                    f"{ridge:.4g} against {zero:.4g}): this regime's λ shrinks it to about 0, so lower --ridge-lambda "
                    "for a task with something to learn"
                )
        return warnings

    def protocol(self, cfg: NoisyHeadConfig, calibrations: Calibrations | None = None) -> NoisyHeadProtocol:
        self.plan(cfg)
        return make_protocol(cfg, calibrations=calibrations)

    def plan(self, cfg: NoisyHeadConfig) -> list[str]:
        """Prompts (train and test, float64) and the D²×D² statistics (sum, Γ* solve, eigenbasis)."""
        r = resolve(cfg)
        k = r.D * r.D
        need = {
            "prompts": (r.N + cfg.test_prompts) * (r.L + 1) * (r.D + 1) * 8 * 2,
            "statistics": k * k * 8 * 4 + min(cfg.chunk_size, r.N) * k * 8 * 4,
        }
        return memory.check_fits("noisyhead", need, "use fewer prompts or a smaller dimension D")

    def num_units(self, cfg: NoisyHeadConfig) -> int:
        return resolve(cfg).units

    def units(self, cfg: NoisyHeadConfig, ids: Tensor) -> dict[str, Tensor]:
        return load_units(cfg, ids)

    def evaluator(self, cfg: NoisyHeadConfig, protocol: NoisyHeadProtocol) -> NoisyHeadEvaluator:
        return NoisyHeadEvaluator(cfg, protocol)

    def privacy_summary(self, cfg: NoisyHeadConfig, protocol: NoisyHeadProtocol, ledger: Ledger) -> dict[str, Any]:
        r = resolve(cfg)
        eps = ledger_epsilon(ledger, cfg.delta, cfg.accountant)
        z = protocol.noise_multiplier
        out = {
            "epsilon": eps,
            "delta": cfg.delta,
            "target_epsilon": cfg.epsilon,
            "accountant": accountant_name(cfg.accountant),
            "calibration": cfg.calibration.value,
            "neighbouring": f"{cfg.neighbours.value} prompt"
            if r.P == 1
            else f"{cfg.neighbours.value} user ({r.P} prompts, statistics clipped per user)",
            "neighbours": cfg.neighbours.value,
            "noise_multiplier": z,
            "releases": len(ledger),
            "per_unit_bound": protocol.grad_bound,
            "sensitivity": cfg.neighbours.sensitivity_factor * protocol.grad_bound,
            "noise_std_sum": protocol.noise_std_sum,
            "noise_std_step": protocol.noise_std_step,
        }
        if cfg.neighbours is Neighbours.REPLACE_ONE:  # the paper's per-step rule is stated for replace-one
            out["paper_epsilon_same_noise"] = nh.paper_epsilon(z, r.T, cfg.delta)
        if protocol.adaptive:
            out["clip_rule"] = (
                f"adaptive γ={protocol.clip_quantile}, η_C={protocol.clip_lr}, count share f={protocol.count_share}"
            )
        if protocol.correlated is not None:
            out.update(correlated.summary(protocol.correlated))
        if cfg.mode is Mode.ROUNDS:
            cohorts = "poisson" if cfg.sampling_rate < 1 else cfg.cohorts
            out["sampling"] = correlated.sampling_text(
                cohorts, cfg.sampling_rate, protocol.cycle, protocol.sampling_rate
            )
        if not math.isinf(cfg.epsilon) and cfg.neighbours is Neighbours.REPLACE_ONE:
            paper_z = nh.paper_noise_multiplier(r.T, cfg.epsilon, cfg.delta)
            tight_z = (
                z
                if cfg.calibration is Calibration.ACCOUNTANT
                else calibrate_noise_multiplier(lambda v: step_event(v, r.T), cfg.epsilon, cfg.delta, cfg.accountant)
            )
            out["paper_noise_multiplier"] = paper_z
            out["accountant_noise_multiplier"] = tight_z
            out["paper_over_accountant_noise"] = paper_z / tight_z
        return out

    def plot_keys(self) -> tuple[str, ...]:
        return ("excess_risk",)

    def describe(self, cfg: NoisyHeadConfig, protocol: NoisyHeadProtocol) -> dict[str, Any]:
        r = resolve(cfg)
        values = {
            "N": r.N,
            "L": r.L,
            "D": r.D,
            "lambda": r.lam,
            "eta": r.eta,
            "T": r.T,
            "nu": r.consts.nu,
            "C": r.C,
            "G": r.G,
            "G0": r.consts.G0,
            "R": r.R,
            "sigma": 2 * r.G * (r.C + r.R * r.G),
            "noise_multiplier": r.noise_multiplier,
            "per_unit_bound": protocol.grad_bound,
            "noise_std_sum": protocol.noise_std_sum,
            "noise_std_step": protocol.noise_std_step,
            "step_sensitivity": protocol.step_sensitivity,
            "prompts_per_unit": r.P,
            "unit_clip": r.rho,
        }
        return {
            **values,
            "theorem41": {"C": r.consts.C, "G": r.consts.G, "G0": r.consts.G0, "R": r.consts.R},
            "formulas": {
                **r.formulas,
                "sigma": FORMULAS["sigma"],
                "per_unit_bound": "ρP·G(C + RG)",
                "step_sensitivity": "(η₀/N)·2ρP·G(C + RG)",
            },
            "mode": protocol.mode.value,
            "ridge": "vec Γ* = (2λN I + Σ vec Z vec Zᵀ)⁻¹ Σ y vec Z (matches GD's objective)"
            if cfg.ridge_scaling is RidgeScaling.MATCHED
            else "vec Γ* = (λN I + Σ vec Z vec Zᵀ)⁻¹ Σ y vec Z (eq. 2.7)",
        }

    def canary_design(self) -> CanaryDesign | None:
        return CANARY_DESIGN

    def reduced_config(self) -> dict[str, Any]:
        return {"prompts": 2000, "test_prompts": 200}
