"""Turns a ledger into (ε, δ), and calibrates noise to a target before a run.

User-level guarantee for replace-one neighbours: a unit is touched by the ``all``
releases and by the releases of its own disjoint group (parallel composition across
groups), so ε is the worst case over groups of the composition of what touches it.

PLD (dp-accounting) is the default and is exact for Gaussian composition up to its
discretisation. RDP is available; dp-accounting's RDP accountant ignores
``REPLACE_ONE`` for Gaussian events, so we convert: replace-one with noise
multiplier z is add/remove with z/2 (the sensitivity doubles).

zCDP (Bun & Steinke 2016) is available because papers calibrate with it: a replace-one
Gaussian with noise multiplier z is ρ = 2/z² zCDP (sensitivity 2·bound, σ = z·bound,
ρ = Δ²/2σ²), ρ's add under composition, and ρ-zCDP gives
ε = ρ + 2·sqrt(ρ·log(1/δ)) (their Proposition 1.3), the conversion most papers use.

An :class:`~fedpers.privacy.ledger.EpsilonDeltaDpEvent` (a mechanism known only by a
stated (ε, δ)) composes exactly in PLD; RDP and zCDP cannot represent it, so there its
(ε, δ) is added to the rest by basic composition.
"""
from __future__ import annotations

import contextlib
import contextvars
import enum
import math
from typing import Callable, Iterable, Iterator, Sequence

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld.common import DifferentialPrivacyParameters
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, special, stats

from fedpers.privacy.ledger import EpsilonDeltaDpEvent, Ledger, PureDpEvent

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
PLD_DISCRETISATION = 1e-4
Z_MIN = 0.05


class Accountant(str, enum.Enum):
    PLD = "pld"
    RDP = "rdp"
    ZCDP = "zcdp"


class _NonPrivate(Exception):
    pass


def _pld(event: dp_accounting.DpEvent) -> pld_lib.PrivacyLossDistribution | None:
    """PLD of one event under replace-one neighbours; None for an event that spends nothing."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        if event.noise_multiplier == 0:
            raise _NonPrivate
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=event.noise_multiplier,
            value_discretization_interval=PLD_DISCRETISATION,
            neighboring_relation=REPLACE_ONE,
        )
    if isinstance(event, dp_accounting.PoissonSampledDpEvent) and isinstance(event.event, dp_accounting.GaussianDpEvent):
        # dp-accounting's PLD of the Poisson-subsampled Gaussian under replace-one neighbours
        # (the replaced user is in the sample with probability q, in both datasets alike)
        if event.sampling_probability == 0:
            return None
        if event.event.noise_multiplier == 0:
            raise _NonPrivate
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=event.event.noise_multiplier, value_discretization_interval=PLD_DISCRETISATION,
            sampling_prob=event.sampling_probability, neighboring_relation=REPLACE_ONE,
        )
    if isinstance(event, (PureDpEvent, EpsilonDeltaDpEvent)):
        delta = getattr(event, "delta", 0.0)
        if event.epsilon == 0 and delta == 0:
            return None
        if math.isinf(event.epsilon) or delta >= 1:
            raise _NonPrivate
        return pld_lib.from_privacy_parameters(
            DifferentialPrivacyParameters(event.epsilon, delta), value_discretization_interval=PLD_DISCRETISATION
        )
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return _compose(_pld(e) for e in event.events)
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        one = _pld(event.event)
        return None if one is None else one.self_compose(event.count)
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        raise _NonPrivate
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return None
    raise TypeError(f"the accountant does not support {type(event).__name__}")


def _compose(plds: Iterable[pld_lib.PrivacyLossDistribution | None]) -> pld_lib.PrivacyLossDistribution | None:
    total = None
    for p in plds:
        if p is not None:
            total = p if total is None else total.compose(p)
    return total


def _rdp_event(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """Replace-one event -> the add/remove event with the same privacy loss (for the RDP accountant)."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return dp_accounting.GaussianDpEvent(event.noise_multiplier / 2)
    if isinstance(event, PureDpEvent):
        # ε-DP implies (ε²/2)-zCDP (Bun & Steinke 2016).
        return dp_accounting.ZCDpEvent(event.epsilon**2 / 2)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return dp_accounting.ComposedDpEvent([_rdp_event(e) for e in event.events])
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return dp_accounting.SelfComposedDpEvent(_rdp_event(event.event), event.count)
    return event


def zcdp_rho(event: dp_accounting.DpEvent) -> float:
    """ρ (zCDP) of an event under replace-one neighbours; ∞ for a non-private one."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return math.inf if event.noise_multiplier == 0 else 2.0 / event.noise_multiplier**2
    if isinstance(event, PureDpEvent):
        return event.epsilon**2 / 2  # ε-DP implies (ε²/2)-zCDP (Bun & Steinke 2016, Prop. 1.4)
    if isinstance(event, dp_accounting.ZCDpEvent):
        if event.xi:
            raise TypeError(f"the accountant does not support approximate zCDP (xi={event.xi})")
        return event.rho
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return sum(zcdp_rho(e) for e in event.events)
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return event.count * zcdp_rho(event.event)
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return math.inf
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return 0.0
    raise TypeError(f"zCDP accounting does not support {type(event).__name__}")


def zcdp_epsilon(rho: float, delta: float) -> float:
    """ε of ρ-zCDP at δ by the standard conversion ρ + 2·sqrt(ρ·log(1/δ)) (Bun & Steinke 2016)."""
    _check_delta(delta)
    if math.isinf(rho):
        return math.inf
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def zcdp_rho_for(epsilon: float, delta: float) -> float:
    """The largest ρ whose :func:`zcdp_epsilon` at ``delta`` is ``epsilon``."""
    _check_delta(delta)
    log_term = math.log(1.0 / delta)
    return (math.sqrt(log_term + epsilon) - math.sqrt(log_term)) ** 2


def _split_epsilon_delta(event: dp_accounting.DpEvent) -> tuple[list[dp_accounting.DpEvent], float, float]:
    """(the other events, Σε, Σδ) of the EpsilonDeltaDpEvents inside a composition."""
    if isinstance(event, EpsilonDeltaDpEvent):
        return [], event.epsilon, event.delta
    if isinstance(event, dp_accounting.ComposedDpEvent):
        rest, eps, dlt = [], 0.0, 0.0
        for e in event.events:
            r, a, b = _split_epsilon_delta(e)
            rest, eps, dlt = rest + r, eps + a, dlt + b
        return rest, eps, dlt
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        r, a, b = _split_epsilon_delta(event.event)
        if a == 0 and b == 0:
            return [event], 0.0, 0.0
        return [dp_accounting.SelfComposedDpEvent(x, event.count) for x in r], a * event.count, b * event.count
    return [event], 0.0, 0.0


def event_epsilon(event: dp_accounting.DpEvent, delta: float, accountant: Accountant = Accountant.PLD) -> float:
    """ε at ``delta`` of one (composed) event, replace-one neighbours."""
    _check_delta(delta)
    if accountant is not Accountant.PLD:
        rest, eps_stated, delta_stated = _split_epsilon_delta(event)
        if delta_stated > 0 or eps_stated > 0:
            # Basic composition: the stated (ε, δ) parts add to the rest's ε at the δ left over.
            if delta_stated >= delta:
                return math.inf
            rest_eps = event_epsilon(dp_accounting.ComposedDpEvent(rest), delta - delta_stated, accountant) if rest else 0.0
            return rest_eps + eps_stated
    if accountant is Accountant.ZCDP:
        return zcdp_epsilon(zcdp_rho(event), delta)
    if accountant is Accountant.RDP:
        acc = rdp_privacy_accountant.RdpAccountant(
            neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        )
        acc.compose(_rdp_event(event))
        return float(acc.get_epsilon(delta))
    try:
        total = _pld(event)
    except _NonPrivate:
        return math.inf
    return 0.0 if total is None else float(total.get_epsilon_for_delta(delta))


def ledger_epsilon(ledger: Ledger, delta: float, accountant: Accountant = Accountant.PLD) -> float:
    """Worst-case ε over disjoint groups, for the releases each group's units are touched by."""
    groups = ledger.groups() or [None]
    seen: dict[tuple, float] = {}
    for g in groups:
        releases = ledger.touching(g) if g is not None else list(ledger)
        events = shared_sample_events(releases)
        key = tuple(sorted(repr(e) for e in events))
        if releases and key not in seen:
            seen[key] = event_epsilon(dp_accounting.ComposedDpEvent(events), delta, accountant)
    return max(seen.values(), default=0.0)


def shared_sample_events(releases: list) -> list[dp_accounting.DpEvent]:
    """The releases' events, with those computed on one Poisson sample (the same
    ``params["poisson_sample"]``) merged into one sampled mechanism: their Gaussians compose to
    the Gaussian (Σ z_i⁻²)^(−1/2), sampled once at q. Composing them as independently sampled
    events would not describe what was released."""
    out: list[dp_accounting.DpEvent] = []
    shared: dict[str, list] = {}
    for r in releases:
        sample = r.params.get("poisson_sample") if isinstance(r.params, dict) else None
        if sample is None or not isinstance(r.event, dp_accounting.PoissonSampledDpEvent):
            out.append(r.event)
        else:
            shared.setdefault(str(sample), []).append(r.event)
    for sample, events in shared.items():
        rates = {e.sampling_probability for e in events}
        inner = [e.event for e in events]
        if len(rates) != 1 or not all(isinstance(e, dp_accounting.GaussianDpEvent) for e in inner):
            raise ValueError(f"releases on Poisson sample {sample!r} must share one rate and be Gaussian; got {events}")
        z = sum(e.noise_multiplier ** -2 for e in inner) ** -0.5
        out.append(dp_accounting.PoissonSampledDpEvent(rates.pop(), dp_accounting.GaussianDpEvent(z)))
    return out


def gaussian_multipliers(event: dp_accounting.DpEvent) -> list[float] | None:
    """The noise multipliers of an event made only of Gaussian events, else None."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return [event.noise_multiplier]
    if isinstance(event, dp_accounting.ComposedDpEvent):
        parts = [gaussian_multipliers(e) for e in event.events]
        return None if any(p is None for p in parts) else [z for p in parts for z in p]
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        inner = gaussian_multipliers(event.event)
        return None if inner is None else inner * event.count
    return None


_KNOWN: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("fedpers_known_calibrations", default=None)
_RECORDING: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("fedpers_recorded_calibrations", default=None)


def calibration_key(make_event: Callable[[float], dp_accounting.DpEvent], target_epsilon: float, target_delta: float, accountant: Accountant) -> str:
    """What a calibration depends on: the event's shape (at z = 1 and 2), the target and the accountant."""
    return repr((repr(make_event(1.0)), repr(make_event(2.0)), float(target_epsilon), float(target_delta), Accountant(accountant).value))


@contextlib.contextmanager
def recorded_calibrations() -> Iterator[dict[str, float]]:
    """Collect (key → z) of every calibration made inside (the server, building a protocol)."""
    found: dict[str, float] = {}
    token = _RECORDING.set(found)
    try:
        yield found
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def known_calibrations(known: dict[str, float]) -> Iterator[None]:
    """Inside, a calibration whose key is in ``known`` returns that z without running the
    accountant (a Flower node rebuilding the server's public protocol: the protocol digest
    check still refuses any mismatch)."""
    token = _KNOWN.set(dict(known))
    try:
        yield
    finally:
        _KNOWN.reset(token)


def calibrate_noise_multiplier(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    target_delta: float,
    accountant: Accountant = Accountant.PLD,
) -> float:
    """Smallest noise multiplier z whose event meets (ε, δ); ``make_event(z)`` is what one unit is touched by.

    Returns 0 for ε = ∞ (no noise). The accountant's ε at the result is ≤ the target and
    within 0.1% of it (Gaussian-only events) or within the bisection tolerance.
    """
    known, recording = _KNOWN.get(), _RECORDING.get()
    if known is None and recording is None:
        return _calibrate(make_event, target_epsilon, target_delta, accountant)
    key = calibration_key(make_event, target_epsilon, target_delta, accountant)
    z = known[key] if known is not None and key in known else _calibrate(make_event, target_epsilon, target_delta, accountant)
    if recording is not None:
        recording[key] = z
    return z


def _calibrate(
    make_event: Callable[[float], dp_accounting.DpEvent], target_epsilon: float, target_delta: float, accountant: Accountant,
) -> float:
    _check_delta(target_delta)
    if not target_epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {target_epsilon}")
    if math.isinf(target_epsilon):
        return 0.0

    def eps_at(z: float) -> float:
        return event_epsilon(make_event(z), target_delta, accountant)

    unit = gaussian_multipliers(make_event(1.0))
    if unit is not None and all(z > 0 for z in unit) and accountant is Accountant.ZCDP:
        # Σ 2/(z·u)² = ρ_target in closed form; the loop only guards the floating point.
        z = math.sqrt(sum(2.0 / u**2 for u in unit) / zcdp_rho_for(target_epsilon, target_delta))
        while eps_at(z) > target_epsilon:
            z *= 1.0 + 1e-9
        return z
    if unit is not None and all(z > 0 for z in unit):
        # Gaussian composition is exact in closed form: solve there, then confirm with the accountant.
        z = gaussian_mu([u / 2 for u in unit]) / analytic_gaussian_mu(target_epsilon, target_delta)
        step = 1e-4 if accountant is Accountant.PLD else 1e-2
        while eps_at(z) > target_epsilon:
            z *= 1.0 + step
        return z

    def gap(log_z: float) -> float:
        return eps_at(math.exp(log_z)) - target_epsilon

    # PLD discretisation explodes for tiny noise; below Z_MIN every useful ε is reached anyway.
    lo = hi = 0.0
    while gap(hi) > 0:
        hi += math.log(2.0)
        if hi > math.log(1e7):
            raise ValueError(f"cannot reach epsilon={target_epsilon} at delta={target_delta} with any noise")
    while gap(lo) < 0 and lo > math.log(Z_MIN):
        lo -= math.log(2.0)
    lo = max(lo, math.log(Z_MIN))
    if gap(lo) <= 0:
        return math.exp(lo)
    z = math.exp(optimize.brentq(gap, lo, hi, xtol=1e-4))
    while eps_at(z) > target_epsilon:
        z *= 1.0 + 1e-4
    return z


def gaussian_mu(noise_to_sensitivity: Sequence[float]) -> float:
    """μ of composed Gaussian mechanisms (μ-GDP): sqrt(Σ (Δ/σ)²), given each σ/Δ."""
    return math.sqrt(sum(1.0 / r**2 for r in noise_to_sensitivity))


def analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact ε(δ) of μ-GDP (Balle & Wang 2018; Dong, Roth & Su 2019)."""
    _check_delta(delta)

    def delta_of(eps: float) -> float:
        # e^ε·Φ(·) in log space: e^ε alone overflows past ε ≈ 709.
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps + special.log_ndtr(-eps / mu - mu / 2))

    if delta_of(0.0) <= delta:
        return 0.0
    hi = 1.0
    while delta_of(hi) > delta:
        hi *= 2
    return optimize.brentq(lambda e: delta_of(e) - delta, 0.0, hi, xtol=1e-12)


def analytic_gaussian_mu(epsilon: float, delta: float) -> float:
    """The μ whose μ-GDP guarantee has exactly ε at δ (inverse of :func:`analytic_gaussian_epsilon`)."""
    hi = 1.0
    while analytic_gaussian_epsilon(hi, delta) < epsilon:
        hi *= 2
    return optimize.brentq(lambda m: analytic_gaussian_epsilon(m, delta) - epsilon, 1e-9, hi, xtol=1e-12)


def classical_gaussian_sigma(sensitivity: float, epsilon: float, delta: float) -> float:
    """Δ sqrt(2 ln(1.25/δ))/ε: valid only for ε < 1; reported only as a paper's calibration."""
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
