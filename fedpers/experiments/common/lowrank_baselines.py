"""A competent non-private AltMin (FedRep's linear case), the reference a private run is read against.

Unlike the private protocol it has no privacy constraint to respect, so it does what a
non-private method would: every user's samples are used for both steps (no sample
splitting), local solves are ridge-regularised (a user with 3 samples in k dimensions has a
near-singular least squares, and a few such users dominated the old baseline's sums), it is
initialised by the same spectral statistic without clipping or noise, and it alternates until U is within a small fraction of
its own statistical error from the AltMin fixed point (docs/benchmarks.md: why not 10⁻⁶). It
streams users chunk by chunk like the private run, in the users' working dtype.
"""

from __future__ import annotations

import math

import torch

from fedpers import linalg
from fedpers.data.units import UnitSource
from fedpers.protocols.base import Units

Tensor = torch.Tensor
RIDGE = 1e-3
"""Ridge of the local solves, relative to the mean diagonal of each user's Gram matrix."""
MAX_ROUNDS = 30
TOLERANCE = 1e-6
"""Stop outright once ‖UUᵀ − U'U'ᵀ‖_F falls below this (a problem without label noise)."""
PRECISION = 0.5
"""Stop once U's distance to the AltMin fixed point (bounded from the geometric contraction of the
moves) is at most this fraction of U's statistical standard error: iterating further moves the
reference by less than half of what a fresh draw of the same users' data would, so the
reference is the fixed point to within its own statistical error (each further round is a pass
over every user: 0.05, the earlier value, took a third round at 10⁵ users for a move of 0.3 of a
standard error; docs/benchmarks.md)."""


def spectral_init(source: UnitSource, rank: int, chunk_size: int) -> Tensor:
    """Top-k eigenvectors of Σ_j Σ_pairs sym(x̂_a x̂_bᵀ) y_a y_b over all of a user's sample pairs
    (each chunk in the working dtype, chunks summed in float64)."""
    total = None
    for units in source.chunks(chunk_size):
        x, y = units["x"], units["y"].to(units["x"].dtype)
        pairs = x.shape[1] // 2
        w = linalg.pair_statistic(x[:, : 2 * pairs], y[:, : 2 * pairs]).double()
        total = w if total is None else total + w
    if total is None:
        raise ValueError("spectral_init needs at least one user")
    return linalg.top_eigenvectors(total, rank)


def local_solve(U: Tensor, x: Tensor, y: Tensor) -> Tensor:
    return linalg.batched_ridge_solve(x @ U.to(x.dtype), y, RIDGE)


def statistical_error(A: Tensor, b: Tensor, yy: float, u: Tensor, samples: int, params: int) -> float:
    """Standard error of span(u) (in ‖·‖_F of the projection's complement), from the U step's
    least squares: vec(u) has covariance σ²A⁻¹, σ² = RSS/(samples − params), RSS = Σy² − 2bᵀu + uᵀAu;
    with u = QR the subspace error is (I − QQᵀ)Δu R⁻¹, so s² = σ² tr((R⁻¹R⁻ᵀ ⊗ (I − QQᵀ)) A⁻¹).
    It leaves out the v_j's own error, so it is a lower bound: the stopping rule errs late."""
    d = u.shape[0]
    q, r = torch.linalg.qr(u)
    vec = u.T.reshape(-1)  # column stacking, the inverse of linalg.vec_to_matrix
    rss = max(yy - 2 * float(b @ vec) + float(vec @ A @ vec), 0.0)
    sigma2 = rss / max(samples - params, 1)
    r_inv = torch.linalg.inv(r)
    weight = torch.kron(r_inv @ r_inv.T, torch.eye(d, dtype=u.dtype, device=u.device) - q @ q.T)
    a_inv = torch.cholesky_inverse(torch.linalg.cholesky(A))
    return math.sqrt(max(sigma2 * float((weight * a_inv).sum()), 0.0))


class NonPrivateAltMin:
    """:func:`nonprivate_altmin` one pass at a time, for a caller that reads the users itself (a
    private run's passes, :class:`~fedpers.experiments.common.shared_passes.ReferenceRun`): :meth:`begin`,
    :meth:`add` of every chunk in order, :meth:`end`; until :attr:`done`. Fed the chunks
    :func:`nonprivate_altmin` reads, in its order, it computes the same U bit for bit.

    Without ``start`` the first pass is the spectral initialisation (:func:`spectral_init`)."""

    def __init__(self, rank: int, start: Tensor | None = None) -> None:
        self.rank = rank
        self.U: Tensor | None = None if start is None else start.double()
        self.rounds = 0
        self.done = False
        self._previous = math.inf
        self._total: Tensor | None = None
        self._A: Tensor | None = None
        self._b: Tensor | None = None
        self._yy, self._samples, self._users = 0.0, 0, 0

    def begin(self) -> None:
        """A new pass over every user begins (anything summed by an unfinished pass is dropped)."""
        self._total = self._A = self._b = None
        self._yy, self._samples, self._users = 0.0, 0, 0

    def add(self, units: Units) -> None:
        """One chunk of users (all of their samples: ``x`` (n, m, d), ``y`` (n, m))."""
        with linalg.serial_small_ops(units["x"].device):  # many small ops; the heavy sums run in shares
            self._add(units)

    def _add(self, units: Units) -> None:
        x = units["x"]
        y = units["y"].to(x.dtype)
        if self.U is None:  # the spectral pass
            pairs = x.shape[1] // 2
            w = linalg.pair_statistic(x[:, : 2 * pairs], y[:, : 2 * pairs]).double()
            self._total = w if self._total is None else self._total + w
            return
        U, dk = self.U, self.U.shape[0] * self.rank
        if self._A is None or self._b is None:
            self._A = torch.zeros(dk, dk, dtype=torch.float64, device=U.device)  # where the users are
            self._b = torch.zeros(dk, dtype=torch.float64, device=U.device)
        v = local_solve(U, x, y)
        gram, label_sum = linalg.kron_statistics(v, x, label=y)  # one pass over x for both
        self._A += gram.double()
        assert label_sum is not None  # a label was given: kron_statistics returns its sum
        self._b += label_sum.double()
        self._yy += float((y.double() ** 2).sum())
        self._samples, self._users = self._samples + y.numel(), self._users + y.shape[0]

    def end(self) -> None:
        """The pass is complete: the spectral U, or one AltMin round and the stopping rule (dense
        dk×dk algebra on one thread: threaded LAPACK at this size stalls on a busy machine, measured
        1.9 s a round at load 11 against about 0.1 s idle)."""
        with linalg.serial_small_ops(torch.device("cpu") if self.U is None else self.U.device):
            self._end()

    def _end(self) -> None:
        if self.U is None:
            if self._total is None:
                raise ValueError("spectral_init needs at least one user")
            self.U = linalg.top_eigenvectors(self._total, self.rank)
            self._total = None
            return
        U, d, rank = self.U, self.U.shape[0], self.rank
        A, b = self._A, self._b
        if A is None or b is None:
            A = torch.zeros(d * rank, d * rank, dtype=torch.float64, device=U.device)
            b = torch.zeros(d * rank, dtype=torch.float64, device=U.device)
        self.rounds += 1
        ridge = 1e-12 * float(A.diagonal().mean().clamp_min(1e-300))
        A += ridge * torch.eye(d * rank, dtype=A.dtype, device=A.device)
        u = linalg.vec_to_matrix(torch.linalg.solve(A, b), d, rank)
        new = linalg.orthonormal_basis(u)
        moved = float(torch.linalg.matrix_norm(new @ new.T - U @ U.T))
        self.U = new
        self._A = self._b = None
        if moved < TOLERANCE or self.rounds >= MAX_ROUNDS:
            self.done = True
            return
        rho, self._previous = moved / self._previous, moved  # 0 after round 1: no contraction measured yet
        if 0 < rho < 1 and moved * rho / (1 - rho) <= PRECISION * statistical_error(
            A, b, self._yy, u, self._samples, self._users * rank + d * rank
        ):
            self.done = True


def nonprivate_altmin(
    source: UnitSource,
    rank: int,
    chunk_size: int,
    start: Tensor | None = None,
    *,
    resume: NonPrivateAltMin | None = None,
) -> tuple[Tensor, int]:
    """(U, rounds run): alternate v_j = ridge LS on all samples and the exact U step until U is
    within ``PRECISION`` of its statistical error from the fixed point (or moves < ``TOLERANCE``).
    It reads the data alone (no other baseline's output), so every experiment that reports it
    on the same users reports the same reference.

    ``start``: the U to alternate from (a function of the data alone, such as AltMin's clipped
    spectral statistic without noise, which a private AltMin run computes in its own first pass);
    None: :func:`spectral_init`, a pass of its own. The fixed point, hence the reference to within
    the stopping rule's share of its statistical error, does not depend on the start.
    ``resume``: a :class:`NonPrivateAltMin` whose first passes were made elsewhere (in a private
    run's passes over the same users, in the same chunks): its remaining passes, here.

    Products in the working dtype of the users (float32 runs: float32 chunks), sums over chunks
    and the dk×dk solve in float64. After round r ≥ 2 the contraction ρ = move_r/move_(r−1)
    bounds the distance left to the fixed point by move_r·ρ/(1−ρ)."""
    steps = NonPrivateAltMin(rank, start) if resume is None else resume
    while not steps.done:
        steps.begin()
        for units in source.chunks(chunk_size):
            steps.add(units)
        steps.end()
    assert steps.U is not None  # every pass ended: the spectral one sets U
    return steps.U, steps.rounds


def local_ridge(x: Tensor, y: Tensor, ridge: float) -> Tensor:
    """Each user alone: argmin_θ ||X_j θ − y_j||² + λ_j||θ||² in d dimensions on all m samples, in
    float64, with λ_j = ``ridge`` × the mean diagonal of X_jᵀX_j (floored at 1), as
    :func:`fedpers.linalg.batched_ridge_solve`. With m < d in the dual form θ = X_jᵀ(X_jX_jᵀ + λ_jI_m)⁻¹y_j
    (the same θ by the push-through identity): an m×m system instead of a d×d one, about 4× fewer
    flops at m = 40, d = 100. A user with a non-finite entry gets a NaN θ, as in the primal.
    Every user is independent: run in single-threaded shares of the batch (the same bits)."""
    m, d = x.shape[-2], x.shape[-1]
    if m >= d:
        return linalg.batched_ridge_solve(x.double(), y.double(), ridge)
    if x.shape[0] < 512:
        return _dual_ridge_blocks(x, y, ridge)
    return linalg.small_batched(lambda a, b: _dual_ridge_blocks(a, b, ridge), x, y, min_share=256)


DUAL_BLOCK = 64
"""Users per :func:`_dual_ridge` call: their float64 copy, Grams and solves stay in cache (about 2×
faster than a whole share at once at m = 40, d = 100; every user is independent: the same bits)."""


def _dual_ridge_blocks(x: Tensor, y: Tensor, ridge: float) -> Tensor:
    if x.shape[0] <= DUAL_BLOCK:
        return _dual_ridge(x, y, ridge)
    return torch.cat(
        [_dual_ridge(x[i : i + DUAL_BLOCK], y[i : i + DUAL_BLOCK], ridge) for i in range(0, x.shape[0], DUAL_BLOCK)]
    )


def _dual_ridge(x: Tensor, y: Tensor, ridge: float) -> Tensor:
    """:func:`local_ridge`'s dual form for users (n, m, d), m < d."""
    x, y = x.double(), y.double()
    d = x.shape[-1]
    squares = torch.linalg.vector_norm(x, dim=(-2, -1)) ** 2
    lam = ridge * (squares / d).clamp_min(1.0)
    # |Σ_i x_ai x_bi| ≤ Σ x²: the Gram is finite exactly when the sum of squares is
    bad = ~(torch.isfinite(squares) & torch.isfinite(y).all(-1))
    any_bad = bool(bad.any())
    if any_bad:
        lam = torch.where(bad, torch.ones_like(lam), lam)
        x = torch.where(bad[:, None, None], torch.zeros((), dtype=x.dtype, device=x.device), x)
        y = torch.where(bad[:, None], torch.zeros((), dtype=y.dtype, device=y.device), y)
    gram = x @ x.transpose(-1, -2)
    gram.diagonal(dim1=-2, dim2=-1).add_(lam[:, None])
    chol, info = torch.linalg.cholesky_ex(gram)
    alpha = torch.cholesky_solve(y.unsqueeze(-1), chol)
    failed = (info != 0).nonzero(as_tuple=True)
    if failed[0].numel():  # per user, so the answer never depends on its batch-mates
        alpha[failed] = linalg.lstsq_rank_revealing(gram[failed], y[failed].unsqueeze(-1))
    theta = (x.transpose(-1, -2) @ alpha).squeeze(-1)
    return torch.where(bad[:, None], torch.full_like(theta, math.nan), theta) if any_bad else theta
