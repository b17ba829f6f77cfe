"""What a FedRep run measures: population_mse after refitting v_j on the released U, the subspace error,
and its baselines (Priv-AltMin and non-private AltMin on the same users, riding the run's passes)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fedpers import metrics
from fedpers.configs.fedrep import FedRepConfig, baseline_names
from fedpers.data.units import UnitSource
from fedpers.experiments.altmin import AltMinConfig
from fedpers.experiments.altmin import make_protocol as altmin_protocol
from fedpers.experiments.base import Evaluator, derived_seed
from fedpers.experiments.common.lowrank_baselines import nonprivate_altmin
from fedpers.experiments.common.population import population_mse
from fedpers.experiments.common.shared_passes import ReferenceRun, ShadowRun
from fedpers.experiments.fedrep.plan import source, truth
from fedpers.privacy import (
    Ledger,
    Privatizer,
    ledger_epsilon,
)
from fedpers.protocols.altmin import AltMinProtocol
from fedpers.protocols.base import State, Units
from fedpers.runtime.local import Companion, run_local

Tensor = torch.Tensor


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

    def round_metrics(self, round: int, state: State) -> dict[str, float]:
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

    def final(self, state: State) -> dict[str, Any]:
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
