"""User-level ε-DP selection of the shared subspace U by the exponential mechanism.

docs/algorithms.md §1, Algorithm 4 of the personalization paper. One round: the server broadcasts a
finite, data-independent candidate set of orthonormal U (an explicit φ-net for tiny d·k,
random Haar candidates otherwise); every client returns, per candidate, the sum over its
users of the constrained minimum loss

    s_j(U) = min_{||v|| ≤ C} (2/m) Σ_{i ∈ first half} (<clip(Uᵀx_ij; L_f), v> − clip(y_ij; ζ))²,

and the server samples U with P(U) ∝ exp(−ε·score(U)/(2Δ)), Δ = 4ξL_fC, ξ = 2(L_fC + ζ),
by Gumbel-max. Users then fit v on their second half, locally (:meth:`personalize`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from fedpers import linalg
from fedpers.configs.expmech import CandidateKind
from fedpers.privacy import Privatizer
from fedpers.protocols.base import Message, Protocol, StatSpec, Units

Tensor = torch.Tensor
NEWTON_STEPS = 50
NEWTON_TOL = 1e-13
NET_GRID_BLOCK = 1 << 18


# ----- candidate sets (public, data-independent) ---------------------------------------
def net_grid_size(dim: int, rank: int, width: float) -> tuple[int, int]:
    """(points per axis, total grid points) of the cube grid behind :func:`stiefel_net`."""
    per_axis = math.ceil(2 * math.sqrt(dim * rank) / width)
    return per_axis, per_axis ** (dim * rank)


def _grid_block(per_axis: int, dk: int, start: int, stop: int) -> Tensor:
    """Grid points start..stop-1 (mixed-radix index) as (count, dk) coordinates in [−1, 1]."""
    step = 2.0 / per_axis
    idx = torch.arange(start, stop, dtype=torch.int64)
    digits = torch.empty(stop - start, dk, dtype=torch.int64)
    for j in range(dk):
        digits[:, j] = idx % per_axis
        idx = idx // per_axis
    return -1.0 + (digits.double() + 0.5) * step


def _distance_to_stiefel(g: Tensor) -> Tensor:
    """Frobenius distance from each (d, k) matrix to the set of orthonormal d×k matrices: ||σ(G) − 1||."""
    return torch.linalg.vector_norm(torch.linalg.svdvals(g) - 1.0, dim=-1)


def _polar(g: Tensor) -> Tensor:
    """The nearest orthonormal matrix (polar factor U Vᵀ of the SVD)."""
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    return u @ vh


@lru_cache(maxsize=4)
def stiefel_net(dim: int, rank: int, width: float) -> Tensor:
    """An explicit Frobenius φ-net of the d×k orthonormal matrices, (Q, d, k) float64.

    Grid the cube [−1, 1]^{d×k} with spacing φ/√(dk) (every matrix with entries in [−1, 1]
    is within φ/2 of a grid point), keep the grid points G within φ/2 of the orthonormal
    set, and map each to its polar factor P(G). For orthonormal U and its grid point G,
    ||U − P(G)|| ≤ ||U − G|| + ||G − P(G)|| ≤ φ/2 + φ/2 = φ. Only for tiny d·k.
    """
    per_axis, total = net_grid_size(dim, rank, width)
    dk = dim * rank
    kept = []
    for start in range(0, total, NET_GRID_BLOCK):
        g = _grid_block(per_axis, dk, start, min(total, start + NET_GRID_BLOCK)).reshape(-1, rank, dim).transpose(1, 2)
        near = g[_distance_to_stiefel(g) <= width / 2]
        if near.shape[0]:
            kept.append(_polar(near))
    if not kept:
        raise ValueError(f"net_width={width} produced no candidates for dim={dim}, rank={rank}")
    return torch.cat(kept)


def estimate_net_size(dim: int, rank: int, width: float, samples: int = 200_000, seed: int = 0) -> int:
    """Monte-Carlo estimate of len(stiefel_net(...)) without building it: grid size × shell fraction."""
    _, total = net_grid_size(dim, rank, width)
    g = torch.Generator().manual_seed(seed)
    pts = torch.rand(samples, dim, rank, generator=g, dtype=torch.float64) * 2 - 1
    frac = float((_distance_to_stiefel(pts) <= width / 2).double().mean())
    return max(1, round(total * frac))


@lru_cache(maxsize=4)
def random_candidates(dim: int, rank: int, count: int, seed: int) -> Tensor:
    """``count`` Haar-random d×k orthonormal matrices from a public seed, (Q, d, k) float64."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(count, dim, rank, dtype=torch.float64)
    for start in range(0, count, 65536):
        stop = min(count, start + 65536)
        q, r = torch.linalg.qr(torch.randn(stop - start, dim, rank, generator=g, dtype=torch.float64))
        signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
        out[start:stop] = q * torch.where(signs == 0, torch.ones_like(signs), signs).unsqueeze(-2)
    return out


# ----- the math: constrained least squares, batched -------------------------------------
def _constrained_in_eigenbasis(gram: Tensor, b: Tensor, bound: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(Λ, Q, b̃, ṽ): the minimiser of vᵀGv − 2bᵀv over ||v|| ≤ C in G's eigenbasis, batched.

    With G = QΛQᵀ and b̃ = Qᵀb: if the minimum-norm unconstrained minimiser has ||v|| ≤ C it
    is the answer; otherwise ṽ(λ) = b̃/(Λ + λ) at the λ > 0 where ||ṽ(λ)|| = C. That λ solves
    ψ(λ) = 1/||ṽ(λ)|| − 1/C = 0 with ψ increasing and concave, so Newton's method from a
    point left of the root converges monotonically (Moré & Sorensen 1983); the last iterate
    is scaled onto the ball, so ṽ is always feasible.
    """
    k = gram.shape[-1]
    if k == 1:  # no eigendecomposition needed (and batched eigh of 1×1 matrices is slow)
        lam, Q, bt = gram[..., 0].clamp_min(0), torch.ones_like(gram), b
    else:
        lam, Q = torch.linalg.eigh(linalg.sym(gram))
        lam = lam.clamp_min(0)
        bt = (Q.transpose(-1, -2) @ b.unsqueeze(-1)).squeeze(-1)
    lam_max = lam.amax(-1, keepdim=True)
    positive = lam > 1e-12 * lam_max.clamp_min(1e-300)
    v0 = torch.where(positive, bt / torch.where(positive, lam, torch.ones_like(lam)), torch.zeros_like(bt))
    # b̃ on a null direction of G: the unconstrained loss is unbounded below, so the constraint binds.
    on_null = ~positive & (bt.abs() > 1e-12 * bt.abs().amax(-1, keepdim=True).clamp_min(1e-300))
    inside = (torch.linalg.vector_norm(v0, dim=-1) <= bound) & ~on_null.any(-1)
    b_norm = torch.linalg.vector_norm(bt, dim=-1, keepdim=True)
    # ||ṽ(λ)|| ≥ ||b̃||/(Λ_max + λ): every λ below ||b̃||/C − Λ_max is left of the root.
    lmb = (b_norm / bound - lam_max).clamp_min(0) + 1e-12 * (lam_max + b_norm / bound).clamp_min(1e-300)
    for _ in range(NEWTON_STEPS):
        shifted = lam + lmb
        v = bt / shifted
        norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(1e-300)
        psi = 1.0 / norm - 1.0 / bound
        if not bool((psi * bound < -NEWTON_TOL).any()):
            break
        dpsi = (v * v / shifted).sum(-1, keepdim=True) / norm**3
        lmb = torch.where(psi < 0, lmb - psi / dpsi.clamp_min(1e-300), lmb)
    v = bt / (lam + lmb)
    v = v * (bound / torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(1e-300)).clamp(max=1.0)
    vt = torch.where(inside.unsqueeze(-1), v0, v)
    return lam, Q, bt, vt


def constrained_least_squares_loss(gram: Tensor, b: Tensor, c: Tensor, bound: float) -> Tensor:
    """min_{||v|| ≤ C} vᵀGv − 2bᵀv + c, batched over leading dims (G PSD k×k)."""
    lam, _, bt, vt = _constrained_in_eigenbasis(gram, b, bound)
    return (lam * vt * vt).sum(-1) - 2 * (bt * vt).sum(-1) + c


def constrained_solution(gram: Tensor, b: Tensor, bound: float) -> Tensor:
    """argmin_{||v|| ≤ C} vᵀGv − 2bᵀv, batched."""
    _, Q, _, vt = _constrained_in_eigenbasis(gram, b, bound)
    if gram.shape[-1] == 1:
        return vt
    return (Q @ vt.unsqueeze(-1)).squeeze(-1)


def user_scores(
    candidates: Tensor, x: Tensor, y: Tensor, feature_clip: float, model_bound: float, label_clip: float
) -> Tensor:
    """Per-(user, candidate) constrained minimum mean loss, (users, Q).

    x (users, h, d), y (users, h): the samples the score uses; candidates (Q, d, k). Each x is
    scaled by an exact power of two s before the projection and the clip is applied as
    f'·min(s, L_f/||f'||) (f = s·f'), so a huge finite x gives a clipped, finite feature.
    """
    u, h, d = x.shape
    q, _, k = candidates.shape
    scale = linalg.pow2_scale(x)
    f = ((x / scale.unsqueeze(-1)) @ candidates.to(x.dtype).permute(1, 0, 2).reshape(d, q * k)).reshape(u, h, q, k)
    yc = linalg.clip_scalar(y, label_clip)
    c = (yc * yc).mean(1, keepdim=True)
    if k == 1:  # closed form: v = clamp(b/g, −C, C); in place, this is the hot loop of a φ-net run
        f = f[..., 0].mul_(scale.unsqueeze(-1)).clamp_(-feature_clip, feature_clip)
        b = torch.bmm(yc.unsqueeze(1), f).squeeze(1) / h
        g = f.mul_(f).sum(1) / h
        v = torch.where(g > 0, b / torch.where(g > 0, g, torch.ones_like(g)), torch.zeros_like(g)).clamp(
            -model_bound, model_bound
        )
        return g * v * v - 2 * b * v + c
    norm = torch.linalg.vector_norm(f, dim=-1, keepdim=True)
    f = f * torch.minimum(scale[..., None, None], feature_clip / norm.clamp_min(torch.finfo(f.dtype).tiny))
    gram = torch.einsum("uhqk,uhql->uqkl", f, f) / h
    b = torch.einsum("uhqk,uh->uqk", f, yc) / h
    return constrained_least_squares_loss(gram, b, c, model_bound)


# ----- the protocol -----------------------------------------------------------------------
@dataclass(frozen=True)
class ExpMechProtocol(Protocol):
    """Public parameters of one exponential-mechanism selection (all data-independent)."""

    n_users: int
    dim: int
    rank: int
    samples_per_user: int
    epsilon: float
    feature_clip: float
    model_bound: float
    label_clip: float
    candidate_kind: CandidateKind = CandidateKind.NET
    net_width: float = 0.2
    num_candidates: int = 1000
    candidate_seed: int = 0
    dtype_name: str = "float64"
    block_elements: int = 1 << 22
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    name = "expmech"

    @property
    def num_rounds(self) -> int:
        return 1

    @property
    def half(self) -> int:
        return self.samples_per_user // 2

    # ----- privacy bookkeeping ------------------------------------------------------------
    @property
    def xi(self) -> float:
        """Lipschitz constant of (a − y)² in a on |a| ≤ L_fC, |y| ≤ ζ: 2(L_fC + ζ)."""
        return 2 * (self.feature_clip * self.model_bound + self.label_clip)

    @property
    def paper_sensitivity(self) -> float:
        """4ξL_fC, the paper's (and docs/algorithms.md §1's) bound; reported, not used (see :attr:`sensitivity`)."""
        return 4 * self.xi * self.feature_clip * self.model_bound

    @property
    def sensitivity(self) -> float:
        """Change of any candidate's score between neighbours: ζ², under replace-one and add-remove alike.

        A user's score is min_{||v|| ≤ C} of a mean of (<f, v> − ỹ)², so it lies in
        [0, mean ỹ²] ⊂ [0, ζ²] (v = 0 is feasible); replacing one user moves any candidate's
        sum by at most ζ², and adding or removing one by its own score, at most ζ² too. Reached: a user with x = 0 and y = ±ζ (score ζ²) against one with
        y = 0 (score 0). The paper's 4ξL_fC does not cover a change of the labels: with those
        two users the change is ζ², above 4ξL_fC whenever ζ > 8.9·L_fC; and where 4ξL_fC is
        valid it is ≥ ζ² (47× at the defaults).
        """
        return self.label_clip**2

    @property
    def max_loss(self) -> float:
        """Largest per-user score term: ζ² (each user's score is clamped to [0, ζ²], where it lies)."""
        return self.label_clip**2

    def candidates(self) -> Tensor:
        if "candidates" not in self._cache:
            if self.candidate_kind is CandidateKind.NET:
                c = stiefel_net(self.dim, self.rank, self.net_width)
            else:
                c = random_candidates(self.dim, self.rank, self.num_candidates, self.candidate_seed)
            self._cache["candidates"] = c
        return self._cache["candidates"]

    @property
    def candidate_count(self) -> int:
        return int(self.candidates().shape[0])

    # ----- protocol -----------------------------------------------------------------------
    def unit_keys(self) -> tuple[str, ...]:
        return ("x", "y")

    def initial_state(self) -> dict[str, Tensor]:
        return {"candidates": self.candidates().to(self.dtype)}

    def broadcast(self, state: Mapping[str, Tensor], round: int) -> dict[str, Tensor]:
        return {"candidates": state["candidates"]}

    def stat_specs(self, round: int) -> tuple[StatSpec, ...]:
        q = self.candidate_count
        return (StatSpec("scores", (q,), math.sqrt(q) * self.max_loss),)

    def client_update(self, round: int, broadcast: Mapping[str, Tensor], units: Units) -> Message:
        cands = broadcast["candidates"].to(self.dtype)
        x = units["x"].to(self.dtype)[:, : self.half]
        y = units["y"].to(self.dtype)[:, : self.half]
        n, q = x.shape[0], cands.shape[0]
        total = torch.zeros(q, dtype=self.dtype, device=x.device)
        if n == 0:
            return Message({"scores": total}, 0)
        per_candidate = max(1, n * self.half * self.rank)  # the (users, h, block, k) projections dominate
        block = max(1, self.block_elements // per_candidate)
        starts = range(0, q, block)
        if (
            len(starts) >= 8
        ):  # a long scoring pass shows progress (and tqdm's time left) per candidate block; off when not a terminal
            from tqdm.auto import tqdm

            starts = tqdm(
                starts,
                desc=f"scoring {q} candidates ({n} users)",
                unit="block",
                leave=False,
                disable=None,
                mininterval=1.0,
            )
        for start in starts:
            s = user_scores(
                cands[start : start + block].to(x.device), x, y, self.feature_clip, self.model_bound, self.label_clip
            )
            total[start : start + block] = s.clamp(0.0, self.max_loss).sum(0)
        return Message({"scores": total}, int(n))

    def server_update(
        self, round: int, state: Mapping[str, Tensor], summed: Message, privatizer: Privatizer
    ) -> tuple[dict[str, Tensor], dict[str, float]]:
        scores = summed.stats["scores"]
        index = privatizer.exponential(
            scores,
            sensitivity=self.sensitivity,
            epsilon=self.epsilon,
            name="select.U",
            round=round,
            params={"statistic": "Σ_j score_j(U)", "zeta": self.label_clip, "formula": "score_j ∈ [0, ζ²], Δ = ζ²"},
        )
        U = state["candidates"][index]
        diagnostics = {"candidates": float(scores.shape[0]), "sensitivity": self.sensitivity}
        return {"candidates": state["candidates"], "U": U, "index": torch.tensor(index)}, diagnostics

    # ----- after the release: local, never sent --------------------------------------------
    def personalize(self, U: Tensor, units: Units) -> Tensor:
        """Each user's v = argmin_{||v|| ≤ C} (2/m) Σ_{second half} (<Uᵀx, v> − y)² (Algorithm 4, step 4)."""
        x = units["x"].to(self.dtype)[:, self.half :]
        y = units["y"].to(self.dtype)[:, self.half :]
        f = x @ U.to(self.dtype)
        gram = f.transpose(-1, -2) @ f / f.shape[1]
        b = (f.transpose(-1, -2) @ y.unsqueeze(-1)).squeeze(-1) / f.shape[1]
        return constrained_solution(gram, b, self.model_bound)
