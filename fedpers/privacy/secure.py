"""Noise for deployment: drawn from OS entropy by samplers that resist floating-point attacks.

A textbook Gaussian sampler on doubles leaks through the low-order bits of its outputs
(Mironov 2012; Jin et al. 2022). OpenDP's ``make_gaussian`` instead rounds the value to a
grid of width 2^k and adds exact discrete-Gaussian noise on that grid, and its noisy-max
samples Gumbel noise exactly; both draw from the operating system's CSPRNG. Nothing here
has a seed, so nothing written by a run can recompute the noise. OpenDP was chosen over a
hand-written sampler because it is maintained, audited and proven (its privacy maps are
checked against the paper proofs); its cost is about 60 µs per noise value on one core.
"""

from __future__ import annotations

import secrets

import torch

Tensor = torch.Tensor


def _prelude():
    import opendp.prelude as dp

    dp.enable_features("contrib")
    return dp


def gaussian(value: Tensor, std: float) -> Tensor:
    """value + N(0, std²) per entry, floating-point safe, from OS entropy."""
    dp = _prelude()
    flat = value.detach().double().cpu().reshape(-1)
    space = dp.vector_domain(dp.atom_domain(T=float, nan=False), size=int(flat.numel())), dp.l2_distance(T=float)
    noisy = dp.m.make_gaussian(*space, scale=float(std))(flat.tolist())
    return torch.tensor(noisy, dtype=torch.float64).reshape(value.shape).to(device=value.device, dtype=value.dtype)


def symmetric_gaussian(value: Tensor, std: float) -> Tensor:
    """Symmetric ``value`` with its upper triangle (diagonal included) noised by :func:`gaussian`, mirrored."""
    n = value.shape[0]
    rows, cols = torch.triu_indices(n, n, device=value.device)
    out = torch.zeros_like(value)
    out[rows, cols] = gaussian(value[rows, cols], std)
    return out + torch.triu(out, diagonal=1).transpose(0, 1)


def noisy_argmin(scores: Tensor, scale: float) -> int:
    """argmin_i (score_i − Gumbel(scale)): P(i) ∝ exp(−score_i / scale), the exponential mechanism.

    OpenDP 0.16 samples Gumbel noise for its zCDP noisy max (for ``max_divergence`` it
    samples exponential noise, i.e. permute-and-flip, whose law differs); only the sampler
    is used here, the ledger accounts the pure ε of the exponential mechanism.
    """
    dp = _prelude()
    values = scores.detach().double().cpu().tolist()
    space = dp.vector_domain(dp.atom_domain(T=float, nan=False), size=len(values)), dp.linf_distance(T=float)
    return int(dp.m.make_noisy_max(*space, dp.zero_concentrated_divergence(), scale=float(scale), negate=True)(values))


def os_seed() -> int:
    """A 63-bit seed from OS entropy (for draws OpenDP has no sampler for, e.g. the Wishart matrix)."""
    return secrets.randbits(63)
