"""Distributed and local DP: the noise is added on the nodes, the server only sums.

**Distributed** (the Skellam mechanism of Agarwal, Kairouz & Liu 2021 under secure aggregation).
For each summed statistic (a symmetric one by its upper triangle, as the central release):

1. each unit's contribution x_j (‖x_j‖ ≤ B, re-clipped to B so the bound holds whatever a
   protocol returns) is scaled by s and rotated by a randomized Walsh–Hadamard transform
   H·diag(ε) (ε ∈ {±1}^D from a public seed, D the next power of two): norms are kept and every
   coordinate becomes small, so few bits hold the sum;
2. rounded to integers by *conditional* randomized rounding: coordinates rounded up with
   probability their fraction, the whole vector re-drawn until ‖r_j‖ ≤ c̃ =
   min(sB + √D, sqrt((sB)² + D/4 + sqrt(2 log(1/β))(sB + √D/2))); the bound c̃ therefore holds
   for every unit, so neighbours' integer sums differ by Δ₂ ≤ 2c̃ and Δ₁ ≤ 2c̃·min(√D, c̃)
   (an integer vector has ‖r‖₁ ≤ min(√D‖r‖₂, ‖r‖₂²)); for PSD units also Δ₂ ≤ √2·sB + 2√D
   (:attr:`StatEncoding.psd`). After :data:`MAX_ROUNDING_TRIES` draws a
   vector is rounded toward zero (norm ≤ sB ≤ c̃), so rounding never fails;
3. each node sums its units' integer vectors and adds its share Sk(V/min_nodes) of Skellam noise
   (Poisson(V/2m) − Poisson(V/2m), m = min_nodes): sums of independent Skellams are Skellam, so
   when k ≥ m nodes survive the sum carries Sk(k·V/m), never less than V;
4. the vectors are summed modulo 2^b (what secure aggregation computes); the server reads the
   sum centred in [−2^(b−1), 2^(b−1)), un-rotates and un-scales it.

The ledger records the integer mechanism (:class:`~fedpers.privacy.ledger.SkellamDpEvent`: total
variance, Δ₂, Δ₁) and :mod:`fedpers.privacy.skellam` accounts it. The scale s of each statistic is
the largest at which a modular wrap of any coordinate has probability below
:data:`WRAP_PROBABILITY` (a sub-Gaussian tail bound on the rotated sum of n units of norm ≤ sB,
their rounding and the noise, union-bounded over D coordinates); a wrap moves only the utility,
never the privacy (the modular sum is a function of the noisy integer sum).

**Local**: each unit's contribution is released on its node with its own Gaussian noise
(σ = z·B, Δ = 2B: the replace-one bound of one unit), and the server sums the noisy vectors.

The node-side functions here draw all of that noise (fedpers adds noise only in this package);
the runtimes call them per node and hand the server's decoded sum to a
:class:`NodeSidePrivatizer`, which records each release and adds nothing more.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dp_accounting
import torch

from fedpers.config import DpModel
from fedpers.privacy import secure as secure_module
from fedpers.privacy.accountant import Calibrations, calibrate_noise_multiplier
from fedpers.privacy.ledger import ALL_UNITS, Ledger, Release, SkellamDpEvent
from fedpers.privacy.mechanisms import Privatizer
from fedpers.privacy.refusal import RefusedBeforeRelease

Tensor = torch.Tensor

WRAP_PROBABILITY = 1e-6
"""Largest probability of a modular wrap in any coordinate of one release (chooses the scale)."""
ROUNDING_BETA = math.exp(-0.5)
"""β of the conditional rounding bound: an unconditional rounding exceeds c̃ with probability ≤ β."""
MAX_ROUNDING_TRIES = 1000
MAX_BITS = 32
MIN_BITS = 4
AUTO_BITS_INFLATION = 1.01
"""``--bits 0`` (auto) takes the fewest bits at which rounding inflates every bound by ≤ 1 %."""


# ----- the transforms (pure functions, batched over units) -------------------------------------
def padded_dim(d: int) -> int:
    """The power of two the Walsh–Hadamard transform works in (≥ d)."""
    return 1 << max(0, int(d) - 1).bit_length()


def flat_dim(shape: Sequence[int], symmetric: bool) -> int:
    """Length of a statistic as a vector: its upper triangle (with diagonal) when symmetric."""
    if symmetric:
        return int(shape[0]) * (int(shape[0]) + 1) // 2
    return int(math.prod(shape))


def flatten(value: Tensor, shape: Sequence[int], symmetric: bool) -> Tensor:
    """(U, *shape) → (U, d) float64: the upper triangle (with diagonal) of a symmetric statistic."""
    v = value.to(dtype=torch.float64).reshape(value.shape[0], *shape)
    if symmetric:
        i, j = torch.triu_indices(int(shape[0]), int(shape[0]), device=v.device)
        return v[:, i, j]
    return v.reshape(v.shape[0], -1)


def unflatten(vector: Tensor, shape: Sequence[int], symmetric: bool) -> Tensor:
    """Inverse of :func:`flatten` for one vector; a symmetric statistic is mirrored from its triangle."""
    if symmetric:
        n = int(shape[0])
        out = torch.zeros(n, n, dtype=vector.dtype, device=vector.device)
        i, j = torch.triu_indices(n, n, device=vector.device)
        out[i, j] = vector
        return out + torch.triu(out, diagonal=1).transpose(0, 1)
    return vector.reshape(tuple(shape))


def hadamard(x: Tensor) -> Tensor:
    """Orthonormal Walsh–Hadamard transform H/√D along the last dimension (D a power of two):
    log₂D butterfly passes, O(D log D). H/√D is symmetric and its own inverse."""
    D = x.shape[-1]
    if D & (D - 1):
        raise ValueError(f"the Walsh–Hadamard transform needs a power-of-two length, got {D}")
    lead = x.shape[:-1]
    y = x.reshape(-1, D)
    h = 1
    while h < D:
        y = y.reshape(-1, D // (2 * h), 2, h)
        y = torch.cat((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(*lead, D) / math.sqrt(D)


def rotation_signs(seed: int, D: int) -> Tensor:
    """The public random signs ε of the rotation H·diag(ε), from its seed alone."""
    g = torch.Generator().manual_seed(int(seed) % 2**63)
    return torch.randint(0, 2, (D,), generator=g, dtype=torch.int64).to(torch.float64) * 2 - 1


def rotate(x: Tensor, seed: int, D: int) -> Tensor:
    """(U, d) → (U, D): zero-padded to D, signs flipped, Walsh–Hadamard transformed (norms kept)."""
    padded = torch.nn.functional.pad(x.to(torch.float64), (0, D - x.shape[-1]))
    return hadamard(padded * rotation_signs(seed, D).to(x.device))


def unrotate(y: Tensor, seed: int, d: int) -> Tensor:
    """Inverse of :func:`rotate` on the last dimension, cut back to d coordinates."""
    D = y.shape[-1]
    return (hadamard(y.to(torch.float64)) * rotation_signs(seed, D).to(y.device))[..., :d]


def rounded_bound(c: float, D: int, beta: float = ROUNDING_BETA) -> float:
    """c̃: the norm bound conditional rounding enforces for inputs of norm ≤ c in D dimensions
    (Kairouz, Liu & Steinke 2021; Agarwal, Kairouz & Liu 2021): an unconditional randomized rounding
    exceeds it with probability ≤ β, and c + √D bounds every rounding."""
    squared = c**2 + D / 4 + math.sqrt(2 * math.log(1 / beta)) * (c + math.sqrt(D) / 2)
    return min(c + math.sqrt(D), math.sqrt(squared))


def conditional_round(x: Tensor, bound: float, generator: torch.Generator) -> Tensor:
    """(U, D) float64 → (U, D) int64 with every row's norm ≤ ``bound``: randomized rounding (up with
    probability the fraction), each row re-drawn until it meets the bound; a row still over after
    :data:`MAX_ROUNDING_TRIES` draws is rounded toward zero (norm ≤ its input's). The bound is
    checked in exact integer arithmetic (Σ r² ≤ ⌊bound²⌋)."""
    floor = torch.floor(x)
    frac = x - floor
    limit = math.floor(bound**2 + 1e-9)
    out = torch.empty(x.shape, dtype=torch.int64, device=x.device)
    todo = torch.arange(x.shape[0], device=x.device)
    for _ in range(MAX_ROUNDING_TRIES):
        if todo.numel() == 0:
            return out
        u = torch.rand(frac[todo].shape, generator=generator, dtype=torch.float64).to(x.device)
        r = (floor[todo] + (u < frac[todo]).to(torch.float64)).to(torch.int64)
        ok = (r * r).sum(dim=1) <= limit
        out[todo[ok]] = r[ok]
        todo = todo[~ok]
    out[todo] = torch.trunc(x[todo]).to(torch.int64)
    return out


def skellam_noise(shape: tuple[int, ...], variance: float, generator: torch.Generator) -> Tensor:
    """Integer noise Sk(variance): Poisson(variance/2) − Poisson(variance/2) per coordinate."""
    if variance <= 0:
        return torch.zeros(shape, dtype=torch.int64)
    rate = torch.full(shape, variance / 2, dtype=torch.float64)
    a = torch.poisson(rate, generator=generator)
    b = torch.poisson(rate, generator=generator)
    return (a - b).to(torch.int64)


def modular(x: Tensor, bits: int) -> Tensor:
    """x mod 2^bits in [0, 2^bits) (what secure aggregation sums in)."""
    return torch.remainder(x, 1 << bits)


def centered(x: Tensor, bits: int) -> Tensor:
    """The representative of x mod 2^bits in [−2^(bits−1), 2^(bits−1))."""
    m = 1 << bits
    y = torch.remainder(x, m)
    return torch.where(y >= m // 2, y - m, y)


def node_generator(seed: int, round: int, node: int, secure: bool) -> torch.Generator:
    """A node's generator for its rounding and noise in a round: OS entropy with ``secure``;
    otherwise derived from (seed, round, node) so a simulation reproduces (its noise is then
    public to whoever holds the seed, as every seeded run's)."""
    if secure:
        return torch.Generator().manual_seed(secure_module.os_seed())
    digest = hashlib.sha256(f"fedpers-node-noise:{int(seed)}:{int(round)}:{int(node)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % 2**63)


def unit_generator(seed: int, round: int, statistic: str, unit: int, secure: bool) -> torch.Generator:
    """The generator one unit's rounding draws from in a round (OS entropy with ``secure``)."""
    if secure:
        return torch.Generator().manual_seed(secure_module.os_seed())
    tag = f"fedpers-unit-rounding:{int(seed)}:{int(round)}:{statistic}:{int(unit)}"
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little") % 2**63)


# ----- one statistic's public encoding ------------------------------------------------------------
@dataclass(frozen=True)
class StatEncoding:
    """How one summed statistic travels under distributed DP (all public, from the config)."""

    name: str
    shape: tuple[int, ...]
    symmetric: bool
    bound: float
    """B: the L2 (Frobenius) bound of one unit's contribution, in the statistic's units."""
    scale: float
    rounded_bound: float
    """c̃: every unit's rounded integer vector has norm ≤ c̃."""
    variance: float
    """V: the Skellam variance per coordinate the sum carries when ``min_nodes`` nodes survive."""
    bits: int
    rotation_seed: int
    psd: bool = False
    """Every unit's contribution is a PSD matrix (the node projects it onto the PSD cone): the triangles of two
    such units have a non-negative inner product, which the rounding moves by < 2√D in norm."""

    @property
    def dim(self) -> int:
        return flat_dim(self.shape, self.symmetric)

    @property
    def padded(self) -> int:
        return padded_dim(self.dim)

    @property
    def l2_sensitivity(self) -> float:
        """Δ₂ of the integer sum (replace-one): 2c̃; for PSD units also ≤ √2·sB + 2√D (the rotated
        triangles t, t' have ⟨t, t'⟩ = (tr(AA') + Σ A_ii A'_ii)/2 ≥ 0, so ‖t − t'‖ ≤ √2·sB, and each
        rounding error has |e_i| < 1)."""
        plain = 2 * self.rounded_bound
        if not self.psd:
            return plain
        # (1 + 1e-9): the float64 rounding of a unit's projection onto the PSD cone (eigenvalues ≥ −1e-15·norm)
        return min(plain, math.sqrt(2.0) * (1 + 1e-9) * self.scale * self.bound + 2 * math.sqrt(self.padded))

    @property
    def l1_sensitivity(self) -> float:
        """Δ₁ of the integer sum (replace-one): 2c̃·min(√D, c̃), and ≤ Δ₂·min(√D, Δ₂) (an integer
        vector v has ‖v‖₁ ≤ min(√D‖v‖₂, ‖v‖₂²))."""
        plain = 2 * self.rounded_bound * min(math.sqrt(self.padded), self.rounded_bound)
        l2 = self.l2_sensitivity
        return min(plain, l2 * min(math.sqrt(self.padded), l2))

    def event(self, survivors: int, min_nodes: int) -> dp_accounting.DpEvent:
        """The release's event when ``survivors`` nodes' noise shares reached the sum."""
        if self.variance <= 0:
            return dp_accounting.NonPrivateDpEvent()
        return SkellamDpEvent(self.variance * survivors / min_nodes, self.l2_sensitivity, self.l1_sensitivity)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "scale": self.scale,
            "padded_dim": self.padded,
            "rounded_bound": self.rounded_bound,
            "l2_sensitivity_integer": self.l2_sensitivity,
            "l1_sensitivity_integer": self.l1_sensitivity,
            "rotation_seed": self.rotation_seed,
            "psd_tightened": self.psd,
        }


def encode_units(x: Tensor, enc: StatEncoding, generator: torch.Generator | Sequence[torch.Generator]) -> Tensor:
    """Node side: (U, d) float contributions → (D,) int64 sum of their scaled, rotated,
    conditionally rounded vectors (each re-clipped to B first, so c̃ holds for every input).
    ``generator``: one for all rows, or one per row (then a row's rounding depends on that row alone)."""
    if x.shape[0] == 0:
        return torch.zeros(enc.padded, dtype=torch.int64)
    x = x.to(device="cpu", dtype=torch.float64)
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    x = x * torch.clamp(enc.bound / torch.clamp(norms, min=1e-300), max=1.0)
    y = rotate(x * enc.scale, enc.rotation_seed, enc.padded)
    if isinstance(generator, torch.Generator):
        return conditional_round(y, enc.rounded_bound, generator).sum(dim=0)
    if len(generator) != y.shape[0]:
        raise ValueError(f"encode_units: {len(generator)} generators for {y.shape[0]} units")
    out = torch.zeros(enc.padded, dtype=torch.int64)
    for row, g in zip(y, generator, strict=True):
        out += conditional_round(row.unsqueeze(0), enc.rounded_bound, g)[0]
    return out


def noise_share(enc: StatEncoding, min_nodes: int, generator: torch.Generator) -> Tensor:
    """Node side: this node's share Sk(V/min_nodes) of the noise, (D,) int64."""
    return skellam_noise((enc.padded,), enc.variance / min_nodes, generator)


def decode(modular_sum: Tensor, enc: StatEncoding) -> Tensor:
    """Server side: the sum mod 2^b → the statistic (float64): centred, un-rotated, un-scaled."""
    y = centered(modular_sum, enc.bits).to(torch.float64)
    return unflatten(unrotate(y, enc.rotation_seed, enc.dim) / enc.scale, enc.shape, enc.symmetric)


def local_gaussian(x: Tensor, std: float, generator: torch.Generator, secure: bool) -> Tensor:
    """Local DP, node side: each unit's row released with its own N(0, std²) noise, then summed."""
    x = x.to(device="cpu", dtype=torch.float64)
    if std <= 0 or x.shape[0] == 0:
        return x.sum(dim=0)
    if secure:
        return secure_module.gaussian(x, std).sum(dim=0)
    return (x + std * torch.randn(x.shape, generator=generator, dtype=torch.float64)).sum(dim=0)


# ----- choosing the scale, the bits and the noise --------------------------------------------------
def wrap_tail(D: int, probability: float = WRAP_PROBABILITY) -> float:
    """k with D·2·exp(−k²/2) = ``probability`` (the sub-Gaussian tail, union over D)."""
    return math.sqrt(2 * math.log(2 * D / probability))


SUSPECT_FALSE_ALARM = 1e-3
"""At most this probability that an honest round's sum of one statistic has a coordinate flagged as a
suspected wrap (:func:`suspected_wraps`), under the tail bound the scale was chosen by."""


def suspect_threshold(enc: StatEncoding) -> float:
    """τ = (2^(b−1) − 1)·k(:data:`SUSPECT_FALSE_ALARM`)/k(:data:`WRAP_PROBABILITY`), from public values.

    The plan's scale is the largest at which k·σ of the honest sum (signal of all n units, their
    rounding and every node's noise: :func:`sum_range`) equals 2^(b−1) − 1 (:func:`max_scale`, at a noise
    multiplier no smaller than the final one), so an honest centred coordinate exceeds τ, i.e.
    k(p_f)·σ, with probability below p_f over the D coordinates."""
    half = 2.0 ** (enc.bits - 1) - 1
    return half * wrap_tail(enc.padded, SUSPECT_FALSE_ALARM) / wrap_tail(enc.padded)


def suspected_wraps(modular_sum: Tensor, enc: StatEncoding) -> int:
    """Coordinates of a round's sum mod 2^b that the server alone flags as wrapped: centred, beyond
    :func:`suspect_threshold`. A coordinate that wrapped by less than 2^(b−1) + 1 − τ lands beyond τ
    (its centred value is the true one minus 2^b); a wrap that lands within τ is not seen, and an honest
    round flags any coordinate with probability below :data:`SUSPECT_FALSE_ALARM`. A function of the
    released sum and public values only: it costs no privacy."""
    return int((centered(modular_sum, enc.bits).abs() > suspect_threshold(enc)).sum())


def sum_range(scale: float, bound: float, D: int, units: int, z: float, nodes: int, min_nodes: int) -> float:
    """k × the sub-Gaussian scale of one coordinate of the rotated integer sum of ``units`` units:
    signal (‖Σ x‖ ≤ units·sB, rotated: ‖·‖²/D), rounding (≤ 1/4 per unit) and noise (variance
    (z·c̃)²·nodes/min_nodes when every node survives)."""
    c = rounded_bound(scale * bound, D)
    variance = (units * scale * bound) ** 2 / D + units / 4 + (z * c) ** 2 * nodes / min_nodes
    return wrap_tail(D) * math.sqrt(variance)


def max_scale(bound: float, D: int, units: int, z: float, nodes: int, min_nodes: int, bits: int) -> float:
    """The largest scale s whose sum stays in [−2^(b−1), 2^(b−1)) but with probability
    :data:`WRAP_PROBABILITY` (a ValueError naming ``bits`` when none does)."""
    half = 2.0 ** (bits - 1) - 1

    def fits(s: float) -> bool:
        return sum_range(s, bound, D, units, z, nodes, min_nodes) <= half

    lo, hi = 1e-12 / bound, 1.0 / bound
    if not fits(lo):  # decided on the declared bound, units, nodes and bits: no data is read
        raise RefusedBeforeRelease(
            f"bits={bits} cannot hold a sum of {units} units in {D} coordinates with wrap probability "
            f"< {WRAP_PROBABILITY:g}; use more --bits"
        )
    while fits(hi):
        lo, hi = hi, hi * 2
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        if hi / lo < 1 + 1e-9:
            break
    return lo


@dataclass(frozen=True)
class StatShape:
    """What a protocol declares of one statistic (its ``StatSpec``, without importing protocols)."""

    name: str
    shape: tuple[int, ...]
    bound: float
    symmetric: bool
    psd: bool = False


@dataclass(frozen=True)
class DistributedPlan:
    """The public parameters of a distributed-DP run: one encoding per statistic name."""

    model: DpModel
    bits: int
    nodes: int
    min_nodes: int
    noise_multiplier: float
    """z: each statistic's variance is V = (z·Δ₂/2)², σ = z·Δ₂/2 in integer units."""
    encodings: dict[str, StatEncoding]
    users_per_node: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "dp_model": self.model.value,
            "bits": self.bits,
            "nodes": self.nodes,
            "min_nodes": self.min_nodes,
            "noise_multiplier": self.noise_multiplier,
            "statistics": {k: {**e.to_dict(), "variance_integer": e.variance} for k, e in self.encodings.items()}
            if self.model is DpModel.DISTRIBUTED
            else {},
        }


def _worst_leaf(encodings: Sequence[StatEncoding]) -> Callable[[float], SkellamDpEvent]:
    """A Skellam event at multiplier z that dominates every statistic's at every order. With
    V = (zΔ₂/2)² the bound is 2α/z² + min(4(2α−1)/(z⁴Δ₂²) + 24ρ/(z⁴Δ₂²), 6ρ/z²), ρ = Δ₁/Δ₂²: the
    smallest Δ₂ with the largest ρ dominates each statistic's."""
    l2 = min(e.l2_sensitivity for e in encodings)
    ratio = max(e.l1_sensitivity / e.l2_sensitivity**2 for e in encodings)

    def leaf(z: float) -> SkellamDpEvent:
        return SkellamDpEvent((z * l2 / 2) ** 2, l2, ratio * l2 * l2)

    return leaf


def skellam_event(
    make_event: Callable[[float], dp_accounting.DpEvent], encodings: Sequence[StatEncoding]
) -> Callable[[float], dp_accounting.DpEvent]:
    """``make_event`` (what one unit is touched by, Gaussian releases of multiplier z) with every
    Gaussian replaced by the dominating Skellam event at the same multiplier."""
    leaf = _worst_leaf(encodings)

    def mapped(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
        if isinstance(event, dp_accounting.GaussianDpEvent):
            return leaf(event.noise_multiplier)
        if isinstance(event, dp_accounting.ComposedDpEvent):
            return dp_accounting.ComposedDpEvent([mapped(e) for e in event.events])
        if isinstance(event, dp_accounting.SelfComposedDpEvent):
            return dp_accounting.SelfComposedDpEvent(mapped(event.event), event.count)
        raise ValueError(
            f"dp_model distributed: cannot map a {type(event).__name__} to the Skellam mechanism "
            "(Poisson sampling and non-Gaussian releases are not supported)"
        )

    return lambda z: mapped(make_event(z))


def _encodings(
    stats: Sequence[StatShape], units: int, z: float, nodes: int, min_nodes: int, bits: int, seed: int
) -> list[StatEncoding]:
    out = []
    for i, st in enumerate(stats):
        D = padded_dim(flat_dim(st.shape, st.symmetric))
        s = max_scale(st.bound, D, units, z, nodes, min_nodes, bits)
        c = rounded_bound(s * st.bound, D)
        enc = StatEncoding(st.name, st.shape, st.symmetric, st.bound, s, c, 0.0, bits, seed + i, st.psd)
        out.append(dataclasses.replace(enc, variance=(z * enc.l2_sensitivity / 2) ** 2))
    return out


def choose_bits(stats: Sequence[StatShape], units: int, z: float, nodes: int, min_nodes: int) -> int:
    """The fewest bits (≥ 8) at which rounding inflates every bound by at most 1 % (c̃ ≤ 1.01·sB)."""
    for bits in range(8, MAX_BITS + 1):
        try:
            encs = _encodings(stats, units, z, nodes, min_nodes, bits, 0)
        except ValueError:
            continue
        if all(e.rounded_bound <= AUTO_BITS_INFLATION * e.scale * e.bound for e in encs):
            return bits
    return MAX_BITS


def plan_distributed(
    stats: Sequence[StatShape],
    *,
    units: int,
    nodes: int,
    min_nodes: int,
    bits: int,
    seed: int,
    calibration: tuple[Callable[[float], dp_accounting.DpEvent], float, float, str] | None,
    central_z: float,
    users_per_node: int = 0,
    release_ratio: float = 1.0,
) -> DistributedPlan:
    """Scales, bits and the noise multiplier of a distributed run. ``calibration`` is the
    protocol's own (make_event, ε, δ, accountant), or None without noise (ε = ∞); ``release_ratio``: each
    release's noise multiplier over make_event's argument (the protocol's z over its calibrated one). z is solved so
    that the dominating Skellam composition meets the target; scales are chosen for a z at least as
    large, so the wrap bound holds at the final one."""
    if not 1 <= min_nodes <= nodes:
        raise ValueError(f"min_nodes must be in [1, nodes={nodes}]; got {min_nodes}")
    merged: dict[str, StatShape] = {}
    for st in stats:
        if not (st.bound > 0 and math.isfinite(st.bound)):
            raise ValueError(f"dp_model distributed: statistic {st.name!r} needs a finite per-unit bound")
        if merged.setdefault(st.name, st) != st:
            raise ValueError(f"dp_model distributed: statistic {st.name!r} changes shape or bound across rounds")
    shapes = list(merged.values())
    z_guess = central_z * 1.02
    if bits == 0:
        bits = choose_bits(shapes, units, z_guess, nodes, min_nodes)
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be 0 (auto) or in [{MIN_BITS}, {MAX_BITS}]; got {bits}")
    if calibration is None or central_z == 0:
        encs = _encodings(shapes, units, 0.0, nodes, min_nodes, bits, seed)
        return DistributedPlan(
            DpModel.DISTRIBUTED, bits, nodes, min_nodes, 0.0, {e.name: e for e in encs}, users_per_node
        )
    make_event, epsilon, delta, _ = calibration
    for _ in range(20):
        encs = _encodings(shapes, units, z_guess, nodes, min_nodes, bits, seed)
        # a composition holding a Skellam release is accounted in RDP (event_epsilon) whatever the run's accountant;
        # "pld" only routes calibration through event_epsilon (zcdp would ask Skellam for a ρ it has not)
        # release_ratio: each release's multiplier over make_event's argument (its Gaussians are z·ratio)
        z = calibrate_noise_multiplier(skellam_event(make_event, encs), epsilon, delta, "pld") * release_ratio
        if z <= z_guess:
            encs = [dataclasses.replace(e, variance=(z * e.l2_sensitivity / 2) ** 2) for e in encs]
            return DistributedPlan(
                DpModel.DISTRIBUTED, bits, nodes, min_nodes, z, {e.name: e for e in encs}, users_per_node
            )
        z_guess = z * 1.02
    raise RefusedBeforeRelease("dp_model distributed: the noise calibration did not settle; use more --bits")


class RecordingCalibrations(Calibrations):
    """:class:`Calibrations` that also keeps each (make_event, ε, δ, accountant) it was asked for,
    so the distributed plan can solve the same guarantee for the Skellam mechanism."""

    def __init__(self, known: Mapping[str, float] | None = None) -> None:
        super().__init__(known)
        self.asked: list[tuple[Callable[[float], dp_accounting.DpEvent], float, float, str]] = []

    def __call__(
        self,
        make_event: Callable[[float], dp_accounting.DpEvent],
        target_epsilon: float,
        target_delta: float,
        accountant: Any = "pld",
        neighbours: Any = "replace-one",
    ) -> float:
        name = accountant.value if hasattr(accountant, "value") else str(accountant)
        self.asked.append((make_event, float(target_epsilon), float(target_delta), name))
        return super().__call__(make_event, target_epsilon, target_delta, accountant, neighbours)


# ----- the server's side: records what the nodes' noise made, adds none ----------------------------
class NodeSidePrivatizer(Privatizer):
    """A Privatizer whose sums arrive already noised by the nodes (distributed or local DP).

    The runtime registers each decoded sum with :meth:`arrived` before ``server_update``; a sum
    release then records the mechanism the nodes ran and returns the value unchanged. A value
    that was not registered (a statistic the runtime did not carry through the nodes) is refused,
    as is every other kind of release: nothing leaves without its noise."""

    model = DpModel.CENTRAL

    def __init__(self, seed: int, plan: DistributedPlan, ledger: Ledger | None = None, *, secure: bool = False) -> None:
        super().__init__(seed, ledger, secure=secure)
        self.plan = plan
        self.noise_seed = int(seed)
        self._arrived: list[tuple[Tensor, str, int, int]] = []
        self.round_diagnostics: dict[str, float] = {}
        self.dropout = 0.0
        """Simulation: the probability each node drops out of each round (public, data-independent)."""
        self.dropout_seed = 0

    def begin_round(self) -> None:
        """Forget sums that arrived for an earlier round (each is released at most once, in its round)."""
        self._arrived = []

    def arrived(self, value: Tensor, name: str, survivors: int, units: int) -> None:
        """``value`` is the server's decoded sum of statistic ``name`` from ``survivors`` nodes: the very
        tensor the runtime hands ``server_update`` (its handle: a release is matched to it by identity)."""
        self._arrived.append((value, name, survivors, units))

    def _take(
        self, value: Tensor, per_unit_bound: float, release: str, sampling_probability: float
    ) -> tuple[str, int, int]:
        """The arrived sum that ``value`` is: the registered tensor itself, never one found by comparing values
        (two statistics may hold equal numbers; a transform of a sum is not a sum the nodes noised)."""
        found = next((i for i, (v, *_) in enumerate(self._arrived) if v is value), None)
        if found is None:
            raise ValueError(
                f"release {release!r}: dp_model {self.model.value} releases only sums that arrived noised from the "
                "nodes, each the tensor the runtime handed server_update (summed.stats[name], untransformed)"
            )
        entry = self._arrived.pop(found)
        if sampling_probability < 1.0:
            raise ValueError(f"release {release!r}: dp_model {self.model.value} does not support Poisson sampling")
        _, name, survivors, units = entry
        if not math.isclose(per_unit_bound, self._bound(name), rel_tol=1e-12):
            raise ValueError(
                f"release {release!r}: per-unit bound {per_unit_bound} differs from statistic {name!r}'s "
                f"declared {self._bound(name)}"
            )
        return name, survivors, units

    def _bound(self, name: str) -> float:
        return self.plan.encodings[name].bound

    def _release(
        self,
        value: Tensor,
        per_unit_bound: float,
        name: str,
        round: int,
        units: str,
        params: dict[str, Any] | None,
        sampling_probability: float,
    ) -> Tensor:
        raise NotImplementedError

    def gaussian_sum(
        self,
        value: Tensor,
        *,
        per_unit_bound: float,
        noise_multiplier: float,
        name: str,
        round: int,
        units: str = ALL_UNITS,
        params: dict[str, Any] | None = None,
        sampling_probability: float = 1.0,
    ) -> Tensor:
        return self._release(value, per_unit_bound, name, round, units, params, sampling_probability)

    def symmetric_gaussian_sum(
        self,
        value: Tensor,
        *,
        per_unit_bound: float,
        noise_multiplier: float,
        name: str,
        round: int,
        units: str = ALL_UNITS,
        psd_units: bool = False,
        params: dict[str, Any] | None = None,
        sampling_probability: float = 1.0,
    ) -> Tensor:
        # no PSD tightening: the rounded (and locally noised) contributions are not PSD
        return self._release(value, per_unit_bound, name, round, units, params, sampling_probability)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"dp_model {self.model.value} supports only sum releases (Gaussian sums of clipped units)")

    gaussian_sum_batched = _refuse
    exponential = _refuse
    dp_covariance = _refuse


class DistributedPrivatizer(NodeSidePrivatizer):
    """Distributed DP: records each sum as the Skellam mechanism on integers (:class:`SkellamDpEvent`)."""

    model = DpModel.DISTRIBUTED

    def _release(
        self,
        value: Tensor,
        per_unit_bound: float,
        name: str,
        round: int,
        units: str,
        params: dict[str, Any] | None,
        sampling_probability: float,
    ) -> Tensor:
        stat, survivors, _ = self._take(value, per_unit_bound, name, sampling_probability)
        enc = self.plan.encodings[stat]
        event = enc.event(survivors, self.plan.min_nodes)
        variance = event.variance if isinstance(event, SkellamDpEvent) else 0.0
        release = Release(
            round,
            name,
            "skellam_distributed",
            float(per_unit_bound),
            enc.l2_sensitivity / enc.scale,
            math.sqrt(variance) / enc.scale,
            units,
            event,
            {
                **(params or {}),
                **enc.to_dict(),
                "dp_model": self.model.value,
                "sensitivity_formula_integer": "Δ₂ = 2c̃, for PSD units min(2c̃, √2·(1 + 1e-9)·sB + 2√D); "
                "Δ₁ = min(2c̃·min(√D, c̃), Δ₂·min(√D, Δ₂)); "
                "c̃ = min(sB + √D, sqrt((sB)² + D/4 + sqrt(2 log(1/β))(sB + √D/2))), β = exp(−1/2)",
                "variance_integer": variance,
                "nodes_survived": survivors,
                "min_nodes": self.plan.min_nodes,
            },
        )
        self.ledger.append(release)
        return value


class LocalPrivatizer(NodeSidePrivatizer):
    """Local DP: each unit released its own Gaussian (σ = z·B, Δ = 2B) on its node; the ledger
    records one local release per statistic and round, the guarantee of each unit that sent one."""

    model = DpModel.LOCAL

    def _release(
        self,
        value: Tensor,
        per_unit_bound: float,
        name: str,
        round: int,
        units: str,
        params: dict[str, Any] | None,
        sampling_probability: float,
    ) -> Tensor:
        _, survivors, count = self._take(value, per_unit_bound, name, sampling_probability)
        z = self.plan.noise_multiplier
        event = dp_accounting.GaussianDpEvent(z) if z > 0 else dp_accounting.NonPrivateDpEvent()
        release = Release(
            round,
            name,
            "local_gaussian",
            float(per_unit_bound),
            2.0 * per_unit_bound,
            z * per_unit_bound,
            units,
            event,
            {**(params or {}), "dp_model": self.model.value, "units_released": count, "nodes_survived": survivors},
        )
        self.ledger.append(release)
        return value


def plan_local(stats: Sequence[StatShape], *, nodes: int, z: float, users_per_node: int = 0) -> DistributedPlan:
    """Local DP's plan: each statistic's bound, and the protocol's own z (each unit's release is the
    central Gaussian with Δ = 2B, so the calibration's composition is each unit's guarantee)."""
    encs = {
        st.name: StatEncoding(st.name, st.shape, st.symmetric, st.bound, 1.0, st.bound, 0.0, MAX_BITS, 0)
        for st in stats
    }
    return DistributedPlan(DpModel.LOCAL, 0, nodes, nodes, z, encs, users_per_node)
