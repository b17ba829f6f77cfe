"""`fedpers run fedrep`: (private) FedRep with a private, accounted initialisation.

Synthetic users as AltMin's (x ~ N(0, I_d), y = ⟨U*ᵀx, v*_j⟩ + N(0, σ_F²); v*_j uniform on the
unit sphere by default, as in the paper, or N(0, I_k) as AltMin's),
each with m training samples (the only ones the protocol reads), R refit samples and S test
samples, all generated from (seed, user id). ``population_mse`` is the mean over users of the
test MSE after refitting v_j on the R refit samples with the final U (the paper's metric).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from fedpers import linalg, metrics
from fedpers.config import (
    device_path,
)
from fedpers.configs.fedrep import BASELINES, FedRepConfig, VStar, baseline_names
from fedpers.configs.privacy import accountant_name
from fedpers.data import synthetic
from fedpers.data.units import UnitSource
from fedpers.experiments.altmin import AltMinConfig
from fedpers.experiments.altmin import make_protocol as altmin_protocol
from fedpers.experiments.altmin_baselines import nonprivate_altmin
from fedpers.experiments.base import Evaluator, Experiment, Trivial, derived_seed
from fedpers.experiments.hooks import Canaries, CanaryDesign
from fedpers.experiments.population import population_mse
from fedpers.experiments.shared_passes import ReferenceRun, ShadowRun
from fedpers.privacy import (
    Calibrations,
    Ledger,
    Privatizer,
    calibrate_noise_multiplier,
    correlated,
    ledger_epsilon,
)
from fedpers.protocols.altmin import AltMinProtocol
from fedpers.protocols.base import Units
from fedpers.protocols.fedrep import FedRepProtocol, default_zeta
from fedpers.runtime.local import Companion, run_local

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


class FedRepEvaluator(Evaluator):
    def __init__(self, cfg: FedRepConfig) -> None:
        self.cfg, self.u_star = cfg, truth(cfg).to(cfg.device)  # beside the released U it is compared with
        self.source = source(cfg, ("ids", "x_refit", "y_refit", "x_test", "y_test"))
        self.init_U: Tensor | None = None
        self.shadow: ShadowRun | None = None
        self.reference: ReferenceRun | None = None

    def state_dict(self) -> dict[str, Tensor]:
        return {} if self.init_U is None else {"init_U": self.init_U}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self.init_U = state.get("init_U", self.init_U)

    def round_metrics(self, round: int, state: Any) -> dict[str, float]:
        if round == 0:
            self.init_U = state["U"]
        return {"subspace_error": metrics.subspace_error(state["U"], self.u_star)}

    def companions(self) -> list[Companion]:
        """Both baselines in the private run's passes, when every round reads every user with all
        of its training samples (``--cohorts all``): Priv-AltMin's round r in the run's round r
        (its clients on the same chunks, its cohort's users of each), the non-private reference's
        spectral pass and first rounds in the run's rounds (:class:`ReferenceRun`; it goes on
        alone after the run). Other cohorts read subsets: the baselines run alone, as before."""
        if self.cfg.cohorts != "all":
            return []
        wanted = baseline_names(self.cfg.baselines)
        out: list[Companion] = []
        setup = self._priv_altmin_setup() if "priv_altmin" in wanted else None
        if setup is not None:
            proto, privatizer, _, quarters = setup
            self.shadow = ShadowRun(proto, privatizer, same_client=False, units_map=quarters)
            out.append(self.shadow)
        if "nonprivate_altmin" in wanted:
            self.reference = ReferenceRun(self.cfg.rank)
            out.append(self.reference)
        return out

    def final(self, state: Any) -> dict[str, Any]:
        Us = {"private": state["U"], "oracle": self.u_star.to(state["U"].dtype)}
        extra: dict[str, dict[str, Any]] = {"oracle": {}}
        if self.init_U is not None:
            Us["private_init_only"], extra["private_init_only"] = self.init_U, {}
        wanted = baseline_names(self.cfg.baselines)
        train = source(self.cfg, ("ids", "x", "y"))
        if "priv_altmin" in wanted:
            U, extra["priv_altmin"] = self.priv_altmin(train)
            if U is not None:
                Us["priv_altmin"] = U
        if "nonprivate_altmin" in wanted:
            ridden = self.reference if self.reference is not None and self.reference.usable else None
            Us["nonprivate_altmin"], rounds = nonprivate_altmin(
                train, self.cfg.rank, self.cfg.chunk_size, resume=None if ridden is None else ridden.steps
            )
            extra["nonprivate_altmin"] = {"rounds": rounds}
        mse = population_mse(self.source, Us, self.cfg.chunk_size)
        rows = {
            name: {"subspace_error": metrics.subspace_error(U, self.u_star), "population_mse": mse[name]}
            for name, U in Us.items()
        }
        out: dict[str, Any] = rows.pop("private")
        out["baselines"] = {name: {**rows.get(name, {}), **info} for name, info in extra.items()}
        return out

    def _priv_altmin_setup(
        self,
    ) -> tuple[AltMinProtocol, Privatizer, Ledger, Callable[[Units], Units]] | None:
        """Priv-AltMin's protocol at the run's (ε, δ), its own privatizer and ledger, and the map
        from a chunk of training units to its own (the first 4·⌊m/4⌋ samples); None if m < 4."""
        cfg = self.cfg
        q4 = 4 * (cfg.samples_per_user // 4)
        if q4 == 0:
            return None
        acfg = AltMinConfig(
            n_users=cfg.n_users,
            dim=cfg.dim,
            rank=cfg.rank,
            samples_per_user=q4,
            noise_std=cfg.noise_std,
            epsilon=cfg.epsilon,
            delta=cfg.delta,
            rounds=cfg.rounds,
            accountant=cfg.accountant,
            seed=cfg.seed,
            neighbours=cfg.neighbours,
            dtype=cfg.dtype,
            device=cfg.device,
            kernels=cfg.kernels,
            chunk_size=cfg.chunk_size,
            baselines="none",
        )
        ledger = Ledger()
        privatizer = Privatizer(derived_seed(cfg.seed, "priv_altmin_noise"), ledger, neighbours=cfg.neighbours)

        def quarters(units: Units) -> Units:
            return {k: (v[:, :q4] if k in ("x", "y") else v) for k, v in units.items()}

        return altmin_protocol(acfg), privatizer, ledger, quarters

    def priv_altmin(self, train: UnitSource) -> tuple[Tensor | None, dict[str, Any]]:
        """Priv-AltMin (``run altmin``'s protocol, disjoint cohorts) on the same users at the same
        (ε, δ): it splits samples into 4 quarters, so it reads the first 4·⌊m/4⌋ training samples
        (m = 5: samples 1–4, one per quarter; the 5th is unused), then is refitted and tested
        exactly like FedRep. Its own ledger and noise generator; ε is reported beside it. Read in
        the private run's passes where :meth:`companions` could (the same noise draws; sums
        chunked otherwise, so equal to float rounding), else a run of its own."""
        cfg = self.cfg
        q4 = 4 * (cfg.samples_per_user // 4)
        if self.shadow is not None and self.shadow.complete:
            proto, ledger, U = self.shadow.protocol, self.shadow.privatizer.ledger, self.shadow.state["U"]
        else:
            setup = self._priv_altmin_setup()
            if setup is None:
                return None, {"skipped": "m < 4: Priv-AltMin needs 4 sample quarters"}
            proto, privatizer, ledger, quarters = setup
            own = UnitSource(cfg.n_users, lambda a, b: quarters(train.slice(a, b)), cfg.device)
            state, _ = run_local(proto, own, privatizer, chunk_size=cfg.chunk_size, progress=False)
            U = state["U"]
        assert isinstance(proto, AltMinProtocol) and ledger is not None
        eps = ledger_epsilon(ledger, cfg.delta, cfg.accountant) if not math.isinf(cfg.epsilon) else math.inf
        return U, {"epsilon": eps, "samples_used": q4, "cohorts": proto.cohorts.value}


# ----- optional hook: audit canaries -------------------------------------------------------------
FEDREP_LABEL = 1e3
"""FedRep canaries' labels are this many times ζ: G_j grows as the labels squared, so the clip C binds in
every round whatever U is (at 1.5ζ it did not always). The init's label clip is then checked by the server's
norm check (a missing clip aborts the run) rather than by the audit."""


def audit_protocol(cfg: FedRepConfig, k: int, calibrations: Calibrations | None = None) -> FedRepProtocol:
    """The configured protocol for a population of ``k`` canary users (with cyclic cohorts a canary
    takes part in its cohort's rounds; with correlated noise the scorer decorrelates the stream)."""
    if cfg.clip_rule != "fixed":
        raise ValueError(
            "clip_rule: the fedrep audit's canaries sit at a fixed clip; audit without --clip-rule adaptive"
        )
    return make_protocol(replace(cfg, n_users=k, chunk_size=max(k, 1)), calibrations)


def _canary_layout(p: FedRepProtocol) -> tuple[int, int]:
    """(j, width): j init pairs on their own extra coordinates, width = k + 1 coordinates per canary."""
    odd = p.samples_per_user % 2
    j = p.rank - odd
    if p.pairs - j < 1:
        raise ValueError(
            f"samples_per_user: the fedrep audit needs m >= {2 * p.rank + 1} for rank {p.rank} (k + 1 feature directions per canary); got {p.samples_per_user}"
        )
    return j, p.rank + 1


def fedrep_init_fraction(p: FedRepProtocol) -> float:
    """||W⁺ − W⁻||/(2·bound) of a FedRep canary: sqrt((p − j)² + j)/p (p pairs, j of them off e_c0)."""
    j, _ = _canary_layout(p)
    return math.sqrt((p.pairs - j) ** 2 + j) / p.pairs


def audit_canaries(protocol: FedRepProtocol, generator: torch.Generator, count: int) -> Canaries:
    """Canary i owns the k + 1 coordinates c_0..c_k of block i of R^d (fewer would make every G_j = 0:
    the least-squares residual is orthogonal to U, so g_j needs k + 1 feature directions). Pairs: the
    first p − j on e_c0, then one pair on each of e_c1..e_cj (j = k, or k − 1 when m is odd and the last,
    unpaired sample sits on e_ck). "+": every label Lζ; "−": each pair's labels (Lζ, −Lζ), the
    unpaired one 0. Init: W = ±ζ²(Σ_pairs e e ᵀ), a fraction sqrt((p − j)² + j)/p of the 2·bound
    sensitivity. Rounds: "−" has Σ_c-group labels 0, so v_j = 0 and G_j = 0; "+" has G_j at the clip C
    (C of the 2C sensitivity): the sign-symmetric worst case needs U, which fixed data cannot know."""
    p = protocol
    j, width = _canary_layout(p)
    m, d = p.samples_per_user, p.dim
    coord = torch.zeros(m, dtype=torch.long)
    for pair in range(p.pairs):
        coord[2 * pair : 2 * pair + 2] = max(0, pair - (p.pairs - j) + 1)
    if m % 2:
        coord[-1] = p.rank
    eye = torch.eye(d, dtype=torch.float64)
    blocks = 2 if _two_blocks(p) else 1
    base = torch.arange(count)[:, None] * width * blocks
    x = eye[base + coord[None, :]]  # (count, m, d)
    label = FEDREP_LABEL * p.zeta
    y = torch.full((count, m), label, dtype=torch.float64)
    ids = torch.arange(count)
    dtype = p.dtype
    if blocks == 2:
        x_minus = eye[base + width + coord[None, :]]  # the "+" data moved to the canary's second block
        return Canaries(
            {"ids": ids, "x": x.to(dtype), "y": y.to(dtype)},
            {"ids": ids, "x": x_minus.to(dtype), "y": y.to(dtype)},
            f'2(k + 1) coordinates per canary, the same data on its first block ("+") or its second ("−"): '
            f"init W at {fedrep_init_fraction(p) / math.sqrt(2):.3f} of its sensitivity, every round's G at the clip C "
            "on orthogonal rows (√2·C of the 2C sensitivity)",
        )
    y_minus = y.clone()
    y_minus[:, 1 : 2 * p.pairs : 2] = -label
    if m % 2:
        y_minus[:, -1] = 0.0
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y.to(dtype)},
        {"ids": ids, "x": x.to(dtype), "y": y_minus.to(dtype)},
        f'k + 1 coordinates per canary; init W at {fedrep_init_fraction(p):.3f} of its sensitivity, G at the clip C in "+", 0 in "−"',
    )


def _two_blocks(p: FedRepProtocol) -> bool:
    """With T ≥ 2 rounds a canary whose versions sit on two orthogonal blocks separates more: its G
    differs by √2·C every round (T/2 against T/4 of μ²) at the cost of W (f²/2 against f²)."""
    return p.rounds >= 2


def _capacity(p: FedRepProtocol) -> int:
    return p.dim // ((p.rank + 1) * (2 if _two_blocks(p) else 1))


def steer_canaries(p: FedRepProtocol, round: int, broadcast: Mapping[str, Tensor], cans: Canaries) -> Canaries:
    """White-box canaries for round ≥ 1, rebuilt from its broadcast U: both versions keep the "+"
    samples x (first block); labels y± = y⊥ ± XUv₀ with y⊥ ∈ col(X) orthogonal to col(XU) (public,
    fixed per canary and round) and v₀ a fixed direction of R^k at Lζ. Then v = ±v₀, the residual is
    −y⊥ in both and g = −(2/m)Xᵀy⊥ ≠ 0, so G⁻ = −G⁺ at the clip C: the round's full 2C sensitivity,
    which fixed data cannot reach (G is sign-blind in the labels). Round 0 (W) keeps ``cans``."""
    if round == 0:
        return cans
    U = broadcast["U"].to(torch.float64)
    x = cans.plus["x"].to(torch.float64)
    n, m, _ = x.shape
    label = FEDREP_LABEL * p.zeta
    y_plus, y_minus = torch.empty(n, m, dtype=torch.float64), torch.empty(n, m, dtype=torch.float64)
    for i in range(n):
        public = torch.Generator().manual_seed(derived_seed(round, f"fedrep-steer-{i}"))
        X = x[i]
        XU = X @ U
        t = X @ torch.randn(X.shape[1], generator=public, dtype=torch.float64)
        perp = t - XU @ linalg.lstsq(XU, t.unsqueeze(-1)).squeeze(-1)
        perp = perp * (label * math.sqrt(m) / torch.linalg.vector_norm(perp).clamp_min(1e-300))
        v0 = torch.randn(U.shape[1], generator=public, dtype=torch.float64)
        v0 = v0 * (label / torch.linalg.vector_norm(v0))
        y_plus[i], y_minus[i] = perp + XU @ v0, perp - XU @ v0
    dtype = p.dtype
    ids = cans.plus["ids"]
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y_plus.to(dtype)},
        {"ids": ids, "x": x.to(dtype), "y": y_minus.to(dtype)},
        cans.design + "; rounds ≥ 1 steered from U: G at ±C (2C apart)",
        cans.as_released,
    )


CANARY_DESIGN = CanaryDesign(
    audit_protocol,
    _capacity,
    audit_canaries,
    "init W, and every round's G",
    "replace-one user (a canary's two versions are the same user with different labels)",
    steer=steer_canaries,
)


class FedRepExperiment(Experiment[FedRepConfig, FedRepProtocol]):
    """Private FedRep (Snedeker, Zhou, Bassily 2025) with a private, accounted initialisation."""

    round_axis = "round (0 = private initialisation)"

    def trivial_baselines(self, cfg: FedRepConfig) -> list[Trivial]:
        why = (
            "the private gradient rounds made the initialisation worse: too few users for this ε and --rounds "
            "(raise --n-users or --epsilon, use fewer --rounds, or a --clip nearer the gradients' norms)"
        )
        return [
            Trivial("population_mse", "private_init_only", why=why),
            Trivial("subspace_error", "private_init_only", why=why),
        ]

    name = "fedrep"
    result_keys = ("subspace_error", "population_mse")
    baseline_names = ("oracle", "private_init_only", *BASELINES)
    config_type = FedRepConfig
    primary_metric = "population_mse"

    def protocol(self, cfg: FedRepConfig, calibrations: Calibrations | None = None) -> FedRepProtocol:
        return make_protocol(cfg, calibrations)

    def num_units(self, cfg: FedRepConfig) -> int:
        return cfg.n_users

    def units(self, cfg: FedRepConfig, ids: Tensor) -> dict[str, Tensor]:
        return {k: v for k, v in load_all(cfg, ids, test=False).items() if k in ("ids", "x", "y")}

    def unit_source(self, cfg: FedRepConfig) -> UnitSource:
        return source(cfg, ("ids", "x", "y"))

    def chunk_size(self, cfg: FedRepConfig) -> int:
        return cfg.chunk_size

    def evaluator(self, cfg: FedRepConfig, protocol: FedRepProtocol) -> FedRepEvaluator:
        return FedRepEvaluator(cfg)

    def privacy_summary(self, cfg: FedRepConfig, protocol: FedRepProtocol, ledger: Ledger) -> dict[str, Any]:
        return {
            "epsilon": ledger_epsilon(ledger, cfg.delta, cfg.accountant),
            "delta": cfg.delta,
            "target_epsilon": cfg.epsilon,
            "accountant": accountant_name(cfg.accountant),
            "neighbouring": f"{cfg.neighbours.value} user",
            "neighbours": cfg.neighbours.value,
            "noise_multiplier": protocol.noise_multiplier,
            "releases_per_user": protocol.releases_per_user(),
            "clip_rule": f"adaptive γ={protocol.clip_quantile}, η_C={protocol.clip_lr}, count share f={protocol.count_share}"
            if protocol.adaptive
            else "fixed",
            "sampling": correlated.sampling_text(cfg.cohorts, cfg.sampling_rate, protocol.cycle, protocol.sampling_rate)
            + (" (rounds 1..T; init uses every user)" if cfg.cohorts == "poisson" else ""),
            **correlated_summary(protocol),
        }

    def plot_keys(self) -> tuple[str, ...]:
        return ("subspace_error",)

    def describe(self, cfg: FedRepConfig, protocol: FedRepProtocol) -> dict[str, Any]:
        return {
            "clip": protocol.clip,
            "zeta": protocol.zeta,
            "noise_multiplier": protocol.noise_multiplier,
            "noise_std_G": protocol.round_noise_std(),
            "noise_std_init": protocol.noise_std(protocol.init_bound),
            "v_star": cfg.v_star.value,
        }

    def canary_design(self) -> CanaryDesign | None:
        return CANARY_DESIGN

    def reduced_config(self) -> dict[str, Any]:
        return {"n_users": 1000, "dim": 10, "test_samples": 20, "rounds": 2, "baselines": "none"}
