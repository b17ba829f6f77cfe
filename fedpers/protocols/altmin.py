"""User-level private alternating minimisation with private initialisation.

docs/algorithms.md §1 (Algorithms 1–3 of the personalization paper). Round 0 releases the private
initialisation statistic; rounds 1..T each run one AltMin step over a cohort of users:
local least squares for v_j on Q1, clipped statistics on Q2 in Kronecker form, server
solve for U. The final v_j solve on Q3∪Q4 is local (:meth:`AltMinProtocol.personalize`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import dp_accounting
import torch

from fedpers import linalg
from fedpers.config import Neighbours, neighbours_of
from fedpers.configs.altmin import Cohorts, PsdMethod
from fedpers.devices import to_device
from fedpers.privacy import ALL_UNITS, Privatizer
from fedpers.privacy.adaptive_clip import COUNT_BOUND, AdaptiveClip, below_statistic, share_multiplier
from fedpers.privacy.mechanisms import psd_sensitivity
from fedpers.protocols.base import (
    Message,
    NodeSide,
    Protocol,
    StatSpec,
    Units,
    UnitStatistics,
    all_take_part,
    cohort_size,
)

Tensor = torch.Tensor
LOCAL_RIDGE = 1e-8


def samples_of(units: Units, a: int, b: int) -> tuple[Tensor, Tensor]:
    """(x, y) of samples [a, b) of every unit. A chunk made for one pass may hold only the samples
    that pass reads, from ``units["first_sample"]`` on (the same for every unit; see
    ``fedpers.experiments.altmin.load_units``); without that key x holds all of them."""
    x, y = units["x"], units["y"]
    first = units.get("first_sample")
    off = int(first[0]) if first is not None and first.numel() else 0
    if a < off or b - off > x.shape[1]:
        raise ValueError(f"samples [{a}, {b}) are not in this chunk (it holds [{off}, {off + x.shape[1]}))")
    return x[:, a - off : b - off], y[:, a - off : b - off]


def cohort_permutation(seed: int, n: int, block: int = 1) -> Tensor:
    """A public permutation of n user ids from ``seed`` alone: the runs [b·block, (b+1)·block) in
    the order of ``randperm`` of the runs, ids in order within a run (block 1: ``randperm(n)``)."""
    g = torch.Generator().manual_seed(seed)
    if block <= 1:
        return torch.randperm(n, generator=g)
    runs = torch.randperm(-(-n // block), generator=g)
    perm = (runs.unsqueeze(1) * block + torch.arange(block)).flatten()
    return perm[perm < n]


@dataclass(frozen=True)
class AltMinProtocol(Protocol):
    """Public parameters of one private AltMin run (everything here is data-independent)."""

    n_users: int
    dim: int
    rank: int
    samples_per_user: int
    rounds: int
    eta: float
    zeta: float
    noise_multiplier: float
    cohorts: Cohorts = Cohorts.DISJOINT
    cohort_seed: int = 0
    psd: PsdMethod = PsdMethod.EIGEN_FLOOR
    dtype_name: str = "float64"
    sampling_rate: float = 1.0
    """q with ``Cohorts.POISSON``: each round 1..T includes every user independently with
    probability q, drawn on the server from the Privatizer's sampling generator."""
    device_kernels: bool = False
    """The device path (``--kernels``): statistics as a few large batched kernels per chunk
    (:func:`fedpers.linalg.kron_statistics`), the same sums to float rounding."""
    cohort_block: int = 1
    """Disjoint cohorts permute runs of this many consecutive user ids (public, data-independent):
    1 permutes users; synthetic i.i.d. users use their generation block, so a round generates
    only its cohort's blocks (docs/benchmarks.md, "Synthetic users")."""
    clip_quantile: float = 0.0
    """γ_η > 0: adaptive clipping of η and ζ (Andrew et al. 2021; docs/algorithms.md §6): ``eta`` and
    ``zeta`` are round 1's bounds; each round also releases two noisy counts (the part of each
    user's Q2 samples within η_t, and within ζ_t) and moves each bound toward its quantile."""
    label_clip_quantile: float = 0.0
    """γ_ζ: the target fraction of Q2 labels with |y| ≤ ζ_t (adaptive clipping only)."""
    clip_lr: float = 0.2
    """η_C: the adaptive bounds' geometric step."""
    count_shares: tuple[float, float] = (0.0, 0.0)
    """(f_A, f_b): shares of each round's μ² spent on η's and ζ's counts; A and b take the rest."""
    _cohort_cache: dict = field(default_factory=dict, repr=False, compare=False)

    name = "altmin"

    @property
    def num_rounds(self) -> int:
        return self.rounds + 1

    @property
    def quarter(self) -> int:
        return self.samples_per_user // 4

    # ----- privacy bookkeeping -------------------------------------------------------
    @property
    def init_bound(self) -> float:
        """Per-user Frobenius bound of the init statistic: (pairs) ζ², pairs = m/4."""
        return self.quarter * self.zeta**2

    @property
    def a_bound(self) -> float:
        return self.quarter * self.eta**2

    @property
    def b_bound(self) -> float:
        return self.quarter * self.eta * self.zeta

    @property
    def a_sensitivity(self) -> float:
        """√2·|Q2|η²: every A_j is PSD; 2·|Q2|η² when Poisson-sampled (see ``Privatizer.symmetric_gaussian_sum``)."""
        return self.a_sensitivity_of(self.a_bound)

    def a_sensitivity_of(self, bound: float, neighbours: Neighbours | str = Neighbours.REPLACE_ONE) -> float:
        """Δ of an A release whose users' A_j are PSD with ‖A_j‖_F ≤ ``bound``, under ``neighbours``."""
        sampled = self.cohorts is Cohorts.POISSON and self.sampling_rate < 1.0
        return psd_sensitivity(bound, self.sampling_rate if sampled else 1.0, neighbours)

    @property
    def psd_statistics(self) -> tuple[str, ...]:
        """Statistics whose every unit's contribution is PSD and released with the √2 bound (A_j =
        (v̂v̂ᵀ) ⊗ Σ m²x̂x̂ᵀ; not under Poisson sampling): distributed DP keeps the tightening after rounding."""
        return () if self.cohorts is Cohorts.POISSON and self.sampling_rate < 1.0 else ("A",)

    def noise_std(
        self,
        bound: float,
        sensitivity: float | None = None,
        multiplier: float | None = None,
        neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
    ) -> float:
        """σ = z·Δ/κ with Δ = κ·bound unless given (κ = 2 replace-one, 1 add-remove; 0 without noise);
        ``multiplier`` in place of z."""
        factor = neighbours_of(neighbours).sensitivity_factor
        delta = factor * bound if sensitivity is None else sensitivity
        z = self.noise_multiplier if multiplier is None else multiplier
        return z * delta / factor if self.noise_multiplier > 0 else 0.0

    @property
    def adaptive(self) -> bool:
        return self.clip_quantile > 0

    @property
    def round_multiplier(self) -> float:
        """Multiplier of A and of b: z/√(1 − f_A − f_b) (z itself with fixed bounds)."""
        return share_multiplier(self.noise_multiplier, 1.0 - sum(self.count_shares))

    def count_multiplier(self, statistic: str) -> float:
        """Multiplier of η's (``A``) or ζ's (``b``) count: z/√(2f). A round's A, b and two counts
        have μ² 2(1 − f_A − f_b)/z² + 2f_A/z² + 2f_b/z² = 2/z², a fixed-bound round's."""
        f = self.count_shares[0 if statistic == "A" else 1]
        return share_multiplier(self.noise_multiplier, 2 * f)

    def round_bounds(self, state: Mapping[str, Tensor]) -> tuple[float, float]:
        """(η_t, ζ_t) of a round: public state made from released counts, or the fixed bounds."""
        if self.adaptive:
            return float(state["eta"]), float(state["zeta"])
        return self.eta, self.zeta

    def cohort_size(self, round: int) -> float:
        """Public number of users of round ``round`` ≥ 1: the disjoint cohort's size (from public n
        and T), n with ``all``, the expected q·n when Poisson-sampled."""
        n, T = self.n_users, self.rounds
        if self.cohorts is Cohorts.DISJOINT:
            return float(-(-round * n // T) - -(-(round - 1) * n // T))
        return n * (self.sampling_rate if self.cohorts is Cohorts.POISSON else 1.0)

    def permutation(self) -> Tensor:
        """The public permutation of all n users that the disjoint cohorts cut into T parts:
        ``randperm`` of the runs of :attr:`cohort_block` consecutive ids, each run in id order."""
        if "perm" not in self._cohort_cache:
            self._cohort_cache["perm"] = cohort_permutation(self.cohort_seed, self.n_users, self.cohort_block)
        return self._cohort_cache["perm"]

    def cohort_digest(self) -> str:
        """SHA-256 of :meth:`permutation` (recorded per release, so a reader can check the cohorts)."""
        if "digest" not in self._cohort_cache:
            self._cohort_cache["digest"] = hashlib.sha256(
                self.permutation().numpy().astype("<i8").tobytes()
            ).hexdigest()
        return self._cohort_cache["digest"]

    def release_params(self, statistic: str) -> dict[str, Any]:
        """Public inputs of a release's bound, written into the ledger."""
        common = {
            "statistic": statistic,
            "samples_per_user_cap": self.samples_per_user,
            "pairs_or_Q2": self.quarter,
            "eta": self.eta,
            "zeta": self.zeta,
            "cohorts": self.cohorts.value,
        }
        if self.cohorts is Cohorts.DISJOINT and statistic != "W":
            common["cohort_seed"] = self.cohort_seed
            common["cohort_block"] = self.cohort_block
            common["cohort_digest"] = self.cohort_digest()
        formula = {
            "W": "bound (m/4)·ζ², Δ = 2·bound",
            "A": "bound |Q2|·η², Δ = 2·bound (Poisson-sampled: no PSD tightening)"
            if self.cohorts is Cohorts.POISSON and self.sampling_rate < 1.0
            else "bound |Q2|·η², Δ = √2·bound (PSD per user)",
            "b": "bound |Q2|·η·ζ, Δ = 2·bound",
        }[statistic]
        return {**common, "formula": formula}

    @property
    def rounds_in(self) -> int:
        """Rounds one user may take part in: 1 with disjoint cohorts, else T."""
        return 1 if self.cohorts is Cohorts.DISJOINT else self.rounds

    def releases_per_user(self) -> int:
        """Gaussian releases that touch one user: init, plus (A, b) per round the user may be in,
        and with adaptive bounds the round's two counts."""
        return 1 + (4 if self.adaptive else 2) * self.rounds_in

    @staticmethod
    def user_event(
        noise_multiplier: float,
        releases: int,
        sampling_rate: float = 1.0,
        count_shares: tuple[float, float] = (0.0, 0.0),
    ) -> dp_accounting.DpEvent:
        """Init plus (A, b) pairs; with count shares (f_A, f_b) > 0 a round is A and b at
        z/√(1 − f_A − f_b) and η's and ζ's counts at z/√(2f_A), z/√(2f_b) (``releases`` then counts
        4 per round). With Poisson sampling (q < 1) a round's releases are computed on one sample,
        so they are one sampled mechanism: their Gaussians compose to z/√2 (the shares add up),
        then Poisson-sampled at q (what the ledger's accountant merges them into)."""
        g = dp_accounting.GaussianDpEvent(noise_multiplier)
        adaptive = sum(count_shares) > 0
        rounds_in = (releases - 1) // (4 if adaptive else 2)
        if sampling_rate < 1.0:
            pair = dp_accounting.PoissonSampledDpEvent(
                sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier / math.sqrt(2.0))
            )
            return dp_accounting.ComposedDpEvent([g] + [pair] * rounds_in)
        if not adaptive:
            return dp_accounting.ComposedDpEvent([g] * releases)
        f_a, f_b = count_shares
        per_round = [
            dp_accounting.GaussianDpEvent(share_multiplier(noise_multiplier, 1.0 - f_a - f_b)),
            dp_accounting.GaussianDpEvent(share_multiplier(noise_multiplier, 1.0 - f_a - f_b)),
            dp_accounting.GaussianDpEvent(share_multiplier(noise_multiplier, 2 * f_a)),
            dp_accounting.GaussianDpEvent(share_multiplier(noise_multiplier, 2 * f_b)),
        ]
        return dp_accounting.ComposedDpEvent([g] + per_round * rounds_in)

    def group(self, round: int) -> str:
        if round == 0 or self.cohorts is not Cohorts.DISJOINT:
            return ALL_UNITS
        return f"cohort:{round}"

    def cohort_of(self, ids: Tensor) -> Tensor:
        """Cohort (1..T) of each user id, from a public permutation of all n users."""
        key = str(ids.device)
        if key not in self._cohort_cache:
            perm = self.permutation()
            position = torch.empty_like(perm)
            position[perm] = torch.arange(self.n_users)
            self._cohort_cache[key] = to_device(position * self.rounds // self.n_users + 1, ids.device)
        return self._cohort_cache[key][ids]

    # ----- protocol ------------------------------------------------------------------
    def node_side(self) -> NodeSide | str:
        """Every release is a Gaussian sum (W, A, b) at z; adaptive bounds' counts are not. Poisson cohorts
        declare their rate (A is then not PSD-tightened: :attr:`psd_statistics`)."""
        if self.adaptive:
            return f"{self.name} with adaptive clipping (its count releases; use --clip-rule fixed)"
        if self.cohorts is Cohorts.POISSON and self.sampling_rate < 1.0:  # the nodes draw the memberships
            return NodeSide(self.noise_multiplier, self.psd_statistics, sampling_rate=self.sampling_rate)
        return NodeSide(self.noise_multiplier, self.psd_statistics)

    def unit_keys(self) -> tuple[str, ...]:
        return ("x", "y")

    def units_needed(self, round: int, broadcast: Mapping[str, Tensor]) -> tuple[Tensor | None, tuple[int, int] | None]:
        """Round 0 reads every user's second half (Q3, Q4); round r ≥ 1 its cohort's first half
        (Q1, Q2): a disjoint cohort from the public permutation, a Poisson one from ``sampled``."""
        h = 2 * self.quarter
        if round == 0:
            return None, (h, 2 * h)
        if self.cohorts is Cohorts.DISJOINT:
            key = f"ids{round}"
            if key not in self._cohort_cache:
                self._cohort_cache[key] = (self.cohort_of(torch.arange(self.n_users)) == round).nonzero().squeeze(1)
            return self._cohort_cache[key], (0, h)
        if self.cohorts is Cohorts.POISSON:
            return (broadcast["sampled"].cpu() > 0).nonzero().squeeze(1), (0, h)
        return None, (0, h)

    def round_share(self, round: int) -> float:
        """Share of the n users a round reads (for time estimates): all in round 0 and with
        ``all``, a 1/T cohort when disjoint, q when Poisson-sampled."""
        if round == 0 or self.cohorts is Cohorts.ALL:
            return 1.0
        return 1.0 / self.rounds if self.cohorts is Cohorts.DISJOINT else self.sampling_rate

    def units_in_round(self, round: int, units: Units) -> int:
        if round == 0 or self.cohorts is not Cohorts.DISJOINT:  # Poisson: at most all of them
            return int(units["ids"].shape[0])
        return int((self.cohort_of(units["ids"]) == round).sum())

    def initial_state(self) -> dict[str, Tensor]:
        return {}

    def broadcast(self, state: Mapping[str, Tensor], round: int) -> dict[str, Tensor]:
        if round == 0:
            return {}
        out = {"U": state["U"]}
        if self.cohorts is Cohorts.POISSON:  # this round's membership (see docs/fedrep.md: who may see it)
            out["sampled"] = state["sampled"]
        if self.adaptive:  # η_t, ζ_t: public, made from released counts only
            out["eta"], out["zeta"] = state["eta"], state["zeta"]
        return out

    def stat_specs(self, round: int) -> tuple[StatSpec, ...]:
        d, k = self.dim, self.rank
        if round == 0:
            return (StatSpec("W", (d, d), self.init_bound, symmetric=True),)
        if self.adaptive:
            # A_j/η_t² and b_j/(η_t ζ_t) (bound |Q2| each) and the two counts: bounds that do not depend on the round
            return (
                StatSpec("A", (d * k, d * k), float(self.quarter), symmetric=True),
                StatSpec("b", (d * k,), float(self.quarter)),
                StatSpec("below_eta", (), COUNT_BOUND),
                StatSpec("below_zeta", (), COUNT_BOUND),
            )
        return (StatSpec("A", (d * k, d * k), self.a_bound, symmetric=True), StatSpec("b", (d * k,), self.b_bound))

    def client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        with linalg.serial_small_ops(units["x"].device):  # many small ops; the heavy sums run in shares
            return self._client_update(round, broadcast, units)

    def _client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        ids, h = units["ids"], 2 * self.quarter
        if round == 0:
            x, y = samples_of(units, h, 2 * h)
            return Message({"W": self.pair_statistic(x.to(self.dtype), y.to(self.dtype))}, int(ids.shape[0]))
        x, y = samples_of(units, 0, h)
        x, y = x.to(self.dtype), y.to(self.dtype)
        keep = None
        if self.cohorts is Cohorts.DISJOINT:
            keep = self.cohort_of(ids) == round
        elif self.cohorts is Cohorts.POISSON:
            keep = broadcast["sampled"].to(ids.device)[ids] > 0
        # a chunk made for this round is all cohort: no copy (and, on a GPU, no read)
        if keep is not None and not all_take_part(keep) and not bool(keep.all()):
            x, y = x[keep], y[keep]
        if self.adaptive:
            eta, zeta = float(broadcast["eta"]), float(broadcast["zeta"])
            A, b, within_eta, within_zeta = self.scaled_round_statistics(broadcast["U"].to(self.dtype), x, y, eta, zeta)
            stats = {
                "A": A,
                "b": b,
                "below_eta": below_statistic(within_eta, self.dtype),
                "below_zeta": below_statistic(within_zeta, self.dtype),
            }
            return Message(stats, int(x.shape[0]))
        A, b = self.round_statistics(broadcast["U"].to(self.dtype), x, y)
        return Message({"A": A, "b": b}, int(x.shape[0]))

    def unit_statistics(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> UnitStatistics | None:
        """Each user's own W_j (round 0) or (A_j, b_j), batched: the ops :meth:`client_update` runs on one
        user (its pair statistic, its local solve, :func:`~fedpers.linalg._one_unit_statistics`) on every
        user of the batch at once. A user whose norms that path would not trust as computed
        (:func:`~fedpers.linalg.trusted_rows`: it takes the exact power-of-two branch alone) is left to be
        computed alone. Fixed bounds on the host path only (the device path's one-user statistics are its
        blocked kernels; adaptive bounds are not node-side)."""
        if self.adaptive or self.device_kernels:
            return None
        ids, h, q = units["ids"], 2 * self.quarter, self.quarter
        everyone = torch.arange(int(ids.shape[0]), device=ids.device)
        if round == 0:
            x, y = samples_of(units, h, 2 * h)
            x, y = x.to(self.dtype), y.to(self.dtype)
            ok = linalg.trusted_rows(x[:, 0::2]) & linalg.trusted_rows(x[:, 1::2])
            W = linalg.pair_statistics(x[ok], y[ok], self.zeta)
            return UnitStatistics(ids[ok], {"W": W}, everyone[~ok])
        x, y = samples_of(units, 0, h)
        x, y = x.to(self.dtype), y.to(self.dtype)
        if self.cohorts is Cohorts.DISJOINT:
            taking = (self.cohort_of(ids) == round).nonzero().squeeze(1)
        elif self.cohorts is Cohorts.POISSON:
            taking = (broadcast["sampled"].to(ids.device)[ids] > 0).nonzero().squeeze(1)
        else:
            taking = everyone
        x, y, ids = x[taking], y[taking], ids[taking]
        U = broadcast["U"].to(self.dtype)
        features = x[:, :q] @ U
        ok = linalg.trusted_rows(features) & linalg.trusted_rows(y[:, :q]) & linalg.trusted_rows(x[:, q : 2 * q])
        v = linalg.batched_ridge_solve(features[ok], y[ok, :q], LOCAL_RIDGE)
        fine = linalg.trusted_rows(v)  # its directions: the plain branch (each user's own check alone)
        ok[ok.clone()] = fine
        v_hat, log_v = linalg.directions(v[fine])
        x2, y2 = x[ok, q : 2 * q], y[ok, q : 2 * q]
        A, b = linalg.kron_unit_statistics(v_hat, x2, log_v, self.eta, linalg.clip_scalar(y2, self.zeta))
        return UnitStatistics(ids[ok], {"A": A, "b": b}, taking[~ok])

    def server_update(
        self, round: int, state: Mapping[str, Tensor], summed: Message, privatizer: Privatizer
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        z, group = self.noise_multiplier, self.group(round)
        if round == 0:
            M = privatizer.symmetric_gaussian_sum(
                summed.stats["W"],
                per_unit_bound=self.init_bound,
                noise_multiplier=z,
                name="init.W",
                round=0,
                units=group,
                params=self.release_params("W"),
            )
            state = {"U": linalg.top_eigenvectors(M.double(), self.rank).to(M.dtype)}
            if self.adaptive:  # round 1's bounds: the configured η and ζ
                state["eta"] = torch.tensor(self.eta, dtype=torch.float64)
                state["zeta"] = torch.tensor(self.zeta, dtype=torch.float64)
            return self._next_sample(state, privatizer), {"noise_std_W": self.noise_std(self.init_bound)}
        q = self.sampling_rate if self.cohorts is Cohorts.POISSON and z > 0 else 1.0
        shared = (
            {"poisson_sample": f"round{round}", "sampling": f"poisson q={self.sampling_rate}"}
            if self.cohorts is Cohorts.POISSON
            else {}
        )
        eta, zeta = self.round_bounds(state)
        # adaptive: A_j/η_t² and b_j/(η_t ζ_t) are released (bound |Q2|) and scaled back by the public bounds
        a_bound, b_bound = (float(self.quarter),) * 2 if self.adaptive else (self.a_bound, self.b_bound)
        a_params, b_params = self.release_params("A"), self.release_params("b")
        if self.adaptive:
            a_params.update(eta=eta, formula=f"bound |Q2| on A_j/η_t², {a_params['formula'].split(', ', 1)[1]}; × η_t²")
            b_params.update(eta=eta, zeta=zeta, formula="bound |Q2| on b_j/(η_t ζ_t), Δ = 2·bound; × η_t ζ_t")
        z = self.round_multiplier
        A = privatizer.symmetric_gaussian_sum(
            summed.stats["A"],
            per_unit_bound=a_bound,
            noise_multiplier=z,
            name=f"round{round}.A",
            round=round,
            units=group,
            psd_units=True,
            params={**a_params, **shared},
            sampling_probability=q,
        )
        b = privatizer.gaussian_sum(
            summed.stats["b"],
            per_unit_bound=b_bound,
            noise_multiplier=z,
            name=f"round{round}.b",
            round=round,
            units=group,
            params={**b_params, **shared},
            sampling_probability=q,
        )
        new: dict[str, Tensor] = {}
        counts: dict[str, float] = {}
        if self.adaptive:
            A, b = A * eta**2, b * (eta * zeta)
            size = self.cohort_size(round)
            for stat, bound, quantile, key in (
                ("A", eta, self.clip_quantile, "eta"),
                ("b", zeta, self.label_clip_quantile, "zeta"),
            ):
                what = "‖v_j‖‖x_ij‖ ≤ η_t" if key == "eta" else "|y_ij| ≤ ζ_t"
                fraction, following = AdaptiveClip(quantile, self.clip_lr).release(
                    privatizer,
                    summed.stats[f"below_{key}"],
                    bound=bound,
                    size=size,
                    noise_multiplier=self.count_multiplier(stat),
                    name=f"round{round}.below_{key}",
                    round=round,
                    statistic=f"Σ_j (fraction of user j's Q2 samples with {what} − 1/2)",
                    units=group,
                    params=dict(shared),
                    sampling_probability=q,
                )
                new[key] = torch.tensor(following, dtype=torch.float64)
                counts[f"{key}_t"], counts[f"noisy_fraction_below_{key}"] = bound, fraction
        # σ of A's noise after scaling back (the PSD floor is data-independent: public bounds only)
        relation = privatizer.neighbours
        noise_std_a = self.noise_std(a_bound, self.a_sensitivity_of(a_bound, relation), z, relation) * (
            eta**2 if self.adaptive else 1.0
        )
        U, info = self.solve_subspace(A, b, noise_std_a=noise_std_a)
        info.update(counts)
        if self.cohorts is Cohorts.POISSON:
            info.update(cohort_size("sampled_users", summed, privatizer, self.sampling_rate))
        return self._next_sample({"U": U, **new}, privatizer), info

    def _next_sample(self, state: dict[str, Tensor], privatizer: Privatizer) -> dict[str, Tensor]:
        """With Poisson cohorts, draw the next round's members now (the server's private
        sampling generator; clients cannot predict it)."""
        if self.cohorts is Cohorts.POISSON:
            state["sampled"] = privatizer.poisson_sample(self.n_users, self.sampling_rate).to(torch.float64)
        return state

    # ----- the math ------------------------------------------------------------------
    def init_statistic(self, x: Tensor, y: Tensor) -> Tensor:
        """Σ_users Σ_pairs sym(x̂_a x̂_bᵀ clip(y_a) clip(y_b)) over the second half (Algorithm 3).

        x̂ = x/||x|| (0 for x = 0) is formed without overflow, so each pair's term has
        Frobenius norm ≤ ζ² for every finite input.
        """
        h = 2 * self.quarter
        return self.pair_statistic(x[:, h : 2 * h], y[:, h : 2 * h])

    def pair_statistic(self, x2: Tensor, y2: Tensor) -> Tensor:
        """:meth:`init_statistic` of the second half's samples x2, y2 alone."""
        with linalg.serial_small_ops(x2.device):
            return linalg.pair_statistic(x2, y2, self.zeta, device_kernels=self.device_kernels)

    def local_solve(self, U: Tensor, x: Tensor, y: Tensor) -> Tensor:
        """v_j = argmin_v Σ_i (y_ij − <Uᵀx_ij, v>)² for every user (tiny ridge for safety)."""
        return self.local_solve_features(x @ U, y)

    def local_solve_features(self, features: Tensor, y: Tensor) -> Tensor:
        """:meth:`local_solve` from the features x_ij U already formed."""
        return linalg.batched_ridge_solve(features, y, LOCAL_RIDGE)

    def scaled_round_statistics(
        self, U: Tensor, x: Tensor, y: Tensor, eta: float, zeta: float
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Adaptive bounds (η_t, ζ_t): (Σ_j A_j/η_t², Σ_j b_j/(η_t ζ_t), per-user fraction of Q2 samples
        with ‖v_j‖‖x_ij‖ ≤ η_t, per-user fraction with |y_ij| ≤ ζ_t), for every finite input
        ‖A_j/η_t²‖_F ≤ |Q2|, ‖b_j/(η_t ζ_t)‖ ≤ |Q2| and fractions in [0, 1].

        The clip is taken at 1 on ‖v_j‖‖x_ij‖/η_t (log-norms, never overflowing) and the labels are
        clip(y; ζ_t)/ζ_t, so the scaled statistics are bounded without dividing a clipped sum.
        """
        q, d, k = self.quarter, self.dim, self.rank
        if x.shape[0] == 0:
            zero = torch.zeros(0, dtype=x.dtype, device=x.device)
            return (
                torch.zeros(d * k, d * k, dtype=x.dtype, device=x.device),
                torch.zeros(d * k, dtype=x.dtype, device=x.device),
                zero,
                zero,
            )
        v_hat, log_v = self.v_directions(U, x[:, :q], y[:, :q])
        x2, y2 = x[:, q : 2 * q], y[:, q : 2 * q]
        A, b = linalg.kron_statistics(
            v_hat,
            x2,
            log_v - math.log(eta),
            1.0,
            label=linalg.clip_scalar(y2, zeta) / zeta,
            device_kernels=self.device_kernels,
        )
        # an overflowing norm (inf) counts as beyond the bound, a zero one (log −inf) as within it
        log_x = torch.linalg.vector_norm(x2, dim=-1).double().log()
        within_eta = (log_v.double().unsqueeze(-1) + log_x <= math.log(eta)).double().mean(-1)
        within_zeta = (y2.abs() <= zeta).double().mean(-1)
        return A, b, within_eta, within_zeta

    def v_directions(self, U: Tensor, x1: Tensor, y1: Tensor) -> tuple[Tensor, Tensor]:
        """(v̂_j, log‖v_j‖) of every user's local solve on Q1 (x1, y1), finite for every finite input:
        where :func:`~fedpers.linalg.safe_norms` does not trust the features or labels, v_j is solved
        on Q1 scaled by powers of two (exact) and its log-norm corrected."""
        features = x1 @ U  # the local solve's only use of x1: check the k-dim features, not the d-dim x
        if linalg.safe_norms(features) is not None and linalg.safe_norms(y1) is not None:
            return linalg.directions(linalg.batched_ridge_solve(features, y1, LOCAL_RIDGE))
        sx, sy = linalg.pow2_scale(x1, 2), linalg.pow2_scale(y1, 1)
        v = self.local_solve(U, x1 / sx[:, None, None], y1 / sy[:, None])  # v_j · sx/sy
        v_hat, log_v = linalg.directions(v)
        return v_hat, log_v + sy.double().log() - sx.double().log()

    def round_statistics(self, U: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Σ_j A_j and Σ_j b_j (Algorithm 2) in Kronecker form, stable for every finite input.

        With w_ij = clip(v_j ⊗ x_ij; η) = m_ij (v̂_j ⊗ x̂_ij), m_ij = min(||v_j||·||x_ij||, η):
        A_j = (v̂_j v̂_jᵀ) ⊗ Σ_i m_ij² x̂_ij x̂_ijᵀ and b_j = v̂_j ⊗ Σ_i clip(y_ij; ζ) m_ij x̂_ij.
        ||v_j|| is folded into m_ij through logs, and where the features x_ij U or the labels on
        Q1 have norms :func:`~fedpers.linalg.safe_norms` does not trust, v_j is solved on Q1
        scaled by powers of two (exact), so no intermediate overflows: ||A_j||_F ≤ |Q2|η²,
        ||b_j|| ≤ |Q2|ηζ.
        """
        with linalg.serial_small_ops(x.device):  # many small ops; the heavy sums run in shares
            return self._round_statistics(U, x, y)

    def _round_statistics(self, U: Tensor, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        q, d, k = self.quarter, self.dim, self.rank
        if x.shape[0] == 0:
            return torch.zeros(d * k, d * k, dtype=x.dtype, device=x.device), torch.zeros(
                d * k, dtype=x.dtype, device=x.device
            )
        v_hat, log_v = self.v_directions(U, x[:, :q], y[:, :q])
        x2 = x[:, q : 2 * q]
        # Q2: one pass for the norms and clip factors min(||v||, η/||x||), then A and b per block in cache
        A, b = linalg.kron_statistics(
            v_hat,
            x2,
            log_v,
            self.eta,
            label=linalg.clip_scalar(y[:, q : 2 * q], self.zeta),
            device_kernels=self.device_kernels,
        )
        return A, b

    def solve_subspace(self, A: Tensor, b: Tensor, noise_std_a: float) -> tuple[Tensor, dict[str, float]]:
        """u = argmin uᵀAu − 2uᵀb after making A positive definite; U = Q of QR(mat(u)).

        The floor / ridge is 2σ_A√(dk), about the spectral norm of the symmetric noise, so
        it is data-independent and spends no privacy.
        """
        dk, dtype = A.shape[0], A.dtype
        A, b = A.double(), b.double()  # summed in the working dtype, solved in float64 (dk × dk: cheap)
        with linalg.one_thread(A):
            scale = float(torch.linalg.matrix_norm(A, ord=2)) if noise_std_a == 0 else 0.0
        level = 2 * noise_std_a * math.sqrt(dk) + 1e-10 * max(scale, 1e-30)
        if self.psd is PsdMethod.EIGEN_FLOOR:
            A_pd, raised = linalg.psd_eigen_floor(A, level)
        else:
            A_pd, raised = A + level * torch.eye(dk, dtype=A.dtype, device=A.device), 0
        with linalg.one_thread(A_pd):
            u = torch.linalg.solve(A_pd, b)
        U = linalg.orthonormal_basis(linalg.vec_to_matrix(u, self.dim, self.rank)).to(dtype)
        return U, {"psd_level": level, "eigenvalues_raised": float(raised)}

    def personalize(self, U: Tensor, units: Units) -> Tensor:
        """Final local solve of every user's v_j on Q3∪Q4 with the last U (billboard model: never sent)."""
        h = 2 * self.quarter
        x, y = samples_of(units, h, 2 * h)
        return self.local_solve(U.to(self.dtype), x.to(self.dtype), y.to(self.dtype))
