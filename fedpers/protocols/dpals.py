"""DPALS: user-level private alternating least squares for matrix completion
(Jain–Thakkar–Thakurta 2018; Chien et al., "Private Alternating Least Squares", ICML 2021).

Units are users. Each user j holds ragged ratings, padded to width L: ``items`` (L,),
``ratings`` (L,), ``mask`` (L,) (True for a real training rating). Round t: the server
broadcasts the item embeddings U (items × k); user j solves v_j = (U_Iᵀ U_I + λI)⁻¹ U_Iᵀ r_I
on its own ratings, takes the first B of its rated items (the loader orders each user's
items by a permutation derived from the public seed and the user id), and sends per item i
the statistics G_i = v_j v_jᵀ and b_i = r_ij v_j, scatter-added into (items, k, k) and
(items, k) — never a dense (items·k)² matrix.

Per-user clipping (scale-safe): the user's whole G collection has Frobenius norm
√n_j·||v||², clipped to Γ_G; its b collection has norm ||r||·||v||, clipped to Γ_b. Both are
formed from unit directions v̂ = v/||v||, r̂ = r/||r|| and magnitudes min(·, Γ) computed in
log space (:func:`fedpers.linalg.clipped_magnitude`), so no finite rating or embedding can
overflow. Even v is solved on r̂ (v is linear in r) and rescaled through its log-norm.

Optional round 0 (``prelude``): each user sends, over the same first B of its rated items, its
ratings (the vector clipped to √B·c_r) and its indicators, scatter-added into per-item sums s
and counts c, each with a total entry (see :func:`item_counts`; bounds √2·√B·c_r and √(2B)),
each one Gaussian release. Post-processing gives the private global mean μ̂ = s_total/c_total
(subtracted from every rating in the ALS rounds), private item means (s_i + κμ̂)/(c_i⁺ + κ)
(a baseline), and the head items: the H largest noisy counts;
the others keep U_i = 0 (predicted by μ̂) and receive no statistics.

Server: one Gaussian release per statistic through the Privatizer. G is released as the
upper triangles of its blocks (items, k(k+1)/2), whose norm is ≤ ||G||_F; the replace-one
sensitivity used is the general 2·Γ (the √2·Γ PSD bound is not claimed here). Each noisy
block is repaired to PSD (eigenvalues floored at 0), and U_i = (G_i + λI)⁻¹ b_i.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedpers import linalg
from fedpers.privacy import Privatizer
from fedpers.protocols.base import Message, Protocol, StatSpec, Units

Tensor = torch.Tensor


def user_embeddings(U: Tensor, items: Tensor, ratings: Tensor, mask: Tensor, ridge: float) -> tuple[Tensor, Tensor]:
    """(v̂, log||v||) with v_j = (U_Iᵀ U_I + λI)⁻¹ U_Iᵀ r_I over each user's masked ratings.

    Solved on r̂ = r/||r|| (v is linear in r) so a huge rating cannot overflow; users with no
    ratings or all-zero ratings get v = 0 (log-norm −inf)."""
    m = mask.to(U.dtype)
    r_unit, log_rn = linalg.directions(ratings.to(U.dtype) * m)
    F = U[items] * m.unsqueeze(-1)  # (n, L, k)
    k = U.shape[1]
    A = F.transpose(1, 2) @ F + ridge * torch.eye(k, dtype=U.dtype, device=U.device)
    rhs = (F.transpose(1, 2) @ r_unit.unsqueeze(-1)).squeeze(-1)
    w = torch.linalg.solve(A, rhs)
    v_unit, log_wn = linalg.directions(w)
    return v_unit, log_wn + log_rn


def selected(mask: Tensor, items_per_user: int) -> Tensor:
    """The first B of each user's rated items (the loader's public per-user order)."""
    return mask & (torch.cumsum(mask.to(torch.int64), dim=1) <= items_per_user)


def item_counts(
    items: Tensor, ratings: Tensor, mask: Tensor, items_per_user: int, n_items: int, rating_bound: float
) -> tuple[Tensor, Tensor]:
    """Per-item sums (s, c), each with one more entry for the totals, of the users' selected
    ratings (each user's vector clipped to ``rating_bound``, scale-safe) and indicators.

    Entry ``n_items`` of a user's s is Σ_i r_i/√B (|·| ≤ its vector's norm, Cauchy–Schwarz) and of
    its c is count/√B (≤ √count): the user's s has norm ≤ √2·bound, its c ≤ √(2B). The totals give
    the global mean with noise √B·σ instead of √items·σ from summing the per-item entries."""
    sel = selected(mask, items_per_user)
    r_unit, log_rn = linalg.directions(ratings * sel.to(ratings.dtype))
    r = r_unit * linalg.clipped_magnitude(log_rn, rating_bound).to(ratings.dtype).unsqueeze(-1)
    flat = items[sel]
    root_b = math.sqrt(items_per_user)
    s = torch.zeros(n_items + 1, dtype=ratings.dtype, device=ratings.device).index_add_(0, flat, r[sel])
    c = torch.zeros(n_items + 1, dtype=ratings.dtype, device=ratings.device).index_add_(
        0, flat, torch.ones_like(r[sel])
    )
    s[n_items] = (r.sum(1) / root_b).sum()
    c[n_items] = (sel.sum(1).to(ratings.dtype) / root_b).sum()
    return s, c


def item_statistics(
    U: Tensor,
    items: Tensor,
    ratings: Tensor,
    mask: Tensor,
    ridge: float,
    items_per_user: int,
    gram_bound: float,
    rhs_bound: float,
) -> tuple[Tensor, Tensor]:
    """Per-item sums (G (items, k, k), b (items, k)) of the users' clipped contributions."""
    n_items, k = U.shape
    v_unit, log_vn = user_embeddings(U, items, ratings, mask, ridge)
    sel = selected(mask, items_per_user)
    s = sel.to(U.dtype)
    count = s.sum(1).double()
    log_g = 2 * log_vn
    g_mag = linalg.clipped_magnitude(log_g + 0.5 * count.clamp_min(1).log(), gram_bound) / count.clamp_min(1).sqrt()
    r_unit, log_rn = linalg.directions(ratings.to(U.dtype) * s)
    b_mag = linalg.clipped_magnitude(log_rn + log_vn, rhs_bound)
    g_mag = torch.where(count > 0, g_mag, torch.zeros_like(g_mag)).to(U.dtype)
    b_mag = b_mag.to(U.dtype)
    outer = (v_unit.unsqueeze(-1) * v_unit.unsqueeze(-2)).reshape(-1, k * k).contiguous()  # (n, k²), norm 1 or 0
    rows, cols = sel.nonzero(as_tuple=True)
    flat_items = items[rows, cols]
    # per-item sums as one sparse (items × users) CSR product: nnz·k² work, no (nnz, k, k)
    # temporary (CSR: about 10× faster than COO on CPU for power-law items)
    order = torch.argsort(flat_items, stable=True)
    crow = torch.zeros(n_items + 1, dtype=torch.int64, device=U.device)
    crow[1:] = torch.cumsum(torch.bincount(flat_items, minlength=n_items), 0)
    users, n = rows[order], v_unit.shape[0]
    G = _csr(crow, users, g_mag[rows][order], (n_items, n)) @ outer
    b = _csr(crow, users, (r_unit[rows, cols] * b_mag[rows])[order], (n_items, n)) @ v_unit
    return G.reshape(n_items, k, k), b


def _csr(crow: Tensor, col: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the product used here is stable
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False)


def triu_pack(G: Tensor) -> Tensor:
    k = G.shape[-1]
    i, j = torch.triu_indices(k, k, device=G.device)
    return G[..., i, j]


def triu_unpack(t: Tensor, k: int) -> Tensor:
    i, j = torch.triu_indices(k, k, device=t.device)
    G = t.new_zeros(*t.shape[:-1], k, k)
    G[..., i, j] = t
    G[..., j, i] = t
    return G


def psd_floor(G: Tensor) -> tuple[Tensor, int]:
    """(sym(G_i) with eigenvalues floored at 0, number of blocks repaired): blocks a batched
    Cholesky finds positive definite are returned as they are (the floor would not move them)."""
    G = linalg.sym(G)
    _, info = linalg.small_batched(lambda g: torch.linalg.cholesky_ex(g), G)
    bad = (info != 0).nonzero(as_tuple=True)[0]
    if bad.numel():
        vals, vecs = linalg.small_batched(lambda g: torch.linalg.eigh(g), G[bad])
        G = G.clone()
        G[bad] = (vecs * vals.clamp_min(0).unsqueeze(-2)) @ vecs.transpose(-1, -2)
    return G, int(bad.numel())


def solve_items(G: Tensor, b: Tensor, ridge: float, psd_repair: bool = True) -> Tensor:
    """U_i = (PSD(G_i) + λI)⁻¹ b_i for every item (batched).

    PSD(G_i) floors G_i's eigenvalues at 0. A batched Cholesky says which blocks are not
    positive definite; only those go through the (costlier) eigendecomposition, and every
    LAPACK call runs single-threaded per share of the items (:func:`fedpers.linalg.small_batched`):
    MKL's threaded path on thousands of k×k blocks is what made the repair 94 % of a step.
    """
    k = G.shape[-1]
    G = psd_floor(G)[0] if psd_repair else linalg.sym(G)
    eye = torch.eye(k, dtype=G.dtype, device=G.device)
    return linalg.small_batched(lambda g, r: torch.linalg.solve(g + ridge * eye, r.unsqueeze(-1)).squeeze(-1), G, b)


@dataclass(frozen=True)
class DpAlsProtocol(Protocol):
    """Public parameters of DPALS; ``initial_U`` is public (derived from the public seed)."""

    n_items: int
    rank: int
    steps: int
    items_per_user: int
    ridge_user: float
    ridge_item: float
    gram_bound: float
    rhs_bound: float
    noise_multiplier: float
    initial_U: Tensor
    dtype_name: str = "float64"
    prelude: bool = False
    """Round 0 releases per-item rating sums and counts (private centring, head items, item means)."""
    head_items: int = 0
    """H > 0: only the H items with the largest noisy counts are learnt (needs ``prelude``)."""
    rating_bound: float = math.inf
    """Clip of a user's selected ratings as a vector in round 0: √B·c_r."""

    name = "dpals"
    ITEM_MEAN_PRIOR = 5.0
    """κ₀: pseudo-ratings at μ̂ in the private item means (see :meth:`item_means`)."""

    @property
    def num_rounds(self) -> int:
        return self.steps + int(self.prelude)

    @property
    def sum_bound(self) -> float:
        """Γ_s = √2·√B·c_r: the user's clipped rating vector plus its total entry."""
        return math.sqrt(2.0) * self.rating_bound

    @property
    def count_bound(self) -> float:
        """Γ_c = √(2B): indicators plus the count entry."""
        return math.sqrt(2.0 * self.items_per_user)

    def is_prelude(self, round: int) -> bool:
        return self.prelude and round == 0

    def initial_state(self) -> dict[str, Tensor]:
        return {"U": self.initial_U.to(self.dtype)}

    def broadcast(self, state: Mapping[str, Any], round: int) -> dict[str, Tensor]:
        if self.is_prelude(round):
            return {}
        if self.prelude:
            return {"U": state["U"], "mu": state["mu"], "head": state["head"]}
        return {"U": state["U"]}

    def stat_specs(self, round: int) -> tuple[StatSpec, ...]:
        k = self.rank
        if self.is_prelude(round):
            return (
                StatSpec("s", (self.n_items + 1,), self.sum_bound),
                StatSpec("c", (self.n_items + 1,), self.count_bound),
            )
        return (StatSpec("G", (self.n_items, k, k), self.gram_bound), StatSpec("b", (self.n_items, k), self.rhs_bound))

    def client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        ratings, mask = units["ratings"].to(self.dtype), units["mask"]
        if self.is_prelude(round):
            s, c = item_counts(units["items"], ratings, mask, self.items_per_user, self.n_items, self.rating_bound)
            return Message({"s": s, "c": c}, int(units["ids"].shape[0]))
        if self.prelude:
            ratings = (ratings - broadcast["mu"].to(self.dtype)) * (mask | units["test"]).to(self.dtype)
            mask = mask & (broadcast["head"].to(mask.device)[units["items"]] > 0)
        U = broadcast["U"].to(self.dtype)
        G, b = item_statistics(
            U, units["items"], ratings, mask, self.ridge_user, self.items_per_user, self.gram_bound, self.rhs_bound
        )
        return Message({"G": linalg.sym(G), "b": b}, int(units["ids"].shape[0]))

    def unit_keys(self) -> tuple[str, ...]:
        return ("items", "ratings", "mask", "test") if self.prelude else ("items", "ratings", "mask")

    def prelude_update(self, summed: Message, privatizer: Privatizer) -> dict[str, Tensor]:
        """Round 0: noisy per-item sums and counts → μ̂, head items, U restricted to the head."""
        z = self.noise_multiplier
        params = {
            "items_per_user": self.items_per_user,
            "statistic": "per-item rating sums (vector clipped to √B·c_r) and counts, each with a total entry /√B; bounds √2·√B·c_r and √(2B)",
        }
        s = privatizer.gaussian_sum(
            summed.stats["s"],
            per_unit_bound=self.sum_bound,
            noise_multiplier=z,
            name="dpals.item_sums",
            round=0,
            params=params,
        )
        c = privatizer.gaussian_sum(
            summed.stats["c"],
            per_unit_bound=self.count_bound,
            noise_multiplier=z,
            name="dpals.item_counts",
            round=0,
            params=params,
        )
        s, c = s.double(), c.double()
        mu = s[-1] / c[-1].clamp_min(1.0 / math.sqrt(self.items_per_user))
        s, c = s[:-1], c[:-1]
        head = torch.ones(self.n_items, dtype=torch.float64)
        if 0 < self.head_items < self.n_items:
            head = torch.zeros(self.n_items, dtype=torch.float64)
            head[torch.topk(c, self.head_items).indices] = 1.0
        U = self.initial_U.to(self.dtype) * head.to(self.dtype).unsqueeze(-1)
        return {"U": U, "mu": mu.to(self.dtype), "head": head, "item_sums": s, "item_counts": c}

    def item_means(self, state: Mapping[str, Tensor]) -> Tensor:
        """Private item means (s_i + κμ̂)/(c_i⁺ + κ) from round 0's releases. κ = κ₀ + 4σ_s/c_r
        (public) caps the noise's share of an item's mean at about c_r/4 whatever its count."""
        sigma_s = self.noise_multiplier * self.sum_bound
        kappa = self.ITEM_MEAN_PRIOR + (
            4 * sigma_s * math.sqrt(self.items_per_user) / self.rating_bound if sigma_s > 0 else 0.0
        )  # rating_bound = √B·c_r
        mu = state["mu"].double()
        return (state["item_sums"] + kappa * mu) / (state["item_counts"].clamp_min(0) + kappa)

    def server_update(
        self, round: int, state: Mapping[str, Any], summed: Message, privatizer: Privatizer
    ) -> tuple[dict[str, Any], dict[str, float]]:
        if self.is_prelude(round):
            return self.prelude_update(summed, privatizer), {}
        k = self.rank
        z = self.noise_multiplier
        params = {"items_per_user": self.items_per_user, "rank": k}
        g_bound, b_bound = self.gram_bound, self.rhs_bound
        if z > 0 and not (math.isfinite(self.gram_bound) and math.isfinite(self.rhs_bound)):
            raise ValueError("noise needs finite gram_bound and rhs_bound")
        g = privatizer.gaussian_sum(
            triu_pack(summed.stats["G"]),
            per_unit_bound=g_bound,
            noise_multiplier=z,
            name="dpals.G",
            round=round,
            params=params,
        )
        b = privatizer.gaussian_sum(
            summed.stats["b"], per_unit_bound=b_bound, noise_multiplier=z, name="dpals.b", round=round, params=params
        )
        U = solve_items(triu_unpack(g, k), b, self.ridge_item, psd_repair=z > 0)
        if self.prelude:
            U = U * state["head"].to(U.dtype).unsqueeze(-1)
            return {**state, "U": U}, {"U_norm": float(torch.linalg.matrix_norm(U))}
        return {"U": U}, {"U_norm": float(torch.linalg.matrix_norm(U))}
