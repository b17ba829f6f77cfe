"""`fedpers audit ALGO`: an empirical lower bound on a run's ε, from canary users scored on its releases.

K canary users, each holding one of two data sets (a "+" and a "−" version: a replace-one
neighbour pair) chosen by a fair coin the auditor keeps, make up the population of a run of
the real protocol through the real server path (:func:`fedpers.runtime.driver.drive`, the
local runtime's round loop) and the real :class:`~fedpers.privacy.Privatizer`. What the
server published — every round's broadcast and every release's noisy value with its
ledger record — is all the scorer receives (:class:`Published`): never a summed statistic
before noise. For each canary and release the scorer computes, from the broadcast and the
canary's two candidate data sets, what the canary adds to the sum under each version, and
scores the log-likelihood ratio of "+" against "−" (the Neyman–Pearson test for a Gaussian
release). Guesses from the scores give three lower bounds (:mod:`fedpers.privacy.audit`):

- ``epsilon_lower``: ε at δ, valid for any mechanism, one run (Steinke, Nasr & Jagielski 2023);
- ``one_run_gdp``: μ (then ε at δ) that the guesses reject for a μ-GDP claim, one run
  (Mahloujifar, Melis & Chaudhuri 2024);
- ``independent_gdp``: μ from Clopper–Pearson bounds on TPR/FPR with the canaries as
  independent trials (exact across runs; within a run, under the ledger's own claim).

Canaries are the strongest the protocol allows: every statistic a canary sends sits at its
clip bound, each canary along its own coordinate so the scores do not interfere. The audit
tests the replace-one user relation the accountant proves (the two versions are the same
user with different data). See docs/audit.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import dp_accounting
import torch

from fedpers.data.units import UnitSource
from fedpers.experiments.base import Experiment, derived_seed
from fedpers.privacy import Ledger, Privatizer, Release, ledger_epsilon
from fedpers.privacy import accountant as accountant_lib
from fedpers.privacy import audit as audit_math
from fedpers.protocols.base import Protocol, client_message
from fedpers.runtime.driver import ClientReply, drive

Tensor = torch.Tensor
BIG = 1e6
"""How far past the model clip a canary's features lie (the clip binds for any v_j not ~0)."""
LABEL_OVERSHOOT = 1.5
"""A canary's labels are this many times the label clip ζ: the clip binds, and were it missing,
the canaries' sum would still pass the server's norm check (√K·1.5²·bound ≤ K·bound for K ≥ 6)
so the missing clip shows in the audit instead of aborting the run."""


# ----- what the server publishes ----------------------------------------------------------
@dataclass(frozen=True)
class Published:
    """Everything a run made public: the broadcast of every round, and every noisy release with
    its ledger record (σ, bound, round). Nothing else reaches the scorer."""

    broadcasts: tuple[dict[str, Tensor], ...]
    releases: tuple[tuple[Release, Tensor], ...]


class PublishingPrivatizer(Privatizer):
    """A Privatizer that keeps a copy of each value it releases (after noise), as an observer of
    the server's output would see it. The noise itself is the parent's, unchanged."""

    def __init__(self, seed: int, ledger: Ledger | None = None) -> None:
        super().__init__(seed, ledger)
        self.published: list[tuple[Release, Tensor]] = []

    def gaussian_sum(self, value: Tensor, **kwargs: Any) -> Tensor:
        out = super().gaussian_sum(value, **kwargs)
        self.published.append((self.ledger.releases[-1], out.detach().clone()))
        return out

    def symmetric_gaussian_sum(self, value: Tensor, **kwargs: Any) -> Tensor:
        out = super().symmetric_gaussian_sum(value, **kwargs)
        self.published.append((self.ledger.releases[-1], out.detach().clone()))
        return out


# ----- canaries -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Canaries:
    """K canary users: unit tensors of both versions (leading dimension K) and how they were built."""

    plus: dict[str, Tensor]
    minus: dict[str, Tensor]
    design: str

    @property
    def count(self) -> int:
        return int(self.plus["ids"].shape[0])

    def units(self, included: Tensor) -> dict[str, Tensor]:
        """The run's population: canary i holds its "+" data where ``included[i]``, else its "−" data."""
        out = {}
        for key, p in self.plus.items():
            mask = included.reshape(-1, *([1] * (p.dim() - 1))).to(p.device)
            out[key] = torch.where(mask, p, self.minus[key]) if key != "ids" else p
        return out

    def one(self, i: int, version: str) -> dict[str, Tensor]:
        src = self.plus if version == "+" else self.minus
        return {k: v[i : i + 1] for k, v in src.items()}


@dataclass(frozen=True)
class CanaryDesign:
    """How to audit one algorithm: its protocol for a population of K canaries, the most
    canaries with mutually orthogonal contributions, and the canaries themselves."""

    protocol: Callable[[Any, int], Protocol]
    capacity: Callable[[Any], int]
    canaries: Callable[[Any, torch.Generator, int], Canaries]
    releases: str
    neighbouring: str


def _altmin_protocol(cfg: Any, k: int) -> Protocol:
    from fedpers.experiments.altmin import make_protocol

    if cfg.data is not None:
        raise ValueError("data: the audit's population is its canaries; drop --data")
    return make_protocol(replace(cfg, n_users=k, chunk_size=max(k, 1)))


def _altmin_canaries(protocol: Any, generator: torch.Generator, count: int) -> Canaries:
    """Canary i lives on coordinate e_i of R^d. Q1: fixed Gaussian samples (so v_i is generic);
    Q2: x = BIG·e_i and y = ±1.5ζ, so every w_ij sits at the model clip η along v̂_i ⊗ e_i and
    every label at ±ζ: b_i = ±|Q2|ηζ (v̂_i ⊗ e_i), the "+"/"−" versions differ by 2·bound (its
    full replace-one sensitivity), while A_i (PSD, sign-blind) is the same in both; second half:
    x = e_i and the pair's labels (+1.5ζ, ±1.5ζ), so W_i = ±(m/4)ζ² e_i e_iᵀ, again 2·bound apart."""
    p = protocol
    d, m, q, k = p.dim, p.samples_per_user, p.quarter, count
    dtype = p.dtype
    x = torch.zeros(k, m, d, dtype=torch.float64)
    y = torch.zeros(k, m, dtype=torch.float64)
    x[:, :q] = torch.randn(k, q, d, generator=generator, dtype=torch.float64)
    y[:, :q] = (x[:, :q] @ torch.randn(k, d, 1, generator=generator, dtype=torch.float64)).squeeze(-1)
    eye = torch.eye(d, dtype=torch.float64)[:k]
    x[:, q : 2 * q] = BIG * eye[:, None, :]
    x[:, 2 * q :] = eye[:, None, :]
    label = LABEL_OVERSHOOT * p.zeta
    y[:, q:] = label
    y_minus = y.clone()
    y_minus[:, q : 2 * q] = -label
    y_minus[:, 2 * q + 1 :: 2] = -label  # the second of each init pair
    ids = torch.arange(k)
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y.to(dtype)},
        {"ids": ids, "x": x.to(dtype), "y": y_minus.to(dtype)},
        "coordinate e_i per canary; b and W at ± their clip bound (2·bound apart), A equal in both versions",
    )


def _noisyhead_protocol(cfg: Any, k: int) -> Protocol:
    """The configured protocol (its N, C, G, R and noise) in rounds mode: each step's gradient is a
    release the auditor sees, and statistics mode releases the same Γ̂ for the same noise."""
    from fedpers.experiments.noisyhead import Mode, make_protocol

    if cfg.unit.value != "prompt" or cfg.sampling_rate != 1.0:
        raise ValueError(
            "unit/sampling_rate: the noisyhead audit has prompt-level, unsampled canaries; use --unit prompt without --sampling-rate"
        )
    return make_protocol(cfg, mode=Mode.ROUNDS)


def _noisyhead_canaries(protocol: Any, generator: torch.Generator, k: int) -> Canaries:
    """Canary i on the coordinate (a, b) = divmod(i, D) of Γ: context tokens e_b with labels 1.5C,
    query e_a, so Z̃_i = G·e_a e_bᵀ (projection binds); the query label is ±1.5C (ỹ = ±C). Each
    step's gradient (<Γ, Z̃> − ỹ) Z̃ then differs by 2CG between the versions, of the bound's
    2G(C + RG): the <Γ, Z̃> part is the same in both (the data cannot know Γ in advance)."""
    p = protocol
    D, L = p.dim, p.context
    x = torch.zeros(k, 1, L + 1, D, dtype=torch.float64)
    y = torch.full((k, 1, L + 1), LABEL_OVERSHOOT * p.clip_c, dtype=torch.float64)
    idx = torch.arange(k)
    a, b = idx // D, idx % D
    eye = torch.eye(D, dtype=torch.float64)
    x[:, 0, :L] = eye[b][:, None, :]
    x[:, 0, L] = eye[a]
    y_minus = y.clone()
    y_minus[:, 0, L] = -LABEL_OVERSHOOT * p.clip_c
    dtype = p.dtype
    return Canaries(
        {"ids": idx, "x": x.to(dtype), "y": y.to(dtype)},
        {"ids": idx, "x": x.to(dtype), "y": y_minus.to(dtype)},
        "coordinate (a, b) of Γ per canary; Z̃ at its projection radius G, query label ±C",
    )


FEDREP_LABEL = 1e3
"""FedRep canaries' labels are this many times ζ: G_j grows as the labels squared, so the clip C binds in
every round whatever U is (at 1.5ζ it did not always). The init's label clip is then checked by the server's
norm check (a missing clip aborts the run) rather than by the audit."""


def _fedrep_protocol(cfg: Any, k: int) -> Protocol:
    from fedpers.experiments.fedrep import make_protocol

    return make_protocol(replace(cfg, n_users=k, chunk_size=max(k, 1)))


def _fedrep_layout(p: Any) -> tuple[int, int]:
    """(j, width): j init pairs on their own extra coordinates, width = k + 1 coordinates per canary."""
    odd = p.samples_per_user % 2
    j = p.rank - odd
    if p.pairs - j < 1:
        raise ValueError(
            f"samples_per_user: the fedrep audit needs m >= {2 * p.rank + 1} for rank {p.rank} (k + 1 feature directions per canary); got {p.samples_per_user}"
        )
    return j, p.rank + 1


def fedrep_init_fraction(p: Any) -> float:
    """||W⁺ − W⁻||/(2·bound) of a FedRep canary: sqrt((p − j)² + j)/p (p pairs, j of them off e_c0)."""
    j, _ = _fedrep_layout(p)
    return math.sqrt((p.pairs - j) ** 2 + j) / p.pairs


def _fedrep_canaries(protocol: Any, generator: torch.Generator, count: int) -> Canaries:
    """Canary i owns the k + 1 coordinates c_0..c_k of block i of R^d (fewer would make every G_j = 0:
    the least-squares residual is orthogonal to U, so g_j needs k + 1 feature directions). Pairs: the
    first p − j on e_c0, then one pair on each of e_c1..e_cj (j = k, or k − 1 when m is odd and the last,
    unpaired sample sits on e_ck). "+": every label Lζ; "−": each pair's labels (Lζ, −Lζ), the
    unpaired one 0. Init: W = ±ζ²(Σ_pairs e e ᵀ), a fraction sqrt((p − j)² + j)/p of the 2·bound
    sensitivity. Rounds: "−" has Σ_c-group labels 0, so v_j = 0 and G_j = 0; "+" has G_j at the clip C
    (C of the 2C sensitivity): the sign-symmetric worst case needs U, which fixed data cannot know."""
    p = protocol
    j, width = _fedrep_layout(p)
    m, d = p.samples_per_user, p.dim
    coord = torch.zeros(m, dtype=torch.long)
    for pair in range(p.pairs):
        coord[2 * pair : 2 * pair + 2] = max(0, pair - (p.pairs - j) + 1)
    if m % 2:
        coord[-1] = p.rank
    eye = torch.eye(d, dtype=torch.float64)
    base = torch.arange(count)[:, None] * width
    x = eye[base + coord[None, :]]  # (count, m, d)
    label = FEDREP_LABEL * p.zeta
    y = torch.full((count, m), label, dtype=torch.float64)
    y_minus = y.clone()
    y_minus[:, 1 : 2 * p.pairs : 2] = -label
    if m % 2:
        y_minus[:, -1] = 0.0
    ids = torch.arange(count)
    dtype = p.dtype
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y.to(dtype)},
        {"ids": ids, "x": x.to(dtype), "y": y_minus.to(dtype)},
        f'k + 1 coordinates per canary; init W at {fedrep_init_fraction(p):.3f} of its sensitivity, G at the clip C in "+", 0 in "−"',
    )


def _noisygd_protocol(cfg: Any, k: int) -> Protocol:
    from fedpers.experiments.noisygd import Remedy, make_protocol

    if cfg.remedy is Remedy.PCA:
        raise ValueError(
            "remedy: the noisygd audit's canaries sit on feature coordinates, which the PCA projection mixes; use --remedy none or center"
        )
    return make_protocol(replace(cfg, examples=k, chunk_size=max(k, 1)))


def _noisygd_canaries(protocol: Any, generator: torch.Generator, count: int) -> Canaries:
    """Canary example i: feature ±s·e_i ("+"/"−"), label i mod K, s = 1.5·G_c/sqrt(1 − 1/K) so the
    gradient clip binds at W = 0 (||r|| = sqrt(1 − 1/K) for cross-entropy, 1 for squared loss).
    At step 1 (W = 0) the residual r is the same in both versions, so the clipped gradients are
    ±G_c r̂ e_iᵀ: 2G_c apart, the full replace-one sensitivity. Later steps: r(±W x) differs a
    little as W moves (lr·noise small: near-full). The centring remedy's feature sum sees ±R e_i
    (clip R binds): full sensitivity too."""
    p = protocol
    if count > p.feature_dim:
        raise ValueError(f"canaries must be <= feature_dim={p.feature_dim}; got {count}")
    scale = LABEL_OVERSHOOT * p.grad_clip / math.sqrt(1.0 - 1.0 / p.classes)
    if p.remedy.value == "center":
        scale = max(scale, LABEL_OVERSHOOT * p.feature_bound)
    x = scale * torch.eye(p.feature_dim, dtype=torch.float64)[:count]
    ids = torch.arange(count)
    y = ids % p.classes
    dtype = p.dtype
    return Canaries(
        {"ids": ids, "x": x.to(dtype), "y": y},
        {"ids": ids, "x": (-x).to(dtype), "y": y},
        "feature ±s·e_i per canary example; clipped gradient ±G_c r̂ e_iᵀ (2G_c apart at W = 0)",
    )


def _dpals_protocol(cfg: Any, k: int) -> Protocol:
    from fedpers.experiments.dpals import make_protocol, prelude

    if cfg.ratings is not None or cfg.dataset:
        raise ValueError(
            "ratings/dataset: the audit's population is its canaries (synthetic items); drop --ratings/--dataset"
        )
    if prelude(cfg):
        raise ValueError(
            "private_center/head_items: the dpals audit has no canary design for round 0's sums and counts yet; drop them"
        )
    return make_protocol(replace(cfg, n_users=k, chunk_size=max(k, 1)))


def _dpals_canaries(protocol: Any, generator: torch.Generator, count: int) -> Canaries:
    """Canary i rates one item: item 2i ("+") or item 2i + 1 ("−"), rating BIG. With one rating
    v̂ = ±Û_item, so G_item = Γ_G v̂v̂ᵀ and b_item = Γ_b Û_item (both clips bind; the sign of the
    rating cancels in r·v): the versions' contributions sit on different items, √2·Γ apart, the
    most two one-rating users can be (G is PSD, b ∝ r²·U_item, so no rating flips them).
    G is released as block upper triangles: a block's share (1 + Σ v̂⁴)/2 of Γ_G² shows."""
    p = protocol
    if 2 * count > p.n_items:
        raise ValueError(f"canaries must be <= n_items/2 = {p.n_items // 2}; got {count}")
    ids = torch.arange(count)
    ratings = torch.full((count, 1), BIG, dtype=torch.float64).to(p.dtype)
    mask = torch.ones(count, 1, dtype=torch.bool)
    plus = {"ids": ids, "items": (2 * ids)[:, None], "ratings": ratings, "mask": mask}
    minus = {"ids": ids, "items": (2 * ids + 1)[:, None], "ratings": ratings, "mask": mask}
    return Canaries(
        plus, minus, 'one rating per canary user, on item 2i ("+") or 2i + 1 ("−"): G and b at their clips, √2·Γ apart'
    )


DESIGNS: dict[str, CanaryDesign] = {
    "altmin": CanaryDesign(
        _altmin_protocol,
        lambda p: p.dim,
        _altmin_canaries,
        "init W, and every round's A and b",
        "replace-one user (a canary's two versions are the same user with different data)",
    ),
    "noisyhead": CanaryDesign(
        _noisyhead_protocol,
        lambda p: p.dim**2,
        _noisyhead_canaries,
        "every step's noisy gradient (rounds mode; statistics mode releases the same Γ̂ law)",
        "replace-one prompt (a canary's two versions are the same prompt with a different query label)",
    ),
    "fedrep": CanaryDesign(
        _fedrep_protocol,
        lambda p: p.dim // (p.rank + 1),
        _fedrep_canaries,
        "init W, and every round's G",
        "replace-one user (a canary's two versions are the same user with different labels)",
    ),
    "noisygd": CanaryDesign(
        _noisygd_protocol,
        lambda p: p.feature_dim,
        _noisygd_canaries,
        "every step's noisy clipped-gradient sum (and the centring remedy's feature sum)",
        "replace-one example (a canary's two versions are the same example with its feature negated)",
    ),
    "dpals": CanaryDesign(
        _dpals_protocol,
        lambda p: p.n_items // 2,
        _dpals_canaries,
        "every round's G (block upper triangles) and b",
        "replace-one user (a canary's two versions are the same user rating a different item)",
    ),
}


# ----- one run, and the scorer --------------------------------------------------------------
def run_published(
    protocol: Protocol, units: Mapping[str, Tensor], privatizer: PublishingPrivatizer
) -> tuple[Published, Ledger]:
    """Run ``protocol`` on ``units`` through the shared server loop; return only what it published."""
    source = UnitSource.of(units)
    broadcasts: list[dict[str, Tensor]] = []

    def gather(round: int, broadcast: Mapping[str, Tensor]) -> list[ClientReply]:
        broadcasts.append({k: v.detach().clone() for k, v in broadcast.items()})
        message = client_message(protocol, round, broadcast, source.slice(0, source.num_units))
        return [ClientReply("local", source.num_units, message)]

    drive(protocol, gather, privatizer, progress=False)
    return Published(tuple(broadcasts), tuple(privatizer.published)), privatizer.ledger


def _as_released(protocol: Protocol, name: str, stat: Tensor) -> Tensor:
    """A client's statistic in the form the server releases it (DPALS releases G's block upper triangles)."""
    if protocol.name == "dpals" and name == "G" and stat.dim() == 3:  # full blocks (messages carry the triangles)
        from fedpers.protocols.dpals import triu_pack

        return triu_pack(stat)
    return stat


def _released_part(release: Release, value: Tensor) -> Tensor:
    """The coordinates that carry independent noise: the upper triangle of a symmetric release."""
    if release.mechanism == "symmetric_gaussian":
        rows, cols = torch.triu_indices(value.shape[0], value.shape[1])
        return value[rows, cols]
    return value.flatten()


def score_canaries(protocol: Protocol, published: Published, canaries: Canaries) -> tuple[Tensor, Tensor]:
    """Log-likelihood ratio of "+" vs "−" for every canary, from the published outputs only.

    For release Y = S + N(0, σ²) the LLR of canary i is <Y − M, c⁺_i − c⁻_i>/σ², summed over
    releases, with c^± the canary's contribution under each version (recomputed from the
    broadcast and the canary's own data) and M the sum of every canary's midpoint (c⁺+c⁻)/2.
    Also returns each canary's separation μ_i = sqrt(Σ ||c⁺_i − c⁻_i||²/σ²): under the ledger's
    claim, LLR_i/μ_i ~ N(±μ_i/2, 1).
    """
    by_round: dict[int, list[tuple[Release, Tensor]]] = {}
    for release, value in published.releases:
        by_round.setdefault(release.round, []).append((release, value))
    k = canaries.count
    llr = torch.zeros(k, dtype=torch.float64)
    sep2 = torch.zeros(k, dtype=torch.float64)
    for r, released in sorted(by_round.items()):
        specs = protocol.stat_specs(r)
        if len(specs) != len(released):
            raise ValueError(f"round {r}: {len(released)} releases for {len(specs)} statistics")
        broadcast = published.broadcasts[r]
        contrib = {
            v: [client_message(protocol, r, broadcast, canaries.one(i, v)).stats for i in range(k)] for v in "+-"
        }
        for spec, (release, value) in zip(specs, released):
            if release.noise_std <= 0:
                raise ValueError(f"release {release.name!r} has no noise: nothing to audit (epsilon must be finite)")
            plus = torch.stack(
                [
                    _released_part(release, _as_released(protocol, spec.name, c[spec.name]).double())
                    for c in contrib["+"]
                ]
            )
            minus = torch.stack(
                [
                    _released_part(release, _as_released(protocol, spec.name, c[spec.name]).double())
                    for c in contrib["-"]
                ]
            )
            centred = _released_part(release, value.double()) - ((plus + minus) / 2).sum(0)
            diff = plus - minus
            llr += (diff @ centred) / release.noise_std**2
            sep2 += (diff**2).sum(1) / release.noise_std**2
    return llr, sep2.sqrt()


def proven_mu(ledger: Ledger) -> float | None:
    """μ (GDP) the ledger proves for the worst-placed user, when every release is an unsampled Gaussian."""
    groups: list[str | None] = [*ledger.groups()] or [None]
    worst = 0.0
    for g in groups:
        releases = ledger.touching(g) if g is not None else list(ledger)
        zs = accountant_lib.gaussian_multipliers(dp_accounting.ComposedDpEvent([r.event for r in releases]))
        if zs is None:
            return None
        worst = max(worst, accountant_lib.gaussian_mu([z / 2 for z in zs]))
    return worst


def audit(
    exp: Experiment,
    cfg: Any,
    canaries: int,
    runs: int = 1,
    confidence: float = 0.95,
    seed: int = 0,
    privatizer_factory: Callable[[int], PublishingPrivatizer] = PublishingPrivatizer,
) -> dict[str, Any]:
    """``runs`` independent runs of ``exp`` on ``canaries`` canaries each; lower bounds beside the proven ε."""
    if exp.name not in DESIGNS:
        raise ValueError(f"algorithm: the audit has canaries for {', '.join(DESIGNS)}; got {exp.name}")
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if not 0.5 < confidence < 1:
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence}")
    design = DESIGNS[exp.name]
    if math.isinf(getattr(cfg, "epsilon", 0.0)):
        raise ValueError("epsilon must be finite: a run without noise has no guarantee to audit")
    protocol = design.protocol(cfg, canaries)
    capacity = design.capacity(protocol)
    if not 2 <= canaries <= capacity:
        raise ValueError(
            f"canaries must be in [2, {capacity}] for {exp.name} with these flags (one orthogonal direction each); got {canaries}"
        )
    delta = float(cfg.delta)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # K tiny users: one thread is several times faster than a contended pool
    try:
        return _audit_runs(exp, cfg, design, protocol, canaries, runs, confidence, seed, delta, privatizer_factory)
    finally:
        torch.set_num_threads(threads)


def _audit_runs(
    exp: Experiment,
    cfg: Any,
    design: CanaryDesign,
    protocol: Protocol,
    canaries: int,
    runs: int,
    confidence: float,
    seed: int,
    delta: float,
    privatizer_factory: Callable[[int], PublishingPrivatizer],
) -> dict[str, Any]:
    coins = torch.Generator().manual_seed(derived_seed(seed, "audit-coins"))
    data = torch.Generator().manual_seed(derived_seed(seed, "audit-canaries"))
    scores, seps, truth = [], [], []
    ledger = Ledger()
    for run in range(runs):
        cans = design.canaries(protocol, data, canaries)
        included = torch.rand(canaries, generator=coins) < 0.5
        privatizer = privatizer_factory(derived_seed(seed, f"audit-noise-{run}"))
        published, ledger = run_published(protocol, cans.units(included), privatizer)
        llr, sep = score_canaries(protocol, published, cans)
        scores.append(llr)
        seps.append(sep)
        truth.append(included)
    llr, sep, included = torch.cat(scores), torch.cat(seps), torch.cat(truth)
    accountant = getattr(cfg, "accountant", accountant_lib.Accountant.PLD)
    proven = ledger_epsilon(ledger, delta, accountant)
    mu_proven = proven_mu(ledger)
    standard = llr / sep.clamp_min(1e-300)
    snj = audit_math.one_run_lower_bound(llr, included, delta, confidence)
    gdp_one = audit_math.one_run_gdp_lower_bound(llr, included, delta, confidence)
    mu_ind = audit_math.independent_gdp_lower_bound(standard, included, confidence)
    return {
        "algorithm": exp.name,
        "neighbouring": design.neighbouring,
        "releases_tested": design.releases,
        "canary_design": cans.design,
        "canaries_per_run": canaries,
        "runs": runs,
        "confidence": confidence,
        "delta": delta,
        "proven_epsilon": proven,
        "proven_mu": mu_proven,
        "canary_mu": float(sep.mean()),
        "epsilon_lower": snj["epsilon_lower"],
        "one_run": snj,
        "one_run_gdp": gdp_one,
        "independent_gdp": {
            "mu_lower": mu_ind,
            "epsilon_lower": accountant_lib.analytic_gaussian_epsilon(mu_ind, delta) if mu_ind > 0 else 0.0,
        },
        "noise_multiplier": float(getattr(protocol, "noise_multiplier", float("nan"))),
    }


def format_audit(result: Mapping[str, Any]) -> str:
    """A short report: proven ε beside each empirical lower bound, and what was tested."""
    mu = result["proven_mu"]
    one, gdp, ind = result["one_run"], result["one_run_gdp"], result["independent_gdp"]
    proven = f"  proven ε = {result['proven_epsilon']:.4g}" + (f" (μ-GDP, μ = {mu:.4g})" if mu is not None else "")
    lines = [
        f"audit of {result['algorithm']}: {result['runs']} run(s) × {result['canaries_per_run']} canaries, "
        f"confidence {result['confidence']}, δ = {result['delta']:.3g}",
        f"  neighbours: {result['neighbouring']}",
        f"  releases tested: {result['releases_tested']}",
        f"  canaries: {result['canary_design']} (separation μ = {result['canary_mu']:.3f})",
        proven,
        f"  empirical ε lower bound, any mechanism (Steinke et al. 2023): {result['epsilon_lower']:.4g}  [{one['correct']}/{one['guesses']} guesses right]",
        f"  μ-GDP claim rejected up to μ = {gdp['mu_lower']:.4g} (one run, Mahloujifar et al. 2024): ε ≥ {gdp['epsilon_lower']:.4g}",
        f"  μ lower bound, canaries as independent trials (Clopper–Pearson): {ind['mu_lower']:.4g}: ε ≥ {ind['epsilon_lower']:.4g}",
    ]
    return "\n".join(lines)
