"""`fedpers run altmin`: user-level private AltMin (docs/algorithms.md §1) with its baselines."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from fedpers import linalg, memory, metrics
from fedpers.config import Neighbours, device_path
from fedpers.configs.altmin import BASELINES, AltMinConfig, Cohorts, baseline_names
from fedpers.configs.privacy import Calibration, accountant_name
from fedpers.configs.shared import is_long_format
from fedpers.data import summary as data_summary
from fedpers.data import synthetic
from fedpers.data.files import AltMinFile
from fedpers.data.long_format import LongFormatFile
from fedpers.data.prefetch import PrefetchSource
from fedpers.data.units import UnitSource
from fedpers.experiments.altmin_baselines import NonPrivateAltMin, local_ridge, nonprivate_altmin
from fedpers.experiments.base import Evaluator, Experiment, Trivial, derived_seed
from fedpers.experiments.hooks import BIG, LABEL_OVERSHOOT, Canaries, CanaryDesign, PrivateScore
from fedpers.experiments.population import fresh_samples, population_mse
from fedpers.experiments.shared_passes import ShadowRun
from fedpers.privacy import Calibrations, Ledger, Privatizer, calibrate_noise_multiplier, ledger_epsilon
from fedpers.protocols.altmin import AltMinProtocol, samples_of
from fedpers.protocols.base import Units
from fedpers.runtime.local import Companion, run_local

Tensor = torch.Tensor
LOCAL_ONLY_RIDGE = 1e-6


LongFormatKey = tuple[str, str, tuple[str, ...], int, int, float, int]
"""How a .parquet/.csv file is read: user, label and feature columns, per-user cap and minimum,
test fraction and split seed."""


@lru_cache(maxsize=4)
def _open_file(path: str, rank: int, long_format: LongFormatKey | None) -> AltMinFile | LongFormatFile:
    """The checked file, opened once per process for each way of reading it (an .npz depends on its
    path and rank only, so the config as given and the run's public-seed config share one); rows
    are read per chunk (or per node)."""
    if long_format is None:
        return AltMinFile(path, rank)
    user, label, features, cap, minimum, test_fraction, seed = long_format
    return LongFormatFile(
        path, user, label, features, cap=cap, min_samples=minimum, test_fraction=test_fraction, seed=seed
    )


def _file(cfg: AltMinConfig, data: Path) -> AltMinFile | LongFormatFile:
    """``cfg``'s data file ``data`` (its ``data`` field), opened as its format says."""
    if not is_long_format(data):
        return _open_file(str(data), cfg.rank, None)
    features = tuple(c.strip() for c in cfg.feature_columns.split(",") if c.strip())
    return _open_file(
        str(data),
        cfg.rank,
        (
            cfg.user_column,
            cfg.label_column,
            features,
            cfg.max_samples_per_user,
            cfg.min_samples_per_user,
            cfg.test_fraction,
            derived_seed(cfg.seed, "split"),
        ),
    )


@lru_cache(maxsize=8)
def resolve_plan(cfg: AltMinConfig) -> AltMinPlan:
    """``cfg`` resolved, once per config: with ``data`` set, n, m and d come from the file (and
    the file is checked now, before any work); ``chunk_size`` auto (0) becomes a number; the
    true U* is drawn (synthetic) or read (a file's). Every hook of :class:`AltMinExperiment`
    starts here and hands the plan down: nothing below resolves again."""
    file = None if cfg.data is None else _file(cfg, cfg.data)
    if file is not None:
        n, m, d = file.shapes["x"]
        cfg = replace(cfg, n_users=int(n), samples_per_user=int(m), dim=int(d))
        cfg.check()
    if cfg.chunk_size == 0:
        cfg = replace(cfg, chunk_size=auto_chunk_size(cfg.n_users, cfg.samples_per_user, cfg.dim, cfg.dtype))
    u_star = synthetic.subspace(derived_seed(cfg.seed, "truth"), cfg.dim, cfg.rank) if file is None else file.u_star
    return AltMinPlan(cfg, file, u_star)


def resolve(cfg: AltMinConfig) -> AltMinConfig:
    """``cfg`` with the sizes of its data and a numeric chunk size (:func:`resolve_plan`)."""
    return resolve_plan(cfg).cfg


AUTO_CHUNK_MEMORY_SHARE = 0.25


@lru_cache(maxsize=8)
def auto_chunk_size(n: int, m: int, d: int, dtype: str) -> int:
    """Users per chunk using about a quarter of the memory available now (decided once per
    process, so every pass of a run chunks alike), between 64 and 65,536."""
    item = 4 if dtype == "float32" else 8
    per_user = m * (d + 1) * (8 + item) * 2 + (m * d + d * d) * 8 * 3
    fit = int(memory.available_bytes() * AUTO_CHUNK_MEMORY_SHARE) // per_user
    return max(64, min(65536, n, fit))


BLOCK_COHORTS_FROM = 64 * synthetic.BLOCK
"""Users from which ``--cohort-block 0`` (auto) makes synthetic cohorts of whole generation blocks."""


def cohort_block(cfg: AltMinConfig) -> int:
    """Ids per run of the public cohort permutation. Synthetic users are i.i.d., so cohorts of whole
    generation blocks are as good as any public partition, and a round then generates only its own
    cohort (1.5 passes over the users instead of 1 + T/2); below ``BLOCK_COHORTS_FROM`` users that
    saving is under a second, and single-user cohorts keep every Flower node in every round. A
    file's user order may mean something: single users unless asked."""
    if cfg.cohort_block > 0:
        return cfg.cohort_block
    return synthetic.BLOCK if cfg.data is None and cfg.n_users >= BLOCK_COHORTS_FROM else 1


def clip_bounds(cfg: AltMinConfig) -> tuple[float, float]:
    """η = c_η √(dk), ζ = c_ζ √(k + σ_F²): data-independent (public d, k, σ_F)."""
    return cfg.clip_model * math.sqrt(cfg.dim * cfg.rank), cfg.clip_label * math.sqrt(cfg.rank + cfg.noise_std**2)


@dataclass(frozen=True, eq=False)
class AltMinPlan:
    """An AltMin config resolved once (:func:`resolve_plan`) and handed to everything that runs
    or evaluates it: the protocol, the users (generated or read chunk by chunk, never all at
    once), the memory check and the evaluator."""

    cfg: AltMinConfig
    """The config with its data's n, m and d and a numeric chunk size."""
    file: AltMinFile | LongFormatFile | None
    """The checked data file (None: synthetic users)."""
    u_star: Tensor | None
    """The true subspace U* on the host: synthetic from the seed, or the file's (None: it has none)."""

    def memory_needed(self) -> dict[str, int]:
        """Bytes of a local run. Users are generated (or sliced) one chunk at a time, so only a chunk's
        samples (float64 as generated, plus the working-dtype copy), its statistics and the
        baselines' per-user Gram matrices (local-only's ridge: min(m, d)² a user, the dual form when
        m < d) are resident; O(n) is just the cohort permutation."""
        cfg = self.cfg
        n, m, d, k = cfg.n_users, cfg.samples_per_user, cfg.dim, cfg.rank
        item = 4 if cfg.dtype == "float32" else 8
        chunk = min(cfg.chunk_size, n)
        data = chunk * m * (d + 1) * (8 + item) * 2 + n * 8 * 3
        statistics = chunk * (m * d + m * k) * item * 3 + 64 * d * d * item * 2 + (d * k) ** 2 * 8 * 4
        baselines = chunk * (min(m, d) ** 2 + m * d) * 8 * 3
        return {"data": data, "statistics": statistics, "baselines": baselines}

    def check_fits(self) -> list[str]:
        """The memory line the CLI prints; refuses (ValueError) a run that cannot fit."""
        lines = memory.check_fits(
            "altmin", self.memory_needed(), "use fewer users (--n-users), a smaller --dim or --chunk-size"
        )
        return [f"{lines[0]}; {self.cfg.chunk_size} users per chunk"]

    def protocol(self, *, private: bool = True, calibrations: Calibrations | None = None) -> AltMinProtocol:
        """The public protocol, its noise calibrated to (ε, δ) (``private`` False: no clipping, no noise)."""
        cfg = self.cfg
        if private:
            self.check_fits()
        eta, zeta = clip_bounds(cfg) if private else (math.inf, math.inf)
        proto = AltMinProtocol(
            n_users=cfg.n_users,
            dim=cfg.dim,
            rank=cfg.rank,
            samples_per_user=cfg.samples_per_user,
            rounds=cfg.rounds,
            eta=eta,
            zeta=zeta,
            noise_multiplier=0.0,
            cohorts=cfg.cohorts,
            cohort_seed=derived_seed(cfg.seed, "cohorts"),
            cohort_block=cohort_block(cfg),
            device_kernels=device_path(cfg.device, cfg.kernels),
            psd=cfg.psd,
            dtype_name=cfg.dtype,
            sampling_rate=cfg.sampling_rate,
        )
        if not private:
            return proto
        if cfg.clip_rule == "adaptive":
            proto = replace(
                proto,
                clip_quantile=cfg.clip_quantile,
                label_clip_quantile=cfg.label_clip_quantile,
                clip_lr=cfg.clip_lr,
                count_shares=(cfg.clip_budget, cfg.label_clip_budget),
            )
        releases, shares = proto.releases_per_user(), proto.count_shares
        if math.isinf(cfg.epsilon):
            z = 0.0
        elif cfg.calibration is Calibration.PAPER:  # σ = r·Δ with r from Theorem 4.2; dp-accounting's z = 2σ/Δ
            z = 2 * math.sqrt(8 * (1 + (releases - 1) // 2) * math.log(1 / cfg.delta)) / cfg.epsilon
        else:
            z = calibrate_noise_multiplier(
                lambda z: AltMinProtocol.user_event(z, releases, cfg.sampling_rate, shares),
                cfg.epsilon,
                cfg.delta,
                cfg.accountant,
                calibrations,
                cfg.neighbours,
            )
        return replace(proto, noise_multiplier=z)

    def load_units(
        self,
        ids: Tensor,
        samples: tuple[int, int] | None = None,
        *,
        keep_partial_blocks: bool = True,
        workers: int | None = None,
    ) -> dict[str, Tensor]:
        """Data of the given users: a slice of the file, or the synthetic users generated from (seed, id).

        Synthetic users are drawn in the working dtype on the run's device (docs/benchmarks.md,
        "Synthetic users": float64 on the CPU keeps every earlier run's users; the device path
        draws per (block, part) on the device in any dtype); with ``samples`` [a, b) only the
        sample halves that range touches are made: within one half, x and y hold only that half
        and ``first_sample`` (per user) says which sample x[:, 0] is (see
        :func:`fedpers.protocols.altmin.samples_of`); across both, the full m.
        ``keep_partial_blocks`` False: a pass that asks each block once (a local cohort round) keeps
        no partly used block for later callers, so memory stays bounded by the chunk. ``workers``:
        threads drawing blocks (default: the calling thread's torch thread count).
        """
        cfg = self.cfg
        dtype = getattr(torch, cfg.dtype)
        if self.file is not None:
            out = self.file.rows(ids.to(torch.int64).cpu())
        else:
            halves = (
                synthetic.HALVES
                if samples is None
                else tuple(
                    h for h in synthetic.HALVES if _overlaps(synthetic.half_range(cfg.samples_per_user, h), samples)
                )
            )
            compact = samples is not None and len(halves) == 1
            out = synthetic.altmin_users(
                derived_seed(cfg.seed, "data"),
                ids.to(torch.int64),
                self.synthetic_truth(),
                cfg.samples_per_user,
                cfg.noise_std,
                dtype,
                halves=halves,
                device=cfg.device,
                keep_partial_blocks=keep_partial_blocks,
                workers=workers,
                compact=compact,
                parts=True if device_path(cfg.device, cfg.kernels) else None,
            )
            if compact:  # x, y hold only that half's samples (nothing zero-filled): say where they start
                first = synthetic.half_range(cfg.samples_per_user, halves[0])[0]
                out["first_sample"] = torch.full((out["ids"].shape[0],), first, dtype=torch.int64)
        # ``first_sample`` stays on the host: it is read there (``samples_of``), never computed with
        return {
            k: v if k == "first_sample" else (v.to(cfg.device, dtype) if v.is_floating_point() else v.to(cfg.device))
            for k, v in out.items()
        }

    def synthetic_truth(self) -> Tensor:
        """U* of synthetic users (always drawn: only a data file may have none)."""
        if self.u_star is None:
            raise ValueError("synthetic users need the synthetic U*; this plan reads a data file without one")
        return self.u_star

    def source(self, keys: tuple[str, ...] | None = None, samples: tuple[int, int] | None = None) -> UnitSource:
        """Every user, generated (or sliced from the file) chunk by chunk: never all at once.
        ``keys`` restricts what each chunk carries (the protocol needs ids, x, y; the evaluator more);
        ``samples`` [a, b) the sample range a pass needs (synthetic users: only those halves are made)."""
        if self.file is None:
            return AltMinSource(self, keys, samples)
        if isinstance(self.file, LongFormatFile):
            self.file.load_all()

        def load(start: int, stop: int) -> dict[str, Tensor]:
            units = self.load_units(torch.arange(start, stop))
            return units if keys is None else {k: v for k, v in units.items() if k in keys}

        return UnitSource(self.cfg.n_users, load, self.cfg.device)

    def population_units(self, ids: Tensor) -> dict[str, Tensor]:
        """The users' R refit and S test samples, fresh draws from their own (U*, v*_j) on streams
        apart from the training data (which stays what it was for the seed)."""
        cfg, u = self.cfg, self.synthetic_truth()
        v = (
            synthetic.altmin_users(
                derived_seed(cfg.seed, "data"),
                ids,
                u,
                cfg.samples_per_user,
                cfg.noise_std,
                getattr(torch, cfg.dtype),
                halves=(),
                device=cfg.device,
                parts=True if device_path(cfg.device, cfg.kernels) else None,  # the scheme load_units draws them in
            )["v_star"]
            .cpu()
            .double()
        )
        x_r, y_r = fresh_samples(derived_seed(cfg.seed, "refit"), ids, u, v, cfg.refit_samples, cfg.noise_std)
        x_t, y_t = fresh_samples(derived_seed(cfg.seed, "population-test"), ids, u, v, cfg.test_samples, cfg.noise_std)
        return {"ids": ids, "x_refit": x_r, "y_refit": y_r, "x_test": x_t, "y_test": y_t}


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class AltMinSource(PrefetchSource):
    """AltMin's synthetic users, drawn on demand one chunk ahead (:class:`PrefetchSource`);
    ``keys`` restricts what each chunk carries."""

    def __init__(self, plan: AltMinPlan, keys: tuple[str, ...] | None, samples: tuple[int, int] | None = None) -> None:
        self.plan, self.keys = plan, keys
        super().__init__(plan.cfg.n_users, samples, plan.cfg.device)

    def take(
        self,
        ids: Tensor,
        samples: tuple[int, int] | None,
        keep_partial_blocks: bool = True,
        workers: int | None = None,
    ) -> dict[str, Tensor]:
        units = self.plan.load_units(ids, samples, keep_partial_blocks=keep_partial_blocks, workers=workers)
        return units if self.keys is None else {k: v for k, v in units.items() if k in self.keys or k == "first_sample"}


def make_protocol(
    cfg: AltMinConfig, *, private: bool = True, calibrations: Calibrations | None = None
) -> AltMinProtocol:
    """:meth:`AltMinPlan.protocol` of ``cfg``."""
    return resolve_plan(cfg).protocol(private=private, calibrations=calibrations)


def truth(cfg: AltMinConfig) -> Tensor | None:
    """U* of ``cfg``'s users (None: a data file without one)."""
    return resolve_plan(cfg).u_star


def load_units(
    cfg: AltMinConfig,
    ids: Tensor,
    samples: tuple[int, int] | None = None,
    *,
    keep_partial_blocks: bool = True,
    workers: int | None = None,
) -> dict[str, Tensor]:
    """:meth:`AltMinPlan.load_units` of ``cfg``."""
    return resolve_plan(cfg).load_units(ids, samples, keep_partial_blocks=keep_partial_blocks, workers=workers)


def unit_source(
    cfg: AltMinConfig, keys: tuple[str, ...] | None = None, samples: tuple[int, int] | None = None
) -> UnitSource:
    """:meth:`AltMinPlan.source` of ``cfg``."""
    return resolve_plan(cfg).source(keys, samples)


def paper_epsilon(noise_to_sensitivity: float, rounds_in: int, delta: float) -> float:
    """ε that Theorem 4.2 of the personalization paper claims for this noise.

    With every release's noise σ = r·Δ (Δ its replace-one sensitivity), the paper's proof
    (Lemmas 4.3, 4.5) gives RDP α/(2r²) per Gaussian, so α/r² for a round's (A, b) and for
    the initialisation, and Theorem 4.2 sets r = sqrt(16 log(1/δ))/ε for the init plus one
    round: ε = sqrt(16 log(1/δ))/r. A user in ``rounds_in`` rounds (every round with
    ``--cohorts all``) composes 1 + rounds_in such steps: ε = sqrt(8 (1 + rounds_in) log(1/δ))/r.
    """
    if noise_to_sensitivity == 0:
        return math.inf
    return math.sqrt(8 * (1 + rounds_in) * math.log(1 / delta)) / noise_to_sensitivity


Fit = Callable[[Units], Tensor]
"""Per-user models θ_j (users, d) from a chunk of users' data."""


@dataclass(frozen=True, eq=False)
class SubspaceFit:
    """θ_j = U v_j with every user's final local solve v_j on Q3∪Q4 (the billboard model's last step)."""

    protocol: AltMinProtocol
    U: Tensor

    def __call__(self, units: Units) -> Tensor:
        return self.U.to(units["x"].dtype) @ self.protocol.personalize(self.U, units).unsqueeze(-1)

    @staticmethod
    def together(fits: list[SubspaceFit], units: Units) -> dict[int, Tensor]:
        """Several fits of one protocol on one chunk (keyed by ``id(fit)``): the features x·U of
        every fit in one product over the chunk's samples (one read of x instead of one per fit),
        then each fit's own local solves: each θ_j as its fit computes it, to float rounding."""
        if len(fits) < 2 or any(f.protocol is not fits[0].protocol for f in fits):
            return {}
        p = fits[0].protocol
        h, k = 2 * p.quarter, p.rank
        x, y = samples_of(units, h, 2 * h)
        x, y = x.to(p.dtype), y.to(p.dtype)
        Us = [f.U.to(p.dtype) for f in fits]
        features = x @ torch.cat(Us, dim=1)
        return {
            id(f): U.to(x.dtype) @ p.local_solve_features(features[..., i * k : (i + 1) * k], y).unsqueeze(-1)
            for i, (f, U) in enumerate(zip(fits, Us))
        }


class AltMinEvaluator(Evaluator):
    """Exact metrics from U*, v*; baselines on the same users, one streamed pass over them."""

    def __init__(self, plan: AltMinPlan, protocol: AltMinProtocol) -> None:
        self.plan, self.cfg, self.protocol = plan, plan.cfg, protocol
        # on the run's device, beside the released U and the users it scores
        self.u_star = None if plan.u_star is None else plan.u_star.to(self.cfg.device)
        self.source = plan.source()
        # the evaluation reads the second half (the final local solve on Q3 ∪ Q4) unless
        # local_only is asked for (its ridge uses all m samples)
        h = self.cfg.samples_per_user // 2
        self.second_half = plan.source(samples=(h, 2 * h))
        self.eval_source = self.source if "local_only" in baseline_names(self.cfg.baselines) else self.second_half
        self.init_U: Tensor | None = None
        self.population = None
        if self.cfg.refit_samples:
            self.population = UnitSource(self.cfg.n_users, lambda a, b: plan.population_units(torch.arange(a, b)))
        self.shadow: ShadowRun | None = None
        self.nonprivate_rounds = 0

    def clipped_protocol(self) -> AltMinProtocol:
        """The private run's protocol with its clip bounds and no noise (the clipped-no-noise baseline)."""
        eta, zeta = clip_bounds(self.cfg)
        return replace(self.protocol, eta=eta, zeta=zeta, noise_multiplier=0.0)

    def companions(self) -> list[Companion]:
        """Clipped-no-noise in the private run's own passes (the non-private AltMin starts from its U):
        the clipped protocol reads the same chunks in the same rounds, and its round-0 message is
        the private run's (its sum is the private run's before noise). Not with Poisson cohorts (the
        private sample is the private run's; a separate clipped run draws its own, as before)."""
        wanted = baseline_names(self.cfg.baselines)
        if self.cfg.cohorts is Cohorts.POISSON or not {"clipped_no_noise", "nonprivate_altmin"} & set(wanted):
            return []
        self.shadow = ShadowRun(self.clipped_protocol(), Privatizer(0))
        return [self.shadow]

    def state_dict(self) -> dict[str, Tensor]:
        return {} if self.init_U is None else {"init_U": self.init_U}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self.init_U = state.get("init_U", self.init_U)

    def round_metrics(self, round: int, state: Any) -> dict[str, float]:
        if round == 0:
            self.init_U = state["U"]
        if self.u_star is None:
            return {}
        U = state["U"]
        return {
            "subspace_error": metrics.subspace_error(U, self.u_star),
            "subspace_error_spectral": metrics.subspace_error_spectral(U, self.u_star),
        }

    def subspace_fit(self, U: Tensor) -> Fit:
        """Every user's final local solve on Q3∪Q4 with U (the billboard model's last step)."""
        return SubspaceFit(self.protocol, U)

    def evaluate(
        self, fits: Mapping[str, tuple[Fit, Tensor | None]], source: UnitSource | None = None
    ) -> dict[str, dict[str, float | None]]:
        """Metrics of several fits (name → (fit, its U or None)) in one pass over the users
        (``source``, default :attr:`eval_source`).

        Excess risk mean_j ||θ_j − θ*_j||² and test MSE are accumulated as sums per chunk.
        """
        scores = Scores(self, fits)
        for units in (self.eval_source if source is None else source).chunks(self.cfg.chunk_size):
            scores.add(units)
        return scores.result()

    @staticmethod
    def local_only_fit(units: Units) -> Tensor:
        """Each user alone: ridge in d dimensions on all of its m samples."""
        return local_ridge(units["x"], units["y"], LOCAL_ONLY_RIDGE)

    def final(self, state: Any) -> dict[str, Any]:
        private = {"private": (self.subspace_fit(state["U"]), state["U"])}
        out = self.with_baselines(private)
        if self.plan.file is not None:
            out["data"] = self.plan.file.summary()
        return out

    def with_baselines(
        self,
        private: Mapping[str, tuple[Fit, Tensor | None]],
        extra: Mapping[str, tuple[Fit, Tensor | None]] | None = None,
    ) -> dict[str, Any]:
        """The private fit's metrics with the baselines' beside it, in one pass; a baseline that
        fails (out of memory, say) leaves the private metrics and says why."""
        error = ""
        fits: dict[str, tuple[Fit, Tensor | None]] = dict(private)
        try:
            known, start = self.baseline_fits()
            fits = {**private, **known, **(extra or {})}
            if "nonprivate_altmin" in baseline_names(self.cfg.baselines):
                fits, results = self.with_reference(fits, start)
            else:
                results = self.evaluate(fits)
        except (RuntimeError, MemoryError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
            fits = dict(private)
            results = self.evaluate(private)
        if self.population is not None:  # refit v_j on fresh samples with each released U, test on more
            Us = {name: U for name, (_, U) in fits.items() if U is not None and name in results}
            for name, mse in population_mse(self.population, Us, self.cfg.chunk_size).items():
                results[name]["population_mse"] = mse
        out: dict[str, Any] = results.pop("private")
        skipped = [k for k in ("subspace_error", "excess_risk") if k not in out or out[k] is None]
        out["baselines"] = results
        out["baselines_skipped"] = sorted(set(BASELINES) - set(results))
        if error:
            out["baselines_error"] = error
        if skipped:
            out["skipped_metrics"] = {k: "the data has no true U*/v*" for k in skipped}
        return out

    def baseline_fits(self) -> tuple[dict[str, tuple[Fit, Tensor | None]], Tensor | None]:
        """The baselines ``cfg.baselines`` asks for whose U is known once the private run is done, on
        the same users, and the non-private AltMin's start (clipped-no-noise's U, None when not
        asked for): :meth:`with_reference` runs the reference and scores these in its first pass.
        Shared with ``run expmech`` so tables compare."""
        wanted = baseline_names(self.cfg.baselines)
        fits: dict[str, tuple[Fit, Tensor | None]] = {}
        clipped_U = None
        if {"clipped_no_noise", "nonprivate_altmin"} & set(wanted):
            if self.shadow is not None and self.shadow.complete:  # read in the private run's passes
                clipped_U = self.shadow.state["U"]
            else:
                c_state, _ = run_local(
                    self.clipped_protocol(), self.source, Privatizer(0), chunk_size=self.cfg.chunk_size, progress=False
                )
                clipped_U = c_state["U"]
        if "clipped_no_noise" in wanted and clipped_U is not None:
            fits["clipped_no_noise"] = (self.subspace_fit(clipped_U), clipped_U)
        if "local_only" in wanted:
            fits["local_only"] = (self.local_only_fit, None)
        if "private_init_only" in wanted and self.init_U is not None:
            fits["private_init_only"] = (self.subspace_fit(self.init_U), self.init_U)
        if "oracle" in wanted and self.u_star is not None:
            oracle = self.u_star.to(getattr(torch, self.cfg.dtype))
            fits["oracle"] = (self.subspace_fit(oracle), oracle)
        return fits, (clipped_U if "nonprivate_altmin" in wanted else None)

    def with_reference(
        self, fits: Mapping[str, tuple[Fit, Tensor | None]], start: Tensor | None
    ) -> tuple[dict[str, tuple[Fit, Tensor | None]], dict[str, dict[str, float | None]]]:
        """(every fit with the non-private AltMin's beside them, their metrics). The reference
        (:func:`nonprivate_altmin`, warm-started from ``start``: clipped-no-noise's U, a function of
        the users alone, so fewer passes to the same fixed point than from a spectral pass of its
        own) reads every user with all samples in each round; ``fits``, all known by now, are
        scored in its first round's pass (the same chunks the evaluation pass would read), so the
        only pass of the evaluation's own is the reference fit's, on the second half of the samples.
        The reference's U is :func:`nonprivate_altmin`'s alone, bit for bit (same chunks, same order)."""
        steps = NonPrivateAltMin(self.cfg.rank, start)
        scores = Scores(self, fits)
        steps.begin()
        for units in self.source.chunks(self.cfg.chunk_size):
            steps.add(units)
            scores.add(units)
        steps.end()
        U, self.nonprivate_rounds = nonprivate_altmin(self.source, self.cfg.rank, self.cfg.chunk_size, resume=steps)
        U = U.to(getattr(torch, self.cfg.dtype))
        reference = {"nonprivate_altmin": (self.subspace_fit(U), U)}  # the same final local solve as every row
        results = {**scores.result(), **self.evaluate(reference, self.second_half)}
        order = [name for name in fits if name == "private"] + ["nonprivate_altmin"]
        order += [name for name in fits if name not in order]
        together = {**fits, **reference}
        return {name: together[name] for name in order}, {name: results[name] for name in order}


class Scores:
    """:meth:`AltMinEvaluator.evaluate`'s sums, one chunk at a time (:meth:`add`), so another pass over
    the same users (the reference's) can score fits on its chunks; :meth:`result` the metrics."""

    def __init__(self, evaluator: AltMinEvaluator, fits: Mapping[str, tuple[Fit, Tensor | None]]) -> None:
        self.evaluator, self.fits = evaluator, dict(fits)
        self.sums = {name: {"excess": 0.0, "test": 0.0} for name in fits}
        self.users = self.test_values = 0
        self.has_truth = self.has_test = False
        u_star = evaluator.u_star
        self.u_star = None if u_star is None else u_star.double()

    def add(self, units: Units) -> None:
        """One chunk of users (the second half of their samples, or all of them when local-only is scored)."""
        with linalg.serial_small_ops(units["ids"].device):  # many small ops; the heavy ones run in shares
            self._add(units)

    def _add(self, units: Units) -> None:
        self.users += int(units["ids"].shape[0])
        u_star, fits, sums = self.u_star, self.fits, self.sums
        theta_star = units["v_star"].double() @ u_star.T if u_star is not None and "v_star" in units else None
        self.has_truth = theta_star is not None
        self.has_test = "x_test" in units
        if self.has_test:
            self.test_values += int(units["test_count"].sum()) if "test_count" in units else units["y_test"].numel()
        x_test = units["x_test"].double() if self.has_test else None  # once per chunk, not once per fit
        y_test = units["y_test"].double() if self.has_test else None
        shared = SubspaceFit.together([f for f, _ in fits.values() if isinstance(f, SubspaceFit)], units)
        for name, (fit, _) in fits.items():
            theta = shared[id(fit)] if id(fit) in shared else fit(units)
            theta = theta.squeeze(-1) if theta.dim() == 3 else theta
            if theta_star is not None:
                # θ − θ* promoted to float64 in one op and squared in place: the bits of
                # ((θ.double() − θ*)²).sum() (the conversion is exact, x² is x·x) without two copies
                diff = torch.sub(theta, theta_star)
                sums[name]["excess"] += float(diff.mul_(diff).sum())
            if x_test is not None and y_test is not None:
                pred = (x_test @ theta.double().unsqueeze(-1)).squeeze(-1)
                residual = pred.sub_(y_test)
                sums[name]["test"] += float(residual.mul_(residual).sum())

    def result(self) -> dict[str, dict[str, float | None]]:
        out: dict[str, dict[str, float | None]] = {}
        u_star, noise_std = self.u_star, self.evaluator.cfg.noise_std
        for name, (_, U) in self.fits.items():
            row: dict[str, float | None] = {}
            if u_star is not None and U is not None:
                row["subspace_error"] = metrics.subspace_error(U, u_star)
                row["subspace_error_spectral"] = metrics.subspace_error_spectral(U, u_star)
            if self.has_truth:
                excess = self.sums[name]["excess"] / max(self.users, 1)
                row["excess_risk"] = excess
                row["test_mse"] = excess + noise_std**2
            if self.has_test:
                row["test_mse"] = self.sums[name]["test"] / max(self.test_values, 1)
            out[name] = row
        return out


# ----- optional hooks: audit canaries and the private validation score ------------------------
def audit_protocol(cfg: AltMinConfig, k: int, calibrations: Calibrations | None = None) -> AltMinProtocol:
    """The configured protocol for a population of ``k`` canary users (the audit's own population)."""
    if cfg.data is not None:
        raise ValueError("data: the audit's population is its canaries; drop --data")
    if cfg.clip_rule != "fixed":
        raise ValueError(
            "clip_rule: the altmin audit's canaries sit at fixed clip bounds; audit without --clip-rule adaptive"
        )
    return make_protocol(replace(cfg, n_users=k, chunk_size=max(k, 1)), calibrations=calibrations)


def audit_canaries(protocol: AltMinProtocol, generator: torch.Generator, count: int) -> Canaries:
    """Canary i lives on coordinate e_i of R^d. Q1: fixed Gaussian samples (so v_i is generic);
    Q2: x = BIG·e_i and y = ±1.5ζ, so every w_ij sits at the model clip η along v̂_i ⊗ e_i and
    every label at ±ζ: b_i = ±|Q2|ηζ (v̂_i ⊗ e_i), the "+"/"−" versions differ by 2·bound (its
    full replace-one sensitivity), while A_i (PSD, sign-blind) is the same in both; second half:
    x = e_i and the pair's labels (+1.5ζ, ±1.5ζ), so W_i = ±(m/4)ζ² e_i e_iᵀ, again 2·bound apart."""
    p = protocol
    d, m, q, k = p.dim, p.samples_per_user, p.quarter, count
    dtype = p.dtype
    x = torch.zeros(k, m, d, dtype=torch.float64)
    y = torch.zeros(k, m, dtype=torch.float64)
    x[:, :q] = torch.randn(k, q, d, generator=generator, dtype=torch.float64)
    y[:, :q] = (x[:, :q] @ torch.randn(k, d, 1, generator=generator, dtype=torch.float64)).squeeze(-1)
    eye = torch.eye(d, dtype=torch.float64)[:k]
    x[:, q : 2 * q] = BIG * eye[:, None, :]
    x[:, 2 * q :] = eye[:, None, :]
    label = LABEL_OVERSHOOT * p.zeta
    y[:, q:] = label
    y_minus = y.clone()
    y_minus[:, q : 2 * q] = -label
    y_minus[:, 2 * q + 1 :: 2] = -label  # the second of each init pair
    ids = torch.arange(k)
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y.to(dtype)},
        {"ids": ids, "x": x.to(dtype), "y": y_minus.to(dtype)},
        "coordinate e_i per canary; b and W at ± their clip bound (2·bound apart), A equal in both versions",
    )


MIX_COSINE = 0.25
"""cos∠(u, w) of a random-placement canary's two Q2 directions: with opposite labels its A moves
by √(1 − c²) and its b by √((1 + c)/2) of their sensitivities; c = 1/4 maximises the sum of squares
(15/16 + 5/8 of 2), the most one user can move both (A is PSD and sign-blind, b is linear in x)."""


def _random_canaries(protocol: AltMinProtocol, generator: torch.Generator, k: int) -> Canaries:
    """More canaries than d: canary i on a random unit direction u_i of R^d (not orthogonal to the
    others). Init pairs x = u_i with labels (1.5ζ, ±1.5ζ): W_i = ±(m/4)ζ² u_iu_iᵀ, 2·bound apart.
    Q2: "+" x = BIG·u_i with labels +1.5ζ, "−" x = BIG·w_i with labels −1.5ζ, w_i at cosine 1/4 to
    u_i (:data:`MIX_COSINE`), so A moves by √(15/16) and b by √(5/8) of their sensitivities."""
    p = protocol
    d, m, q = p.dim, p.samples_per_user, p.quarter
    dtype = p.dtype
    u = torch.randn(k, d, generator=generator, dtype=torch.float64)
    u = u / torch.linalg.vector_norm(u, dim=1, keepdim=True)
    other = torch.randn(k, d, generator=generator, dtype=torch.float64)
    other = other - (other * u).sum(1, keepdim=True) * u
    other = other / torch.linalg.vector_norm(other, dim=1, keepdim=True)
    w = MIX_COSINE * u + math.sqrt(1 - MIX_COSINE**2) * other
    x = torch.zeros(k, m, d, dtype=torch.float64)
    y = torch.zeros(k, m, dtype=torch.float64)
    x[:, :q] = torch.randn(k, q, d, generator=generator, dtype=torch.float64)
    y[:, :q] = (x[:, :q] @ torch.randn(k, d, 1, generator=generator, dtype=torch.float64)).squeeze(-1)
    x[:, q : 2 * q] = BIG * u[:, None, :]
    x[:, 2 * q :] = u[:, None, :]
    label = LABEL_OVERSHOOT * p.zeta
    y[:, q:] = label
    x_minus, y_minus = x.clone(), y.clone()
    x_minus[:, q : 2 * q] = BIG * w[:, None, :]
    y_minus[:, q : 2 * q] = -label
    y_minus[:, 2 * q + 1 :: 2] = -label  # the second of each init pair
    ids = torch.arange(k)
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y.to(dtype)},
        {"ids": ids, "x": x_minus.to(dtype), "y": y_minus.to(dtype)},
        "random unit direction u_i per canary (interference in the scores); W at ± its clip bound along u_iu_iᵀ; "
        "Q2 at u_i with labels +ζ vs at w_i (cos 1/4 to u_i) with labels −ζ: A and b at √(15/16) and √(5/8) of their sensitivities",
    )


def _paired_canaries(base: Canaries) -> Canaries:
    """Canary i from orthogonal canaries 2i and 2i + 1 of :func:`audit_canaries`: the init pairs and
    Q1 are canary 2i's (W still flips sign on e_2i: its full 2·bound); "−" moves the "+" Q2 samples
    to e_2i+1, so A (PSD, sign-blind) moves by its full √2·bound and b by √2 of its 2·bound. Per
    user that is W 1, A 1, b 1/2 of the squared sensitivities (a sign flip alone: 1, 0, 1)."""
    k = base.count // 2
    first, second = slice(0, 2 * k, 2), slice(1, 2 * k, 2)
    ids = torch.arange(k)
    x_minus = base.minus["x"][first].clone()
    rows = (x_minus[0].abs().amax(-1) >= BIG / 2).nonzero().squeeze(-1)  # the Q2 samples: x = BIG·e
    x_minus[:, rows] = base.plus["x"][second][:, rows]
    y_minus = base.minus["y"][first].clone()
    y_minus[:, rows] = base.plus["y"][first][:, rows]
    return Canaries(
        {"ids": ids, "x": base.plus["x"][first], "y": base.plus["y"][first]},
        {"ids": ids, "x": x_minus, "y": y_minus},
        "pairs of coordinates (e_a, e_b) per canary; W at ± its clip bound on e_a (2·bound apart); "
        'Q2 on e_a ("+") or e_b ("−"): A at its full √2·bound, b √2·bound of its 2·bound',
        base.as_released,
    )


CANARY_DESIGN = CanaryDesign(
    audit_protocol,
    lambda p: p.dim,
    audit_canaries,
    "init W, and every round's A and b",
    "replace-one user (a canary's two versions are the same user with different data)",
    random_canaries=_random_canaries,
    paired_canaries=_paired_canaries,
)

VALIDATION_CLIP = 4.0
"""A held-out user's validation MSE is clipped to [0, 4·(k + σ_F²)] (k + σ_F² is the label variance
of the synthetic model, public): the per-user bound of the score release."""


def validation_mse(cfg: AltMinConfig, protocol: AltMinProtocol, state: Any, units: dict[str, Tensor]) -> Tensor:
    """Each held-out user fits v_j on its first half with the released U, and its MSE on the second."""
    U = state["U"].double()
    x, y = units["x"].double(), units["y"].double()
    h = x.shape[1] // 2
    v = protocol.local_solve(U, x[:, :h], y[:, :h])
    pred = ((x[:, h:] @ U) @ v.unsqueeze(-1)).squeeze(-1)
    return ((pred - y[:, h:]) ** 2).mean(1)


def heldout_units(cfg: AltMinConfig, ids: Tensor) -> dict[str, Tensor]:
    """Held-out users of the synthetic model (ids past the training population)."""
    if cfg.data is not None:
        raise ValueError("select --private: held-out users are drawn from the synthetic model; drop --data")
    return load_units(cfg, ids)


PRIVATE_SCORES = {
    "validation_mse": PrivateScore(
        "validation_mse",
        lambda cfg: VALIDATION_CLIP * (cfg.rank + cfg.noise_std**2),
        validation_mse,
        heldout_units,
    )
}


class AltMinExperiment(Experiment[AltMinConfig, AltMinProtocol]):
    """User-level private alternating minimisation with private initialisation (docs/algorithms.md §1, Algorithms 1–3)."""

    round_axis = "round (0 = private initialisation)"

    def trivial_baselines(self, cfg: AltMinConfig) -> list[Trivial]:
        few = (
            "too few users for this ε: the noise on the round statistics swamps them (the privacy term falls as "
            "1/(ε²n²); raise --n-users or --epsilon, or try a smaller --clip-model c_η)"
        )
        return [
            Trivial(
                "excess_risk",
                "local_only",
                why=few + "; each user alone does better with --samples-per-user this large",
            ),
            Trivial("excess_risk", "private_init_only", why="the private rounds made the initialisation worse: " + few),
        ]

    name = "altmin"
    result_keys = ("subspace_error", "subspace_error_spectral", "excess_risk", "test_mse", "population_mse")
    baseline_names = BASELINES
    config_type = AltMinConfig

    def protocol(self, cfg: AltMinConfig, calibrations: Calibrations | None = None) -> AltMinProtocol:
        return resolve_plan(cfg).protocol(calibrations=calibrations)

    def num_units(self, cfg: AltMinConfig) -> int:
        return resolve_plan(cfg).cfg.n_users

    def units(self, cfg: AltMinConfig, ids: Tensor) -> dict[str, Tensor]:
        return {k: v for k, v in resolve_plan(cfg).load_units(ids).items() if k in ("ids", "x", "y")}

    def unit_source(self, cfg: AltMinConfig) -> UnitSource:
        return resolve_plan(cfg).source(("ids", "x", "y"))

    def chunk_size(self, cfg: AltMinConfig) -> int:
        return resolve_plan(cfg).cfg.chunk_size

    def evaluator(self, cfg: AltMinConfig, protocol: AltMinProtocol) -> AltMinEvaluator:
        return AltMinEvaluator(resolve_plan(cfg), protocol)

    def privacy_summary(self, cfg: AltMinConfig, protocol: AltMinProtocol, ledger: Ledger) -> dict[str, Any]:
        releases = protocol.releases_per_user()
        return {
            "epsilon": ledger_epsilon(ledger, cfg.delta, cfg.accountant),
            "delta": cfg.delta,
            "target_epsilon": cfg.epsilon,
            "accountant": accountant_name(cfg.accountant),
            "neighbouring": f"{cfg.neighbours.value} user",
            "neighbours": cfg.neighbours.value,
            "noise_multiplier": protocol.noise_multiplier,
            "releases_per_user": releases,
            "calibration": cfg.calibration.value,
            # Every release's σ = z·Δ/2 (its dp-accounting event is GaussianDpEvent(z)); the paper's rule is replace-one
            **(
                {
                    "paper_epsilon_same_noise": paper_epsilon(
                        protocol.noise_multiplier / 2, protocol.rounds_in, cfg.delta
                    )
                }
                if cfg.neighbours is Neighbours.REPLACE_ONE
                else {}
            ),
            **(
                {
                    "clip_rule": f"adaptive γ_η={protocol.clip_quantile}, γ_ζ={protocol.label_clip_quantile}, "
                    f"η_C={protocol.clip_lr}, count shares f_A={protocol.count_shares[0]}, f_b={protocol.count_shares[1]}"
                }
                if protocol.adaptive
                else {}
            ),
        }

    def plot_keys(self) -> tuple[str, ...]:
        return ("subspace_error",)

    def plan(self, cfg: AltMinConfig) -> list[str]:
        plan = resolve_plan(cfg)
        data = data_summary.lines(plan.file.summary()) if plan.file is not None else []
        return [*data, *plan.check_fits()]

    def describe(self, cfg: AltMinConfig, protocol: AltMinProtocol) -> dict[str, Any]:
        return {
            "eta": protocol.eta,
            "zeta": protocol.zeta,
            "eta_formula": "c_η √(dk)",
            "zeta_formula": "c_ζ √(k + σ_F²)",
            "noise_multiplier": protocol.noise_multiplier,
            "noise_std_init": protocol.noise_std(protocol.init_bound),
            "noise_std_A": protocol.noise_std(
                protocol.a_bound,
                protocol.a_sensitivity_of(protocol.a_bound, cfg.neighbours),
                neighbours=cfg.neighbours,
            ),
            "noise_std_b": protocol.noise_std(protocol.b_bound),
            "psd_method": protocol.psd.value,
            "chunk_size": resolve_plan(cfg).cfg.chunk_size,
        }

    def canary_design(self) -> CanaryDesign | None:
        return CANARY_DESIGN

    def private_scores(self) -> dict[str, PrivateScore]:
        return PRIVATE_SCORES

    def reduced_config(self) -> dict[str, Any]:
        return {"n_users": 10000, "samples_per_user": 12}
