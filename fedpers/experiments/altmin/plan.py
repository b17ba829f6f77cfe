"""AltMin's plan of a run: its data (synthetic users or a file, checked before any work), the chunks the
local runtime streams, and the memory that takes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch

from fedpers import memory
from fedpers.config import device_path
from fedpers.configs.altmin import AltMinConfig
from fedpers.configs.privacy import Calibration
from fedpers.configs.shared import is_long_format
from fedpers.data import synthetic
from fedpers.data.files import AltMinFile
from fedpers.data.long_format import LongFormatFile
from fedpers.data.prefetch import PrefetchSource
from fedpers.data.units import UnitSource
from fedpers.experiments.base import derived_seed
from fedpers.experiments.common.population import fresh_samples
from fedpers.privacy import Calibrations, calibrate_noise_multiplier, check_rule_meets_target
from fedpers.protocols.altmin import AltMinProtocol

Tensor = torch.Tensor


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
            check_rule_meets_target(
                "Theorem 4.2's noise",
                AltMinProtocol.user_event(z, releases, cfg.sampling_rate, shares),
                cfg.epsilon,
                cfg.delta,
                cfg.accountant,
            )
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
