"""What an AltMin run measures: the subspace and per-user fits of the released U, against its baselines
(non-private AltMin, clipped without noise, local only, the private initialisation only, the oracle)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from fedpers import linalg, metrics
from fedpers.configs.altmin import BASELINES, Cohorts, baseline_names
from fedpers.data.units import UnitSource
from fedpers.experiments.altmin.plan import AltMinPlan, clip_bounds
from fedpers.experiments.base import Evaluator
from fedpers.experiments.common.lowrank_baselines import NonPrivateAltMin, local_ridge, nonprivate_altmin
from fedpers.experiments.common.population import population_mse
from fedpers.experiments.common.shared_passes import ShadowRun
from fedpers.privacy import Privatizer
from fedpers.protocols.altmin import AltMinProtocol, samples_of
from fedpers.protocols.base import State, Units
from fedpers.runtime.local import Companion, run_local

Tensor = torch.Tensor


LOCAL_ONLY_RIDGE = 1e-6


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

    def round_metrics(self, round: int, state: State) -> dict[str, float]:
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

    def final(self, state: State) -> dict[str, Any]:
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
