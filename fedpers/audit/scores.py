"""How each canary is scored on what a run published: what it adds to each release under either version,
the log-likelihood ratio of "+" against "−", the empty slots' scores, and the ε a run proves to set the
bounds beside."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import dp_accounting
import torch

from fedpers.audit import bounds as audit_math
from fedpers.audit.published import NODE_SIDE_MECHANISMS, Published
from fedpers.experiments.hooks import Canaries
from fedpers.privacy import Ledger, Release
from fedpers.privacy import accountant as accountant_lib
from fedpers.privacy.distributed import (
    flatten,
)
from fedpers.privacy.ledger import SkellamDpEvent
from fedpers.protocols.base import Protocol, StatSpec, client_message

Tensor = torch.Tensor


Steer = Callable[[int, Mapping[str, Tensor]], Canaries]
"""A round's canaries from that round's broadcast (a design's ``steer`` bound to the run's canaries)."""


def _flat(spec: StatSpec, stat: Tensor) -> Tensor:
    """A statistic in the flat form the nodes encode it in (the upper triangle of a symmetric one)."""
    return flatten(stat.unsqueeze(0), spec.shape, spec.symmetric)[0]


def released_part(release: Release, value: Tensor) -> Tensor:
    """The coordinates that carry independent noise: the upper triangle of a symmetric release."""
    if release.mechanism == "symmetric_gaussian":
        rows, cols = torch.triu_indices(value.shape[0], value.shape[1])
        return value[rows, cols]
    return value.flatten()


@dataclass(frozen=True)
class CanaryScores:
    """Each canary's log-likelihood ratio and what it is compared with, from published outputs only.

    ``llr``: Σ_releases <Y − M, c⁺_i − c⁻_i>/σ²; ``gram``: Σ_releases <c⁺_i − c⁻_i, c⁺_j − c⁻_j>/σ²
    (K × K). Under the ledger's claim, llr_i = ±gram_ii/2 + noise of variance gram_ii + the other
    canaries' interference Σ_{j≠i} ±gram_ij/2 (their coins are fair and independent), so
    ``standard`` = llr_i/√v_i with v_i = gram_ii + Σ_{j≠i} gram_ij²/4 has mean ±``separation``/2
    and variance 1, ``separation`` = gram_ii/√v_i. Orthogonal canaries have gram diagonal: no
    interference, and the separation is √gram_ii."""

    llr: Tensor
    gram: Tensor

    @property
    def variance(self) -> Tensor:
        off = self.gram - torch.diag(torch.diagonal(self.gram))
        return torch.diagonal(self.gram) + (off**2).sum(1) / 4

    @property
    def standard(self) -> Tensor:
        return self.llr / self.variance.clamp_min(1e-300).sqrt()

    @property
    def separation(self) -> Tensor:
        return torch.diagonal(self.gram) / self.variance.clamp_min(1e-300).sqrt()


def score_canaries(protocol: Protocol, published: Published, canaries: Canaries) -> tuple[Tensor, Tensor]:
    """Log-likelihood ratio of "+" vs "−" for every canary, from the published outputs only, and each
    canary's own separation μ_i = sqrt(Σ ||c⁺_i − c⁻_i||²/σ²) (see :func:`canary_scores`)."""
    scored = canary_scores(protocol, published, canaries)
    return scored.llr, torch.diagonal(scored.gram).sqrt()


def canary_scores(
    protocol: Protocol,
    published: Published,
    canaries: Canaries,
    only: frozenset[str] | None = None,
    steer: Steer | None = None,
    present: int | None = None,
) -> CanaryScores:
    """White-box scores: for release Y = S + N(0, σ²) the LLR of canary i is <Y − M, c⁺_i − c⁻_i>/σ²,
    summed over releases, with c^± the canary's contribution under each version (recomputed from the
    broadcast and the canary's own data) and M the sum of every canary's midpoint (c⁺+c⁻)/2; the
    canaries' directions need not be orthogonal (their interference is in :class:`CanaryScores`).
    Each contribution is compared in the form it is released in
    (:attr:`~fedpers.experiments.hooks.Canaries.as_released`). ``only``: score just the releases of
    these statistic names (the others are left out of the LLR and the gram alike); ``steer``: each
    round's canaries rebuilt from its published broadcast (what the run was given, see :func:`audit`);
    ``present``: only the first ``present`` canaries are in the run (the rest are empty null slots,
    see :func:`null_scores`), so only theirs enter M."""
    by_round: dict[int, list[tuple[Release, Tensor]]] = {}
    for release, value in published.releases:
        by_round.setdefault(release.round, []).append((release, value))
    k = canaries.count
    llr = torch.zeros(k, dtype=torch.float64)
    gram = torch.zeros(k, k, dtype=torch.float64)
    streams: dict[str, list[tuple[Release, Tensor, Tensor, Tensor]]] = {}
    for r, released in sorted(by_round.items()):
        specs = protocol.stat_specs(r)
        if len(specs) != len(released):
            raise ValueError(f"round {r}: {len(released)} releases for {len(specs)} statistics")
        broadcast = published.broadcasts[r]
        now = canaries if steer is None else steer(r, broadcast)
        contrib = {v: [client_message(protocol, r, broadcast, now.one(i, v)).stats for i in range(k)] for v in "+-"}
        for spec, (release, value) in zip(specs, released):
            if only is not None and spec.name not in only:
                continue
            if release.noise_std <= 0:
                raise ValueError(f"release {release.name!r} has no noise: nothing to audit (epsilon must be finite)")
            if release.mechanism in NODE_SIDE_MECHANISMS:  # compared in the flat form the nodes noised
                plus = torch.stack([_flat(spec, c[spec.name]) for c in contrib["+"]])
                minus = torch.stack([_flat(spec, c[spec.name]) for c in contrib["-"]])
            else:
                plus = torch.stack(
                    [
                        released_part(release, canaries.as_released(spec.name, c[spec.name]).double())
                        for c in contrib["+"]
                    ]
                )
                minus = torch.stack(
                    [
                        released_part(release, canaries.as_released(spec.name, c[spec.name]).double())
                        for c in contrib["-"]
                    ]
                )
            if release.mechanism == "correlated_gaussian":  # scored with the stream's other rounds, below
                streams.setdefault(spec.name, []).append((release, released_part(release, value.double()), plus, minus))
                continue
            diff = plus - minus
            if release.mechanism == "local_gaussian":
                # one canary per node (unit id = node): canary i sees its own node's noisy vector, in which
                # only the canaries of that node (a null slot shares a present canary's id) have data
                ids = canaries.plus["ids"].long()
                mids = torch.zeros_like(value, dtype=torch.float64)
                mids.index_add_(0, ids[:present], ((plus + minus) / 2)[:present])
                centred_rows = value.double()[ids] - mids[ids]
                llr += (diff * centred_rows).sum(1) / release.noise_std**2
                gram += (diff @ diff.T) * (ids[:, None] == ids[None, :]) / release.noise_std**2
                continue
            flat_value = _flat(spec, value.double()) if release.mechanism in NODE_SIDE_MECHANISMS else value.double()
            centred = (
                flat_value if release.mechanism in NODE_SIDE_MECHANISMS else released_part(release, flat_value)
            ) - ((plus + minus) / 2)[:present].sum(0)
            llr += (diff @ centred) / release.noise_std**2
            gram += (diff @ diff.T) / release.noise_std**2
    for name, stream in streams.items():
        stream_llr, stream_gram = _decorrelated_scores(protocol, name, stream, present)
        llr += stream_llr
        gram += stream_gram
    return CanaryScores(llr, gram)


def _decorrelated_scores(
    protocol: Protocol, name: str, stream: list[tuple[Release, Tensor, Tensor, Tensor]], present: int | None
) -> tuple[Tensor, Tensor]:
    """The LLR and gram of a correlated stream (:meth:`~fedpers.privacy.Privatizer.correlated_gaussian_sum`):
    its T releases are Y = X + σ·C⁻¹Z (rounds stacked, Z i.i.d. N(0, 1)), so CY = CX + σZ is the
    Gaussian mechanism on CX with independent noise, and the Neyman–Pearson score of canary i is
    ⟨C(Y − M), C(G⁺_i − G⁻_i)⟩/σ² — the projection of the decorrelated releases on what the canary
    moves CX by across the rounds it takes part in. (The prefix sums AY carry the same information
    but correlated noise: projecting them, or the raw releases, without whitening is not the
    likelihood ratio.) C is the protocol's public strategy, checked against the releases' digest."""
    correlated = getattr(protocol, "correlated", None)
    if correlated is None:
        raise ValueError(f"stream {name!r}: correlated releases from a protocol without a correlated strategy")
    stream = sorted(stream, key=lambda item: int(item[0].params["step"]))
    first = stream[0][0]
    T = int(first.params["horizon"])
    if [int(item[0].params["step"]) for item in stream] != list(range(T)):
        raise ValueError(f"stream {name!r}: the audit scores a whole stream; got steps of {T}")
    if first.params["strategy_digest"] != correlated.strategy.digest():
        raise ValueError(f"stream {name!r}: released with another strategy than the protocol's")
    sigma = float(first.noise_std)
    if sigma <= 0:
        raise ValueError(f"release {first.name!r} has no noise: nothing to audit (epsilon must be finite)")
    C = correlated.strategy.matrix(T).to(torch.float64)
    Y = torch.stack([item[1] for item in stream])  # (T, d)
    plus = torch.stack([item[2] for item in stream])  # (T, K, d)
    minus = torch.stack([item[3] for item in stream])
    centred = C @ (Y - ((plus + minus) / 2)[:, :present].sum(1))
    diff = torch.einsum("ts,skd->tkd", C, plus - minus)
    llr = torch.einsum("tkd,td->k", diff, centred) / sigma**2
    gram = torch.einsum("tkd,tjd->kj", diff, diff) / sigma**2
    return llr, gram


NULL_SLOTS_PER_RUN = 1000
"""At most this many empty canary slots are scored per run (the rest of the design's capacity)."""


def with_null_slots(cans: Canaries, present: int) -> Canaries:
    """``cans`` whose slots from ``present`` on are null slots: they carry the present canaries' ids in
    turn (slot j: id j mod ``present``), so a slot's contributions — computed, never sent — fall in
    the same cohorts and Poisson samples as a present canary's. Only the first ``present`` slots
    enter the run (:func:`present_only`)."""
    ids = cans.plus["ids"]
    if ids.shape[0] == present:
        return cans
    mapped = ids.clone()
    mapped[present:] = ids[torch.arange(present, ids.shape[0]) % present]
    plus, minus = dict(cans.plus), dict(cans.minus)
    plus["ids"], minus["ids"] = mapped, mapped.clone()
    return Canaries(plus, minus, cans.design, cans.as_released)


def present_only(cans: Canaries, present: int) -> Canaries:
    """The first ``present`` canaries of ``cans`` (the run's population)."""
    cut = {k: v[:present] for k, v in cans.plus.items()}, {k: v[:present] for k, v in cans.minus.items()}
    return Canaries(cut[0], cut[1], cans.design, cans.as_released)


def in_role_scores(scored: CanaryScores, included: Tensor) -> Tensor:
    """Each canary's standardised score against the version it does NOT hold: ±standard_i + separation_i/2
    (+ for "+"), i.e. ⟨Y − M₋ᵢ − c_i^other, c_i^held − c_i^other⟩/σ² over √v_i. Under the ledger's
    Gaussian claim it is N(separation_i, 1) whichever version the canary holds, and it would be
    N(0, 1) — the law of an empty slot's score — had the canary held the other one."""
    sign = included.double() * 2 - 1
    return sign * scored.standard + scored.separation / 2


def null_scores(scored: CanaryScores, present: int) -> Tensor:
    """Standardised scores of the empty slots past ``present`` (pure noise: nothing was placed there;
    ``llr`` may carry leading batch dimensions).
    Refused unless every slot is orthogonal to every present canary (then no canary's data reaches
    a slot's score); a slot whose contributions are all zero is left out."""
    gram = scored.gram
    diag = torch.diagonal(gram)
    cross = gram[:present, present:]
    scale = torch.sqrt(diag[:present, None].clamp_min(0) * diag[None, present:].clamp_min(0))
    if bool((cross.abs() > 1e-9 * scale.clamp_min(1e-300)).any()):
        raise ValueError("null slots must be orthogonal to every present canary (no data of theirs reaches a slot)")
    usable = diag[present:] > 0
    return (scored.llr[..., present:] / diag[present:].clamp_min(1e-300).sqrt())[..., usable]


NULL_SCORE_ASSUMPTION = (
    "every release adds zero-mean Gaussian noise of one variance to each of its coordinates whatever the "
    "data (the ledger's Gaussian mechanism), so a canary's score against the version it does not hold has "
    "the law of an empty slot's score; both are Gaussian with one variance"
)


def proven_mu(ledger: Ledger) -> float | None:
    """μ (GDP) the ledger proves for the worst-placed user, when every release is an unsampled Gaussian."""
    groups: list[str | None] = [*ledger.groups()] or [None]
    worst = 0.0
    for g in groups:
        releases = ledger.touching(g) if g is not None else list(ledger)
        zs = accountant_lib.gaussian_multipliers(dp_accounting.ComposedDpEvent([r.event for r in releases]))
        if zs is None:
            return None
        factor = accountant_lib.ledger_neighbours(ledger).sensitivity_factor  # μ = κ/z per release
        worst = max(worst, accountant_lib.gaussian_mu([z / factor for z in zs]))
    return worst


def skellam_gaussian_mu(ledger: Ledger) -> float | None:
    """For a ledger of Skellam releases (distributed DP), the μ of Gaussian releases with the same
    variance and L2 sensitivity, sqrt(Σ Δ₂²/V) for the worst-placed user: the reference a score test
    approaches (Skellam tends to the Gaussian as V grows at fixed Δ₂/√V). Not a proven bound: the proven
    ε is the Skellam RDP bound's, which lies above ε(μ) by the integer term and the RDP conversion."""
    groups: list[str | None] = [*ledger.groups()] or [None]
    worst, any_skellam = 0.0, False
    for g in groups:
        releases = ledger.touching(g) if g is not None else list(ledger)
        total = 0.0
        for r in releases:
            if isinstance(r.event, SkellamDpEvent):
                any_skellam = True
                total += r.event.l2_sensitivity**2 / r.event.variance
        worst = max(worst, total)
    return math.sqrt(worst) if any_skellam else None


def null_slot_bound(in_role: Tensor, nulls: Tensor, confidence: float) -> dict[str, float] | None:
    """The Gaussian-score bound with every canary's in-role score against the empty slots' scores
    (:data:`NULL_SCORE_ASSUMPTION`), and the two samples' standard deviations for a reader to compare."""
    if in_role.numel() < 2 or nulls.numel() < 2:
        return None
    both = torch.cat([in_role, nulls])
    which = torch.cat([torch.ones(in_role.numel(), dtype=torch.bool), torch.zeros(nulls.numel(), dtype=torch.bool)])
    out = audit_math.gaussian_score_mu(both, which, confidence)
    return {**out, "null_scores": int(nulls.numel()), "sd_in": float(in_role.std()), "sd_null": float(nulls.std())}


def gdp_epsilon(mu: float, delta: float) -> float:
    return accountant_lib.analytic_gaussian_epsilon(mu, delta) if mu > 0 else 0.0
