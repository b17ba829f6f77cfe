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

from fedpers.config import DpModel, Neighbours, neighbours_of
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
    v = value.to(dtype=torch.float64).reshape(value.shape[0], -1)
    if symmetric:
        return v.index_select(1, _triangle(int(shape[0]), v.device))
    return v


_TRIANGLES: dict[tuple[int, str], Tensor] = {}


def _triangle(n: int, device: torch.device) -> Tensor:
    """Flat indices i·n + j of the upper triangle (with diagonal) of an n × n matrix, in
    ``torch.triu_indices`` order (cached)."""
    key = (n, str(device))
    if key not in _TRIANGLES:
        i, j = torch.triu_indices(n, n)
        _TRIANGLES[key] = (i * n + j).to(device)
    return _TRIANGLES[key]


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
    """Orthonormal Walsh–Hadamard transform H/√D along the last dimension (D a power of two).

    Sylvester's H_D is a Kronecker product of smaller Sylvester matrices, H_D = H_a ⊗ H_b ⊗ …, so the
    transform is one small GEMM per factor (each factor ≤ :data:`HADAMARD_FACTOR`): O(D·Σ factors) per
    vector in a few large kernels, 10–20× the speed of log₂D butterfly passes on a batch of units.
    H/√D is symmetric and its own inverse."""
    D = x.shape[-1]
    if D & (D - 1):
        raise ValueError(f"the Walsh–Hadamard transform needs a power-of-two length, got {D}")
    lead = x.shape[:-1]
    factors = _hadamard_factors(D)
    y = x.reshape(-1, D)
    rows = y.shape[0]
    if len(factors) == 1:
        y = y @ _sylvester(D, y.dtype, y.device)
    elif len(factors) == 2:  # (H_a ⊗ H_b)·vec(Y) = vec(H_a Y H_b) for Y the row-major a × b view
        a, b = factors
        y = torch.matmul(_sylvester(a, y.dtype, y.device), y.reshape(rows, a, b) @ _sylvester(b, y.dtype, y.device))
    else:
        # index i = (i_1, …, i_m) in the factors' mixed radix: each step transforms the last digit and moves
        # it to the front, so after m steps every digit was transformed once and the order is the original one
        for f in reversed(factors):
            y = (y.reshape(rows, D // f, f) @ _sylvester(f, y.dtype, y.device)).transpose(1, 2).reshape(rows, D)
    return y.reshape(*lead, D) / math.sqrt(D)


HADAMARD_FACTOR = 128
"""Largest Sylvester factor :func:`hadamard` multiplies by (D ≤ 128 is one GEMM)."""
_SYLVESTER: dict[tuple[int, torch.dtype, str], Tensor] = {}


def _hadamard_factors(D: int) -> list[int]:
    """D = 2^p as the fewest powers of two ≤ :data:`HADAMARD_FACTOR`, as even as they go."""
    p = D.bit_length() - 1
    top = HADAMARD_FACTOR.bit_length() - 1
    parts = max(1, -(-p // top))
    return [1 << (p // parts + (1 if i < p % parts else 0)) for i in range(parts)]


def _sylvester(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Sylvester's n × n Hadamard matrix (entries ±1, H_2n = [[H, H], [H, −H]]), cached per dtype and device."""
    key = (n, dtype, str(device))
    if key not in _SYLVESTER:
        h = torch.ones(1, 1, dtype=dtype)
        while h.shape[0] < n:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        _SYLVESTER[key] = h.to(device)
    return _SYLVESTER[key]


def rotation_signs(seed: int, D: int) -> Tensor:
    """The public random signs ε of the rotation H·diag(ε), from its seed alone."""
    g = torch.Generator().manual_seed(int(seed) % 2**63)
    return torch.randint(0, 2, (D,), generator=g, dtype=torch.int64).to(torch.float64) * 2 - 1


def rotate(x: Tensor, seed: int, D: int) -> Tensor:
    """(U, d) → (U, D): zero-padded to D, signs flipped, Walsh–Hadamard transformed (norms kept). Where
    D is one Sylvester factor (≤ :data:`HADAMARD_FACTOR`), one GEMM with the d × D matrix diag(ε)·H[:d]/√D
    (the padding and the signs folded in)."""
    d = x.shape[-1]
    if D <= HADAMARD_FACTOR:
        return x.to(torch.float64) @ _rotation_matrix(seed, d, D, x.device)
    padded = torch.zeros(*x.shape[:-1], D, dtype=torch.float64, device=x.device)
    torch.mul(x.to(torch.float64), rotation_signs(seed, D)[:d].to(x.device), out=padded[..., :d])
    return hadamard(padded)


_ROTATIONS: dict[tuple[int, int, int, str], Tensor] = {}


def _rotation_matrix(seed: int, d: int, D: int, device: torch.device) -> Tensor:
    """diag(ε)·H[:d, :]/√D, the rotation of a zero-padded row as one matrix (a few kept)."""
    key = (int(seed), d, D, str(device))
    if key not in _ROTATIONS:
        if len(_ROTATIONS) >= 16:
            _ROTATIONS.pop(next(iter(_ROTATIONS)))
        h = _sylvester(D, torch.float64, torch.device("cpu"))[:d] / math.sqrt(D)
        _ROTATIONS[key] = (rotation_signs(seed, D)[:d].unsqueeze(1) * h).to(device)
    return _ROTATIONS[key]


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


Randomness = torch.Generator | Tensor
"""Where a batch of units' rounding (or local noise) draws from: one generator for every row (OS-seeded
under ``secure``), or each row's own key (:func:`unit_keys`), whose stream depends on that unit alone."""


def conditional_round(x: Tensor, bound: float, generator: Randomness) -> Tensor:
    """(U, D) float64 → (U, D) int64 with every row's norm ≤ ``bound``: randomized rounding (up with
    probability the fraction), each row re-drawn until it meets the bound; a row still over after
    :data:`MAX_ROUNDING_TRIES` draws is rounded toward zero (norm ≤ its input's). The bound is
    checked in exact integer arithmetic (Σ r² ≤ ⌊bound²⌋). ``generator``: a torch generator, or (U,)
    keys: row j's draw t is :func:`keyed_coins` of its key, so its rounding is the same whatever
    other rows it is batched with."""
    return _rounded(x, bound, generator).to(torch.int64)


def _rounded(x: Tensor, bound: float, generator: Randomness) -> Tensor:
    """:func:`conditional_round` as float64 integers: r = ⌊x + u⌋ (u uniform in [0, 1): up exactly when
    u ≥ 1 − frac(x), with probability frac(x)). Where (bound + √D)² < 2^52 every r_i² and Σ r_i² is an
    integer float64 holds exactly, so the check is exact in float64; above, in int64."""
    rows, D = x.shape
    if isinstance(generator, Tensor) and generator.shape != (rows,):
        raise ValueError(f"conditional_round: {tuple(generator.shape)} keys for {rows} rows")
    exact = (bound + math.sqrt(D)) ** 2 < 2.0**52
    limit = math.floor(bound**2 + 1e-9)
    out = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    todo: Tensor | None = None  # None: every row
    for draw in range(MAX_ROUNDING_TRIES):
        some = x if todo is None else x[todo]
        if isinstance(generator, Tensor):
            r = keyed_coins(generator if todo is None else generator[todo], draw, D).to(x.device).add_(some)
        else:
            r = torch.rand(some.shape, generator=generator, dtype=torch.float64).to(x.device).add_(some)
        r = r.floor_()
        if exact:
            ok = torch.einsum("ij,ij->i", r, r) <= limit
        else:
            whole = r.to(torch.int64)
            ok = (whole * whole).sum(dim=1) <= limit
        if todo is None:
            if bool(ok.all()):
                return r
            out, todo = r, torch.arange(rows, device=x.device)
        out[todo[ok]] = r[ok]
        todo = todo[~ok]
        if todo.numel() == 0:
            return out
    out[todo] = torch.trunc(x[todo])
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


# ----- each unit's own random stream, batched -----------------------------------------------------
_GOLDEN = -0x61C8864680B583EB
"""2^64/φ as a signed 64-bit integer: SplitMix64's increment (Steele, Lea & Flood, OOPSLA 2014)."""
_MIX1, _MIX2 = -0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15
"""SplitMix64's finaliser multipliers 0xBF58476D1CE4E5B9 and 0x94D049BB133111EB, signed."""


def _shift(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: Tensor) -> Tensor:
    """SplitMix64's output function on int64 (multiplication wraps mod 2^64), in place on ``z``: a
    bijection of 64-bit words whose outputs on consecutive inputs pass BigCrush. Simulation randomness,
    not cryptography: a deployment's node draws from OS entropy (``secure``)."""
    z ^= _shift(z, 30)
    z *= _MIX1
    z ^= _shift(z, 27)
    z *= _MIX2
    z ^= _shift(z, 31)
    return z


def stream_key(tag: str) -> int:
    """A 64-bit signed key from a text tag (its SHA-256)."""
    return int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little", signed=True)


def unit_keys(seed: int, round: int, statistic: str, ids: Tensor, purpose: str = "rounding") -> Tensor:
    """(U,) int64: each unit's key for one statistic of one round, from (seed, round, statistic, unit id)
    alone, so replacing one unit moves only that unit's draws and a unit draws the same whatever node,
    chunk or batch it is computed in."""
    base = stream_key(f"fedpers-unit-{purpose}:{int(seed)}:{int(round)}:{statistic}")
    return mix64(ids.to(device="cpu", dtype=torch.int64).add(1).mul(_GOLDEN).add(base))


def keyed_words(keys: Tensor, draw: int, width: int) -> Tensor:
    """(U, width) int64: entry (j, i) is the SplitMix64 output of key j at counter ``draw``·width + i + 1,
    a function of (key, draw, i) alone."""
    counter = torch.arange(draw * width + 1, (draw + 1) * width + 1, dtype=torch.int64).mul_(_GOLDEN)
    return mix64(keys.to(torch.int64).unsqueeze(1) + counter)


def keyed_uniforms(keys: Tensor, draw: int, width: int) -> Tensor:
    """(U, width) float64 uniforms in [0, 1) of 53 bits, each row from its own key (:func:`keyed_words`)."""
    return _shift(keyed_words(keys, draw, width), 11).to(torch.float64).mul_(2.0**-53)


def keyed_coins(keys: Tensor, draw: int, width: int) -> Tensor:
    """(U, width) float64 uniforms on the grid 2^-32·{0, …, 2^32 − 1}, two from each 64-bit word of
    :func:`keyed_words` (its 32-bit halves; half the work): what a randomized rounding compares a
    fraction with, biased by under 2^-32 (the rounding's norm bound, which the privacy rests on, is
    enforced exactly whatever the draws)."""
    words = keyed_words(keys, draw, -(-width // 2)).view(torch.int32)[:, :width]
    return words.to(torch.float64).add_(2.0**31).mul_(2.0**-32)


def keyed_normals(keys: Tensor, width: int) -> Tensor:
    """(U, width) float64 standard normals, each row from its own key: Box–Muller on 53-bit uniforms
    (draw 0: radii, draw 1: angles), both of each pair's normals used."""
    half = -(-width // 2)
    radius = keyed_uniforms(keys, 0, half).neg_().log1p_().mul_(-2.0).sqrt_()
    angle = keyed_uniforms(keys, 1, half).mul_(2.0 * math.pi)
    return torch.cat((radius * torch.cos(angle), radius * torch.sin(angle)), dim=1)[:, :width]


def unit_randomness(
    seed: int, round: int, statistic: str, ids: Tensor, secure: bool, purpose: str = "rounding"
) -> Randomness:
    """Where a batch of units ``ids`` draws its rounding (or local noise) in a round: each unit's own key
    (:func:`unit_keys`); with ``secure``, one generator seeded from OS entropy for the batch (nothing to
    reproduce, and every unit's draws are fresh)."""
    if secure:
        return torch.Generator().manual_seed(secure_module.os_seed())
    return unit_keys(seed, round, statistic, ids, purpose)


def node_membership(seed: int, round: int, ids: Tensor, q: float, secure: bool) -> Tensor:
    """(U,) bool: whether each unit of ``ids`` is in round ``round``'s Poisson sample (probability ``q``,
    independently), drawn on the unit's node — from each unit's own key (a simulation: the same draw
    whatever node or chunk holds it), or OS entropy with ``secure`` — so the sample the amplification
    rests on is never known to the server."""
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling rate q must be in (0, 1], got {q}")
    if secure:
        generator = torch.Generator().manual_seed(secure_module.os_seed())
        return torch.rand(int(ids.numel()), generator=generator, dtype=torch.float64) < q
    return keyed_uniforms(unit_keys(seed, round, "sampled", ids, purpose="membership"), 0, 1)[:, 0] < q


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
    add_remove: bool = False
    """Sensitivities of add-remove neighbours (one unit's rounded vector: Δ₂ = c̃), else replace-one."""

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
        rounding error has |e_i| < 1). Add-remove: c̃ (one unit's whole rounded vector, PSD or not)."""
        if self.add_remove:
            return self.rounded_bound
        plain = 2 * self.rounded_bound
        if not self.psd:
            return plain
        # (1 + 1e-9): the float64 rounding of a unit's projection onto the PSD cone (eigenvalues ≥ −1e-15·norm)
        return min(plain, math.sqrt(2.0) * (1 + 1e-9) * self.scale * self.bound + 2 * math.sqrt(self.padded))

    @property
    def l1_sensitivity(self) -> float:
        """Δ₁ of the integer sum (replace-one): 2c̃·min(√D, c̃), and ≤ Δ₂·min(√D, Δ₂) (an integer
        vector v has ‖v‖₁ ≤ min(√D‖v‖₂, ‖v‖₂²)). Add-remove: c̃·min(√D, c̃)."""
        if self.add_remove:
            return self.rounded_bound * min(math.sqrt(self.padded), self.rounded_bound)
        plain = 2 * self.rounded_bound * min(math.sqrt(self.padded), self.rounded_bound)
        l2 = self.l2_sensitivity
        return min(plain, l2 * min(math.sqrt(self.padded), l2))

    @property
    def noise_scale(self) -> float:
        """σ/z in integer units: Δ₂/2 replace-one, Δ₂ add-remove (z = σ over a unit's distance from absent in
        both relations, as central's Gaussian), so V = (z·noise_scale)²."""
        return self.l2_sensitivity if self.add_remove else self.l2_sensitivity / 2

    def event(self, survivors: int, min_nodes: int, collusion: int = 0) -> dp_accounting.DpEvent:
        """The release's event when ``survivors`` nodes' noise shares reached the sum, against a server that
        also knows the shares of ``collusion`` of them: the other survivors − c shares, each V/(m − c)."""
        if self.variance <= 0:
            return dp_accounting.NonPrivateDpEvent()
        honest = (survivors - collusion) / (min_nodes - collusion)
        return SkellamDpEvent(self.variance * honest, self.l2_sensitivity, self.l1_sensitivity)

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
            "neighbours": "add-remove" if self.add_remove else "replace-one",
        }


UNIT_BLOCK = 256
"""Units a node encodes at once when each draws from its own key (:func:`encode_units` scales, rotates and
rounds them; :func:`local_gaussian` noises them): their temporaries stay in cache, where a share of 2,048
units' each streamed from memory (DPALS's D = 1,024 on one thread: 31–33 ns a coordinate in blocks of
128–512 units against 51 ns in one block of 2,048)."""


def clip_rows(x: Tensor, bound: float) -> Tensor:
    """(U, d) → (U, d) float64 on the host, each row scaled to norm ≤ ``bound`` (a row within it is multiplied by
    exactly 1.0: unchanged to the bit; one whose norm overflows becomes 0). Both node-side encodings apply it to
    every unit's row, so the declared bound holds whatever the protocol's own clip computed from the broadcast
    and the unit's data (float32 rounding, a numeric path no clip covers)."""
    x = x.to(device="cpu", dtype=torch.float64)
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    return x * torch.clamp(bound / torch.clamp(norms, min=1e-300), max=1.0)


def encode_units(x: Tensor, enc: StatEncoding, generator: Randomness) -> Tensor:
    """Node side: (U, d) float contributions → (D,) int64 sum of their scaled, rotated,
    conditionally rounded vectors (each re-clipped to B first, so c̃ holds for every input).
    ``generator``: one for all rows, or each row's key (:func:`unit_keys`: a row's rounding then depends
    on that row alone, and the rows go :data:`UNIT_BLOCK` at a time: the sums are integers, so the blocks
    change no bit)."""
    if not isinstance(generator, Tensor) or x.shape[0] <= UNIT_BLOCK:
        return _encoded_sum(x, enc, generator)
    total = _encoded_sum(x[:UNIT_BLOCK], enc, generator[:UNIT_BLOCK])
    for lo in range(UNIT_BLOCK, x.shape[0], UNIT_BLOCK):
        total += _encoded_sum(x[lo : lo + UNIT_BLOCK], enc, generator[lo : lo + UNIT_BLOCK])
    return total


def _encoded_sum(x: Tensor, enc: StatEncoding, generator: Randomness) -> Tensor:
    """:func:`encode_units` of one block of rows."""
    if x.shape[0] == 0:
        return torch.zeros(enc.padded, dtype=torch.int64)
    x = clip_rows(x, enc.bound)
    y = rotate(x * enc.scale, enc.rotation_seed, enc.padded)
    rounded = _rounded(y, enc.rounded_bound, generator)
    if (enc.rounded_bound + math.sqrt(enc.padded)) * rounded.shape[0] < 2.0**52:  # the float sum is exact
        return rounded.sum(dim=0).to(torch.int64)
    return rounded.to(torch.int64).sum(dim=0)


def noise_share(enc: StatEncoding, honest: int, generator: torch.Generator) -> Tensor:
    """Node side: this node's share Sk(V/h) of the noise, (D,) int64, h = min_nodes − collusion
    (:attr:`DistributedPlan.honest`): any h shares sum to Sk(V)."""
    return skellam_noise((enc.padded,), enc.variance / honest, generator)


def decode(modular_sum: Tensor, enc: StatEncoding) -> Tensor:
    """Server side: the sum mod 2^b → the statistic (float64): centred, un-rotated, un-scaled."""
    y = centered(modular_sum, enc.bits).to(torch.float64)
    return unflatten(unrotate(y, enc.rotation_seed, enc.dim) / enc.scale, enc.shape, enc.symmetric)


def local_gaussian(x: Tensor, std: float, generator: Randomness, secure: bool) -> Tensor:
    """Local DP, node side: each unit's row released with its own N(0, std²) noise, then summed.
    ``generator``: each row's key (:func:`unit_keys`: its noise depends on that unit alone) or one
    generator; ``secure``: OpenDP's sampler from OS entropy."""
    x = x.to(device="cpu", dtype=torch.float64)
    if std <= 0 or x.shape[0] == 0:
        return x.sum(dim=0)
    if secure:
        return secure_module.gaussian(x, std).sum(dim=0)
    if isinstance(generator, Tensor):
        noisy = torch.empty_like(x)
        for lo in range(0, x.shape[0], UNIT_BLOCK):  # each row's noise from its key: the blocks change no bit
            noisy[lo : lo + UNIT_BLOCK] = x[lo : lo + UNIT_BLOCK] + std * keyed_normals(
                generator[lo : lo + UNIT_BLOCK], x.shape[1]
            )
        return noisy.sum(dim=0)
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
    collusion: int = 0
    """c: nodes that may collude with the server (they know their own noise shares and can subtract them);
    each share is sized so that any min_nodes − c of them carry the recorded variance."""

    @property
    def honest(self) -> int:
        """h = min_nodes − c: the fewest honest survivors whose shares must carry the variance V."""
        return self.min_nodes - self.collusion

    def summary(self) -> dict[str, Any]:
        return {
            "dp_model": self.model.value,
            "bits": self.bits,
            "nodes": self.nodes,
            "min_nodes": self.min_nodes,
            "collusion": self.collusion,
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
    per_sigma = 1.0 if encodings and encodings[0].add_remove else 0.5  # σ = z·Δ₂ add-remove, z·Δ₂/2 replace-one

    def leaf(z: float) -> SkellamDpEvent:
        return SkellamDpEvent((z * l2 * per_sigma) ** 2, l2, ratio * l2 * l2)

    return leaf


def skellam_event(
    make_event: Callable[[float], dp_accounting.DpEvent], encodings: Sequence[StatEncoding]
) -> Callable[[float], dp_accounting.DpEvent]:
    """``make_event`` (what one unit is touched by, Gaussian releases of multiplier z) with every
    Gaussian replaced by the dominating Skellam event at the same multiplier; a Poisson-sampled Gaussian
    becomes the Poisson-sampled Skellam (the subsampled bounds grow with the inner curve, so domination is
    kept), refused when a statistic is PSD-tightened (a sampled unit is c̃, not Δ₂/2, from absent)."""
    leaf = _worst_leaf(encodings)

    def mapped(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
        if isinstance(event, dp_accounting.GaussianDpEvent):
            return leaf(event.noise_multiplier)
        if isinstance(event, dp_accounting.ComposedDpEvent):
            return dp_accounting.ComposedDpEvent([mapped(e) for e in event.events])
        if isinstance(event, dp_accounting.SelfComposedDpEvent):
            return dp_accounting.SelfComposedDpEvent(mapped(event.event), event.count)
        if isinstance(event, dp_accounting.PoissonSampledDpEvent):
            tightened = [e.name for e in encodings if e.psd]
            if tightened:
                raise ValueError(
                    f"dp_model distributed: statistic(s) {tightened} are PSD-tightened, which a Poisson-sampled "
                    "release cannot be (a sampled unit is its full bound from absent)"
                )
            return dp_accounting.PoissonSampledDpEvent(event.sampling_probability, mapped(event.event))
        raise ValueError(
            f"dp_model distributed: cannot map a {type(event).__name__} to the Skellam mechanism "
            "(only Gaussian sums, plain or Poisson-sampled, are)"
        )

    return lambda z: mapped(make_event(z))


def _encodings(
    stats: Sequence[StatShape],
    units: int,
    z: float,
    nodes: int,
    min_nodes: int,
    bits: int,
    seed: int,
    add_remove: bool = False,
) -> list[StatEncoding]:
    out = []
    for i, st in enumerate(stats):
        D = padded_dim(flat_dim(st.shape, st.symmetric))
        s = max_scale(st.bound, D, units, z, nodes, min_nodes, bits)
        c = rounded_bound(s * st.bound, D)
        psd = st.psd and not add_remove  # add-remove: a unit is its whole norm from absent, PSD or not
        enc = StatEncoding(st.name, st.shape, st.symmetric, st.bound, s, c, 0.0, bits, seed + i, psd, add_remove)
        out.append(dataclasses.replace(enc, variance=(z * enc.noise_scale) ** 2))
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
    collusion: int = 0,
    neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
) -> DistributedPlan:
    """Scales, bits and the noise multiplier of a distributed run. ``calibration`` is the
    protocol's own (make_event, ε, δ, accountant), or None without noise (ε = ∞); ``release_ratio``: each
    release's noise multiplier over make_event's argument (the protocol's z over its calibrated one). z is solved so
    that the dominating Skellam composition meets the target; scales are chosen for a z at least as
    large, so the wrap bound holds at the final one. ``collusion`` c: shares sized for min_nodes − c honest
    survivors (each Sk(V/(m − c))), so the wrap bound counts nodes/(m − c) of V. ``neighbours``: the
    relation the encodings' sensitivities and the calibration are for (add-remove: Δ₂ = c̃, no PSD tightening)."""
    add_remove = neighbours_of(neighbours) is Neighbours.ADD_REMOVE
    if not 1 <= min_nodes <= nodes:
        raise ValueError(f"min_nodes must be in [1, nodes={nodes}]; got {min_nodes}")
    if not 0 <= collusion < min_nodes:
        raise ValueError(f"collusion must be in [0, min_nodes={min_nodes}); got {collusion}")
    honest = min_nodes - collusion
    merged: dict[str, StatShape] = {}
    for st in stats:
        if not (st.bound > 0 and math.isfinite(st.bound)):
            raise ValueError(f"dp_model distributed: statistic {st.name!r} needs a finite per-unit bound")
        if merged.setdefault(st.name, st) != st:
            raise ValueError(f"dp_model distributed: statistic {st.name!r} changes shape or bound across rounds")
    shapes = list(merged.values())
    z_guess = central_z * 1.02
    if bits == 0:
        bits = choose_bits(shapes, units, z_guess, nodes, honest)
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be 0 (auto) or in [{MIN_BITS}, {MAX_BITS}]; got {bits}")
    if calibration is None or central_z == 0:
        encs = _encodings(shapes, units, 0.0, nodes, honest, bits, seed, add_remove)
        return DistributedPlan(
            DpModel.DISTRIBUTED, bits, nodes, min_nodes, 0.0, {e.name: e for e in encs}, users_per_node, collusion
        )
    make_event, epsilon, delta, _ = calibration
    for _ in range(20):
        encs = _encodings(shapes, units, z_guess, nodes, honest, bits, seed, add_remove)
        # a composition holding a Skellam release is accounted in RDP (event_epsilon) whatever the run's accountant;
        # "pld" only routes calibration through event_epsilon (zcdp would ask Skellam for a ρ it has not)
        # release_ratio: each release's multiplier over make_event's argument (its Gaussians are z·ratio)
        z = (
            calibrate_noise_multiplier(skellam_event(make_event, encs), epsilon, delta, "pld", neighbours=neighbours)
            * release_ratio
        )
        if z <= z_guess:
            encs = [dataclasses.replace(e, variance=(z * e.noise_scale) ** 2) for e in encs]
            return DistributedPlan(
                DpModel.DISTRIBUTED, bits, nodes, min_nodes, z, {e.name: e for e in encs}, users_per_node, collusion
            )
        z_guess = z * 1.02
    raise RefusedBeforeRelease("dp_model distributed: the noise calibration did not settle; use more --bits")


class RecordingCalibrations(Calibrations):
    """:class:`Calibrations` that also keeps each (make_event, ε, δ, accountant) it was asked for,
    so the distributed plan can solve the same guarantee for the Skellam mechanism."""

    def __init__(self, known: Mapping[str, float] | None = None) -> None:
        super().__init__(known)
        self.asked: list[tuple[Callable[[float], dp_accounting.DpEvent], float, float, str]] = []
        self.relations: list[Neighbours] = []
        """The neighbouring relation of each calibration asked (parallel to :attr:`asked`)."""

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
        self.relations.append(neighbours_of(neighbours))
        return super().__call__(make_event, target_epsilon, target_delta, accountant, neighbours)


# ----- the server's side: records what the nodes' noise made, adds none ----------------------------
class NodeSidePrivatizer(Privatizer):
    """A Privatizer whose sums arrive already noised by the nodes (distributed or local DP).

    The runtime registers each decoded sum with :meth:`arrived` before ``server_update``; a sum
    release then records the mechanism the nodes ran and returns the value unchanged. A value
    that was not registered (a statistic the runtime did not carry through the nodes) is refused,
    as is every other kind of release: nothing leaves without its noise."""

    model = DpModel.CENTRAL
    knows_cohort = False  # the nodes draw each unit's Poisson membership; the server learns no |S|

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
        _, name, survivors, units = entry
        if sampling_probability < 1.0 and (self.model is not DpModel.DISTRIBUTED or self.plan.encodings[name].psd):
            raise ValueError(
                f"release {release!r}: dp_model {self.model.value} does not support Poisson sampling"
                + (" of a PSD-tightened statistic" if self.model is DpModel.DISTRIBUTED else "")
            )
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
        event = enc.event(survivors, self.plan.min_nodes, self.plan.collusion)
        variance = event.variance if isinstance(event, SkellamDpEvent) else 0.0
        if sampling_probability < 1.0 and isinstance(event, SkellamDpEvent):
            # the nodes drew each unit's membership themselves (node_membership): the server never learns it
            event = dp_accounting.PoissonSampledDpEvent(float(sampling_probability), event)
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
                "sensitivity_formula_integer": (
                    "add-remove: Δ₂ = c̃, Δ₁ = c̃·min(√D, c̃); "
                    if enc.add_remove
                    else "Δ₂ = 2c̃, for PSD units min(2c̃, √2·(1 + 1e-9)·sB + 2√D); "
                    "Δ₁ = min(2c̃·min(√D, c̃), Δ₂·min(√D, Δ₂)); "
                )
                + "c̃ = min(sB + √D, sqrt((sB)² + D/4 + sqrt(2 log(1/β))(sB + √D/2))), β = exp(−1/2)",
                "variance_integer": variance,
                "nodes_survived": survivors,
                "min_nodes": self.plan.min_nodes,
                "collusion": self.plan.collusion,
            },
            neighbours="add-remove" if enc.add_remove else "replace-one",
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
