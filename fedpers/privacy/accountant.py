"""Turns a ledger into (ε, δ), and calibrates noise to a target before a run.

User-level guarantee: a unit is touched by the ``all`` releases and by the releases of its own
disjoint group (parallel composition across groups), so ε is the worst case over groups of the
composition of what touches it. Every guarantee is for a declared neighbouring relation
(:class:`~fedpers.config.Neighbours`): replace-one (the default, the papers' notion) or add-remove
(what the peers report). A ledger names its relation in each release; an accountant accounts the
relations it declares (``relations``, ``poisson_relations``) and refuses the others.

Each accountant is dp-accounting's wherever it computes the same thing:

- **pld** (default): dp-accounting's ``PLDAccountant`` under replace-one neighbours, exact for
  Gaussian composition (Poisson-sampled included) up to its discretisation. A
  :class:`~fedpers.privacy.ledger.PureDpEvent` (ε-DP) and an
  :class:`~fedpers.privacy.ledger.EpsilonDeltaDpEvent` (a mechanism known only by a stated
  (ε, δ)) have no library event: :class:`_PLDAccountant` adds them, from the library's PLD
  constructors.
- **rdp**: dp-accounting's ``RdpAccountant``. Its Gaussian ignores ``REPLACE_ONE``, so we
  convert: replace-one with noise multiplier z is add/remove with z/2 (the sensitivity
  doubles). Its Poisson sampling is add/remove only: a Poisson-sampled release is refused under
  replace-one and accounted under add-remove.
- **zcdp** (Bun & Steinke 2016), because papers calibrate with it: a replace-one Gaussian with
  noise multiplier z is ρ = 2/z² zCDP (sensitivity 2·bound, σ = z·bound, ρ = Δ²/2σ²; add-remove:
  ρ = 1/(2z²)), ρ's add
  under composition, and ρ-zCDP gives ε = ρ + 2·sqrt(ρ·log(1/δ)) (their Proposition 1.3).
  dp-accounting has no zCDP accountant (its RDP accountant takes ``ZCDpEvent`` but converts
  with RDP's tighter bound, not the papers'), so this one is hand-written. zCDP has no
  amplification by Poisson sampling: a Poisson-sampled release is refused.

RDP and zCDP cannot represent an ``EpsilonDeltaDpEvent``; there its (ε, δ) is added to the
rest by basic composition. An event an accountant cannot account is refused with
:class:`UnsupportedEvent` (a ValueError naming the accountant, the event and what to use).

Each accountant is one :class:`PrivacyAccountant` subclass registered by
:func:`register_accountant` in :data:`ACCOUNTANTS`, declaring what it can account
(``relations``, ``poisson_relations``, ``stated_events``) and how calibration solves with it; everything that
offers a choice of accountant (the CLI's ``--accountant``, the configs' ``accountant`` field)
lists the registry. :class:`Accountant` names the built-in ones.
"""

from __future__ import annotations

import abc
import hashlib
import inspect
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld.common import DifferentialPrivacyParameters
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, special, stats

from fedpers.config import Neighbours, neighbours_of
from fedpers.configs.privacy import (
    CAPABILITIES,
    Accountant,
    accountant_name,
    check_relation,
    declare_accountant,
    forget_accountant,
)
from fedpers.privacy import calibration_cache, mmcc, skellam
from fedpers.privacy.ledger import EpsilonDeltaDpEvent, Ledger, PureDpEvent, Release, SkellamDpEvent

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
ADD_OR_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
RELATIONS = {Neighbours.REPLACE_ONE: REPLACE_ONE, Neighbours.ADD_REMOVE: ADD_OR_REMOVE}
"""Each declared neighbouring relation as dp-accounting's ``NeighboringRelation``."""
PLD_DISCRETISATION = 1e-4
COARSE_DISCRETISATION = 1e-3
"""The PLD grid a calibration first solves on (about 10× faster for Poisson-sampled events,
whose ε agrees with :data:`PLD_DISCRETISATION`'s to ~1e-6 relative); the result is then checked,
and if need be re-solved, at :data:`PLD_DISCRETISATION`."""
Z_MIN = 0.05
CALIBRATION_STEPS = 2000
"""The most steps of :attr:`PrivacyAccountant.calibration_step` calibration takes from the
closed-form z: beyond them the accountant's ε cannot meet the target (PLD's discretisation, at
ε near its grid) and the target is refused instead of raised for minutes."""


class UnsupportedEvent(ValueError):
    """An accountant cannot account this kind of event (refused, never approximated)."""

    def __init__(self, accountant: Accountant | str, event: dp_accounting.DpEvent, why: str) -> None:
        self.accountant, self.event = accountant_name(accountant), event
        super().__init__(f"the {self.accountant} accountant cannot account {_kind(event)}: {why}")


def _kind(event: dp_accounting.DpEvent) -> str:
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        return f"a Poisson-sampled {type(event.event).__name__} (q = {event.sampling_probability:g})"
    return f"a {type(event).__name__}"


POISSON_REFUSAL = "it has no amplification-by-sampling bound; use --accountant pld"


def _map_leaves(
    event: dp_accounting.DpEvent, leaf: Callable[[dp_accounting.DpEvent], dp_accounting.DpEvent]
) -> dp_accounting.DpEvent:
    """``event`` with every mechanism (not a composition) replaced by ``leaf(mechanism)``."""
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return dp_accounting.ComposedDpEvent([_map_leaves(e, leaf) for e in event.events])
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return dp_accounting.SelfComposedDpEvent(_map_leaves(event.event, leaf), event.count)
    return leaf(event)


class _PLDAccountant(pld_privacy_accountant.PLDAccountant):
    """dp-accounting's PLD accountant plus the two events the library has none for.

    - :class:`PureDpEvent`: ε-DP is exactly the randomized response on two buckets keeping the
      input with e^ε : 1 odds (the worst ε-DP pair); its PLD is the library's
      ``from_randomized_response``. The library's own ``RandomizedResponseDpEvent`` is not used:
      dp-accounting 0.6.0's PLD accountant drops the count of a ``SelfComposedDpEvent`` around it
      (k draws would be accounted as one).
    - :class:`EpsilonDeltaDpEvent`: the worst-case PLD of an (ε, δ)-DP mechanism (tight for that
      guarantee), the library's ``from_privacy_parameters``.

    This extends the library's own dispatch (``_maybe_compose``) and state; tests pin it to the
    library (tests/test_accountant_library.py).
    """

    def __init__(
        self, discretisation: float = PLD_DISCRETISATION, neighbours: Neighbours = Neighbours.REPLACE_ONE
    ) -> None:
        super().__init__(RELATIONS[neighbours], value_discretization_interval=discretisation)
        self.discretisation = discretisation
        self.relation = RELATIONS[neighbours]

    def compose_pld(self, pld: pld_lib.PrivacyLossDistribution) -> None:
        """Compose a PLD built elsewhere (MMCC's rounds, :mod:`fedpers.privacy.mmcc`) into the state."""
        self._pld: pld_lib.PrivacyLossDistribution = self._pld.compose(pld)

    def _maybe_compose(self, event: dp_accounting.DpEvent, count: int, do_compose: bool) -> Any:
        if not isinstance(event, (PureDpEvent, EpsilonDeltaDpEvent)):
            return super()._maybe_compose(event, count, do_compose)
        delta = event.delta if isinstance(event, EpsilonDeltaDpEvent) else 0.0
        if not do_compose or (event.epsilon == 0 and delta == 0):
            return None
        if math.isinf(event.epsilon) or delta >= 1:
            self._contains_non_dp_event = True
            return None
        keep_odds = 2.0 / (1.0 + math.exp(event.epsilon)) if event.epsilon < 700 else 0.0  # e^ε overflows past ~709
        if delta == 0 and keep_odds > 0:
            one = pld_lib.from_randomized_response(
                noise_parameter=keep_odds,
                num_buckets=2,
                value_discretization_interval=self.discretisation,
                neighboring_relation=self.relation,
            )
        else:
            one = pld_lib.from_privacy_parameters(
                DifferentialPrivacyParameters(event.epsilon, delta), value_discretization_interval=self.discretisation
            )
        self._pld = self._pld.compose(one.self_compose(count) if count > 1 else one)
        return None


def _rdp_add_remove_leaf(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """An add-remove mechanism as dp-accounting's RDP accountant (add/remove) takes it: the events
    themselves, pure ε as (ε²/2)-zCDP (Bun & Steinke 2016, Prop. 1.4)."""
    if isinstance(event, PureDpEvent):
        return dp_accounting.ZCDpEvent(event.epsilon**2 / 2)
    if isinstance(
        event,
        (
            dp_accounting.GaussianDpEvent,
            dp_accounting.PoissonSampledDpEvent,
            dp_accounting.ZCDpEvent,
            dp_accounting.NonPrivateDpEvent,
            dp_accounting.NoOpDpEvent,
        ),
    ):
        return event
    raise UnsupportedEvent(Accountant.RDP, event, "no add-remove RDP bound is implemented for it; use --accountant pld")


def _rdp_leaf(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """Replace-one mechanism -> the add/remove event with the same privacy loss (for dp-accounting's RDP accountant)."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return dp_accounting.GaussianDpEvent(event.noise_multiplier / 2)
    if isinstance(event, PureDpEvent):
        # ε-DP implies (ε²/2)-zCDP (Bun & Steinke 2016, Prop. 1.4).
        return dp_accounting.ZCDpEvent(event.epsilon**2 / 2)
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        raise UnsupportedEvent(
            Accountant.RDP,
            event,
            "dp-accounting's RDP accountant samples add/remove neighbours only; use --accountant pld",
        )
    if isinstance(event, (dp_accounting.ZCDpEvent, dp_accounting.NonPrivateDpEvent, dp_accounting.NoOpDpEvent)):
        return event
    raise UnsupportedEvent(
        Accountant.RDP, event, "no replace-one RDP bound is implemented for it; use --accountant pld"
    )


def zcdp_rho(event: dp_accounting.DpEvent, neighbours: Neighbours | str = Neighbours.REPLACE_ONE) -> float:
    """ρ (zCDP) of an event under ``neighbours`` (replace-one: a Gaussian of multiplier z is 2/z²;
    add-remove: 1/(2z²)); ∞ for a non-private one."""
    factor = neighbours_of(neighbours).sensitivity_factor
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return math.inf if event.noise_multiplier == 0 else factor**2 / (2.0 * event.noise_multiplier**2)
    if isinstance(event, PureDpEvent):
        return event.epsilon**2 / 2  # ε-DP implies (ε²/2)-zCDP (Bun & Steinke 2016, Prop. 1.4)
    if isinstance(event, dp_accounting.ZCDpEvent):
        if event.xi:
            raise UnsupportedEvent(
                Accountant.ZCDP, event, f"approximate zCDP (xi = {event.xi}) does not compose into ρ alone"
            )
        return event.rho
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return sum(zcdp_rho(e, neighbours) for e in event.events)
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return event.count * zcdp_rho(event.event, neighbours)
    if isinstance(event, dp_accounting.NonPrivateDpEvent):
        return math.inf
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return 0.0
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        raise UnsupportedEvent(Accountant.ZCDP, event, POISSON_REFUSAL)
    raise UnsupportedEvent(Accountant.ZCDP, event, "it has no zCDP bound; use --accountant pld")


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
        rest: list[dp_accounting.DpEvent] = []
        eps, dlt = 0.0, 0.0
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


# ----- the accountants, one class each, registered in one place -------------------------------
class PrivacyAccountant(abc.ABC):
    """One accountant: ε at δ of an event under a neighbouring relation, what it can account, and how
    calibration solves with it. Subclass, set the class attributes, and decorate with :func:`register_accountant`."""

    name: ClassVar[str]
    """The registry key (what ``--accountant`` and a config's ``accountant`` field take)."""
    description: ClassVar[str] = ""
    relations: ClassVar[tuple[str, ...]] = (Neighbours.REPLACE_ONE.value,)
    """The neighbouring relations it accounts (:class:`~fedpers.config.Neighbours` values); a run
    under another is refused before any release."""
    poisson_relations: ClassVar[tuple[str, ...]] = ()
    """The relations under which it accounts Poisson-sampled releases (amplification by sampling); a
    run with Poisson cohorts needs an accountant that does under its relation, the others refuse them."""
    stated_events: ClassVar[bool] = False
    """Accounts an :class:`EpsilonDeltaDpEvent` itself; False: its stated (ε, δ) is added to the
    rest's ε by basic composition."""
    calibration_step: ClassVar[float] = 1e-2
    """Relative step by which calibration raises a closed-form z until this accountant's ε meets the target."""
    coarse_discretisation: ClassVar[float | None] = None
    """A PLD grid calibration first solves on (then checks at :data:`PLD_DISCRETISATION`); None: none."""
    min_delta: ClassVar[float] = 0.0
    """The smallest δ this accountant can certify an ε at; calibration refuses a smaller target
    before any release (a δ it cannot resolve has ε = inf at every noise: nothing to solve)."""

    @abc.abstractmethod
    def epsilon(
        self,
        event: dp_accounting.DpEvent,
        delta: float,
        *,
        pld_discretisation: float,
        neighbours: Neighbours = Neighbours.REPLACE_ONE,
    ) -> float:
        """ε at ``delta`` of ``event`` under ``neighbours`` (its stated (ε, δ) parts already removed
        unless ``stated_events``; ``neighbours`` is one of :attr:`relations`).

        Raises :class:`UnsupportedEvent` for an event it cannot account."""

    def closed_form_multiplier(
        self,
        unit: Sequence[float],
        target_epsilon: float,
        target_delta: float,
        neighbours: Neighbours = Neighbours.REPLACE_ONE,
    ) -> float:
        """A first z for a Gaussian-only event whose multipliers at z = 1 are ``unit``: exact for
        μ-GDP (Gaussian composition: μ = κ/z per release, κ the relation's sensitivity factor);
        calibration then raises it by :attr:`calibration_step`."""
        factor = neighbours_of(neighbours).sensitivity_factor
        return gaussian_mu([u / factor for u in unit]) / analytic_gaussian_mu(target_epsilon, target_delta)


ACCOUNTANTS: dict[str, type[PrivacyAccountant]] = {}
"""name → accountant class: the one registry every choice of accountant lists."""
A = TypeVar("A", bound=type[PrivacyAccountant])


def register_accountant(cls: A) -> A:
    """Class decorator: add ``cls`` to :data:`ACCOUNTANTS` under ``cls.name`` (a class registered
    again is kept; another class under a taken name is refused with a ValueError)."""
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_accountant: {cls.__name__}.name must be an identifier; got {name!r}")
    if ACCOUNTANTS.get(name, cls) is not cls:
        raise ValueError(f"register_accountant: {name!r} is already {ACCOUNTANTS[name].__name__}; got {cls.__name__}")
    declare_accountant(
        name, cls.relations, cls.poisson_relations
    )  # what a config's check reads (fedpers.configs.privacy)
    ACCOUNTANTS[name] = cls
    return cls


def unregister_accountant(name: str) -> None:
    """Remove ``name`` from the registry (a test cleaning up); the built-in ones cannot be removed."""
    if name in {a.value for a in Accountant}:
        raise ValueError(f"unregister_accountant: {name!r} is built in")
    ACCOUNTANTS.pop(name, None)
    forget_accountant(name)


def accountant_names() -> tuple[str, ...]:
    """Every registered accountant's name, in registration order (the built-in ones first)."""
    return tuple(ACCOUNTANTS)


def get_accountant(accountant: Accountant | str) -> PrivacyAccountant:
    """The registered accountant named ``accountant``; a ValueError naming the allowed set otherwise."""
    name = accountant_name(accountant)
    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}; got {name!r}")
    return ACCOUNTANTS[name]()


@register_accountant
class PldAccountant(PrivacyAccountant):
    """dp-accounting's PLD accountant (replace-one), with :class:`_PLDAccountant`'s two added events."""

    name = Accountant.PLD.value
    description = "privacy loss distributions: exact for Gaussian composition, Poisson sampling included"
    relations: ClassVar[tuple[str, ...]] = (Neighbours.REPLACE_ONE.value, Neighbours.ADD_REMOVE.value)
    poisson_relations: ClassVar[tuple[str, ...]] = relations
    stated_events = True
    calibration_step = 1e-4
    coarse_discretisation = COARSE_DISCRETISATION
    min_delta = 1e-15
    # dp-accounting's PLD keeps about 5e-16 of probability mass at infinity (its truncated
    # tails), whatever the noise: below that ε = inf; at 1e-15 a calibration takes ~10 s.

    def epsilon(
        self,
        event: dp_accounting.DpEvent,
        delta: float,
        *,
        pld_discretisation: float,
        neighbours: Neighbours = Neighbours.REPLACE_ONE,
    ) -> float:
        pld = _PLDAccountant(pld_discretisation, neighbours_of(neighbours))

        def pld_leaf(leaf: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
            if not pld.supports(leaf):
                raise UnsupportedEvent(
                    self.name, leaf, f"dp-accounting has no {neighbours_of(neighbours).value} PLD for it"
                )
            return leaf

        pld.compose(_map_leaves(event, pld_leaf))
        return float(pld.get_epsilon(delta))


@register_accountant
class RdpAccountant(PrivacyAccountant):
    """dp-accounting's RDP accountant on the add/remove events of the same privacy loss (:func:`_rdp_leaf`)."""

    name = Accountant.RDP.value
    description = "Rényi DP (dp-accounting); looser than pld, Poisson sampling under add-remove only"
    relations = (Neighbours.REPLACE_ONE.value, Neighbours.ADD_REMOVE.value)
    poisson_relations = (Neighbours.ADD_REMOVE.value,)

    def epsilon(
        self,
        event: dp_accounting.DpEvent,
        delta: float,
        *,
        pld_discretisation: float,
        neighbours: Neighbours = Neighbours.REPLACE_ONE,
    ) -> float:
        rdp = rdp_privacy_accountant.RdpAccountant(neighboring_relation=ADD_OR_REMOVE)
        add_remove = neighbours_of(neighbours) is Neighbours.ADD_REMOVE
        rdp.compose(_map_leaves(event, _rdp_add_remove_leaf if add_remove else _rdp_leaf))
        return float(rdp.get_epsilon(delta))


@register_accountant
class ZcdpAccountant(PrivacyAccountant):
    """ρ-zCDP composition and the papers' conversion to ε (:func:`zcdp_rho`, :func:`zcdp_epsilon`)."""

    name = Accountant.ZCDP.value
    description = "zero-concentrated DP (Bun & Steinke 2016), the papers' calibration; no Poisson sampling"
    relations = (Neighbours.REPLACE_ONE.value, Neighbours.ADD_REMOVE.value)
    calibration_step = 1e-9

    def epsilon(
        self,
        event: dp_accounting.DpEvent,
        delta: float,
        *,
        pld_discretisation: float,
        neighbours: Neighbours = Neighbours.REPLACE_ONE,
    ) -> float:
        return zcdp_epsilon(zcdp_rho(event, neighbours), delta)

    def closed_form_multiplier(
        self,
        unit: Sequence[float],
        target_epsilon: float,
        target_delta: float,
        neighbours: Neighbours = Neighbours.REPLACE_ONE,
    ) -> float:
        """Σ κ²/(2(z·u)²) = ρ_target in closed form (calibration's loop only guards the floating point)."""
        factor = neighbours_of(neighbours).sensitivity_factor
        return math.sqrt(sum(factor**2 / (2.0 * u**2) for u in unit) / zcdp_rho_for(target_epsilon, target_delta))


@register_accountant
class MmccAccountant(PldAccountant):
    """MMCC (Choquette-Choo, Ganesh, Steinke, Thakurta, ICLR 2024): a Poisson-sampled matrix mechanism
    (:class:`~fedpers.privacy.mmcc.MatrixMechanismDpEvent`) by conditional composition of mixtures of
    Gaussians, composed in PLD with every other event as :class:`PldAccountant` does. Add/remove only (the
    paper's relation; under replace-one a neighbour's two users are both sampled, which its analysis does
    not cover). The tail bounds' failure probability is charged to δ: ε is the smallest over
    :data:`~fedpers.privacy.mmcc.TAIL_SHARES` of ε_PLD(δ − share·δ), each a valid guarantee."""

    name = "mmcc"
    description = "MMCC: Poisson-sampled correlated noise (any C >= 0), add-remove; otherwise as pld"
    relations = (Neighbours.ADD_REMOVE.value,)
    poisson_relations = relations

    def epsilon(
        self,
        event: dp_accounting.DpEvent,
        delta: float,
        *,
        pld_discretisation: float,
        neighbours: Neighbours = Neighbours.ADD_REMOVE,
    ) -> float:
        if neighbours_of(neighbours) is not Neighbours.ADD_REMOVE:
            raise UnsupportedEvent(self.name, event, "MMCC is implemented for add-remove neighbours only")
        probe = _PLDAccountant(pld_discretisation, Neighbours.ADD_REMOVE)

        def leaf(e: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
            if isinstance(e, mmcc.MatrixMechanismDpEvent):
                mmcc.check_event(e)
                return dp_accounting.NoOpDpEvent()
            if not probe.supports(e):
                raise UnsupportedEvent(self.name, e, "dp-accounting has no add-remove PLD for it")
            return e

        rest = _map_leaves(event, leaf)
        counted = _stream_counts(event)
        best = math.inf
        for share in mmcc.TAIL_SHARES if counted else (0.0,):
            acc = _PLDAccountant(pld_discretisation, Neighbours.ADD_REMOVE)
            acc.compose(rest)
            charged = 0.0
            for stream, times in counted:
                pld, tail = mmcc.stream_pld(stream, share * delta / len(counted), pld_discretisation)
                if pld is None:
                    return math.inf
                acc.compose_pld(pld.self_compose(times) if times > 1 else pld)
                charged += tail * times
            if charged >= delta:
                continue
            best = min(best, float(acc.get_epsilon(delta - charged)))
        return best


def _stream_counts(event: dp_accounting.DpEvent) -> list[tuple[mmcc.MatrixMechanismDpEvent, int]]:
    """The matrix-mechanism streams inside ``event`` with how often each is composed."""
    out: dict[mmcc.MatrixMechanismDpEvent, int] = {}
    stack: list[tuple[dp_accounting.DpEvent, int]] = [(event, 1)]
    while stack:
        e, times = stack.pop()
        if isinstance(e, dp_accounting.ComposedDpEvent):
            stack.extend((inner, times) for inner in e.events)
        elif isinstance(e, dp_accounting.SelfComposedDpEvent):
            stack.append((e.event, times * e.count))
        elif isinstance(e, mmcc.MatrixMechanismDpEvent):
            out[e] = out.get(e, 0) + times
    return list(out.items())


def event_epsilon(
    event: dp_accounting.DpEvent,
    delta: float,
    accountant: Accountant | str = Accountant.PLD,
    *,
    pld_discretisation: float = PLD_DISCRETISATION,
    neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
) -> float:
    """ε at ``delta`` of one (composed) event under ``neighbours`` (``pld_discretisation``: the
    PLD accountant's grid; only calibration's first solve uses another).

    Raises :class:`UnsupportedEvent` (a ValueError) for an event ``accountant`` cannot account, and a
    ValueError for a relation it does not account.
    """
    _check_delta(delta)
    relation = neighbours_of(neighbours)
    if skellam.contains_skellam(event):
        # distributed DP: the Skellam mechanism has an RDP bound only, so the whole composition is accounted in RDP
        # (its recorded sensitivities are the relation's; a Poisson-sampled part by the relation's subsampled bound)
        return skellam.rdp_epsilon(event, delta, neighbours=relation)
    check_relation(accountant, relation)
    acc = get_accountant(accountant)
    if not acc.stated_events:
        rest, eps_stated, delta_stated = _split_epsilon_delta(event)
        if delta_stated > 0 or eps_stated > 0:
            # Basic composition: the stated (ε, δ) parts add to the rest's ε at the δ left over.
            if delta_stated >= delta:
                return math.inf
            rest_eps = (
                event_epsilon(
                    dp_accounting.ComposedDpEvent(rest),
                    delta - delta_stated,
                    accountant,
                    pld_discretisation=pld_discretisation,
                    neighbours=relation,
                )
                if rest
                else 0.0
            )
            return rest_eps + eps_stated
    return _remembered_epsilon(acc, event, delta, pld_discretisation, relation)


EPSILON_MEMO_SIZE = 256
"""How many (accountant, event, δ, grid) → ε answers a process keeps (:func:`_remembered_epsilon`)."""
_epsilon_memo: dict[tuple[Any, ...], float] = {}
_epsilon_memo_lock = threading.Lock()


def _remembered_epsilon(
    acc: PrivacyAccountant,
    event: dp_accounting.DpEvent,
    delta: float,
    grid: float,
    neighbours: Neighbours = Neighbours.REPLACE_ONE,
) -> float:
    """``acc.epsilon(event, delta)``, computed once per process for one exact event: a run's
    reported ε is the ε its calibration already checked when the ledger's releases compose to
    the same event (:func:`ledger_form`), and the runs of a sweep share their PLDs. The key is
    everything the answer depends on: the accountant's class and its ``epsilon`` method (a new
    or patched one misses), the event's exact text (floats round-trip) and node types, δ, the
    grid and the neighbouring relation; any other event, a ledger that differs from the plan
    included, is computed."""
    key = (type(acc), type(acc).epsilon, _event_key(event), float(delta), float(grid), neighbours.value)
    with _epsilon_memo_lock:
        if key in _epsilon_memo:
            return _epsilon_memo[key]
    # the relation is passed only when it is not the default: an accountant that declares replace-one alone
    # (its ``relations``) keeps the signature it was written with
    extra = {} if neighbours is Neighbours.REPLACE_ONE else {"neighbours": neighbours}
    eps = acc.epsilon(event, delta, pld_discretisation=grid, **extra)
    with _epsilon_memo_lock:
        _epsilon_memo[key] = eps
        while len(_epsilon_memo) > EPSILON_MEMO_SIZE:
            del _epsilon_memo[next(iter(_epsilon_memo))]  # the oldest answer
    return eps


def _event_key(event: dp_accounting.DpEvent) -> tuple[bytes, tuple[str, ...]]:
    """The SHA-256 of the event's text (a composition of thousands of releases stays 32 bytes in
    the memo) and the full names of every class in it (two classes may share a name)."""
    kinds: set[str] = set()
    stack: list[Any] = [event]
    while stack:
        e = stack.pop()
        kinds.add(f"{type(e).__module__}.{type(e).__qualname__}")
        if isinstance(e, dp_accounting.ComposedDpEvent):
            stack.extend(e.events)
        elif isinstance(e, (dp_accounting.SelfComposedDpEvent, dp_accounting.PoissonSampledDpEvent)):
            stack.append(e.event)
    return hashlib.sha256(repr(event).encode()).digest(), tuple(sorted(kinds))


def forget_epsilons() -> None:
    """Empty the process's memo of computed ε (a test that changes an accountant in place)."""
    with _epsilon_memo_lock:
        _epsilon_memo.clear()


def ledger_form(event: dp_accounting.DpEvent) -> dp_accounting.ComposedDpEvent:
    """``event`` written as :func:`ledger_epsilon` composes a run's releases: its mechanisms (a
    Poisson-sampled one is one mechanism) in order of first appearance, equal ones folded into
    one ``SelfComposedDpEvent`` (:func:`fold_repeats`). The same privacy loss (composition is
    associative and commutative); calibration checks its answer in this form, so a run whose
    releases are its plan reports an ε computed on the very event the check passed."""
    leaves: list[tuple[dp_accounting.DpEvent, int]] = []
    stack: list[tuple[dp_accounting.DpEvent, int]] = [(event, 1)]
    while stack:
        e, times = stack.pop()
        if isinstance(e, dp_accounting.ComposedDpEvent):
            stack.extend((inner, times) for inner in reversed(e.events))
        elif isinstance(e, dp_accounting.SelfComposedDpEvent):
            stack.append((e.event, times * e.count))
        else:
            leaves.append((e, times))
    return dp_accounting.ComposedDpEvent(fold_repeats([e for e, _ in leaves], [t for _, t in leaves]))


def ledger_neighbours(ledger: Ledger) -> Neighbours:
    """The neighbouring relation every release of ``ledger`` names (replace-one for an empty ledger);
    a ValueError for a ledger whose releases name two (no single guarantee holds for it)."""
    relations = {r.neighbours for r in ledger}
    if len(relations) > 1:
        raise ValueError(
            f"a ledger's releases must share one neighbouring relation; got {', '.join(sorted(relations))}"
        )
    return neighbours_of(relations.pop()) if relations else Neighbours.REPLACE_ONE


SKELLAM_COMPOSITION = (
    "RDP composition (the Skellam releases have an RDP bound only, so every release is accounted in RDP)"
)
"""How a ledger holding a Skellam (distributed DP) release is composed, whatever the run's accountant."""
SAMPLED_SKELLAM = {
    Neighbours.REPLACE_ONE: "Poisson-sampled rounds by Wang, Balle & Kasiviswanathan 2019, Theorem 9 (replace-one)",
    Neighbours.ADD_REMOVE: "Poisson-sampled rounds by Zhu & Wang 2019, the general subsampled bound (add-remove)",
}
"""What a view adds to :data:`SKELLAM_COMPOSITION` when some Skellam release is Poisson-sampled."""


def _sampled_skellam(event: dp_accounting.DpEvent) -> bool:
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        return skellam.contains_skellam(event.event)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return any(_sampled_skellam(e) for e in event.events)
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return _sampled_skellam(event.event)
    return False


def how_accounted(ledger: Ledger, accountant: Accountant | str) -> dict[str, Any]:
    """What every view of a run names of how its releases were noised and accounted, read off the ledger:
    ``dp_model`` (who added the noise: each release records it; none recorded: central), ``bits`` (the
    modular sum's, distributed only), ``accountant`` (the one that gives the reported ε: RDP for a ledger
    holding a Skellam release, whatever was asked) and ``composition``."""
    models = sorted({str(r.params.get("dp_model", "central")) for r in ledger}) or ["central"]
    bits = sorted({int(r.params["bits"]) for r in ledger if "bits" in r.params and "dp_model" in r.params})
    name = accountant.value if isinstance(accountant, Accountant) else str(accountant)
    skellam_ledger = any(skellam.contains_skellam(r.event) for r in ledger)
    composition = SKELLAM_COMPOSITION
    if any(_sampled_skellam(r.event) for r in ledger):
        composition = f"{SKELLAM_COMPOSITION[:-1]}; {SAMPLED_SKELLAM[ledger_neighbours(ledger)]})"
    return {
        "dp_model": "+".join(models),
        "bits": bits[0] if len(bits) == 1 else (bits or None),
        "accountant": "rdp" if skellam_ledger else name,
        "composition": composition
        if skellam_ledger
        else (f"{name} composition of the releases" if name in CAPABILITIES else name),
    }


def ledger_epsilon(ledger: Ledger, delta: float, accountant: Accountant | str = Accountant.PLD) -> float:
    """Worst-case ε over disjoint groups, for the releases each group's units are touched by, under
    the neighbouring relation the releases name (:func:`ledger_neighbours`).

    Raises :class:`UnsupportedEvent` (a ValueError) for a release ``accountant`` cannot account.
    """
    relation = ledger_neighbours(ledger)
    groups: list[str | None] = [*ledger.groups()] or [None]
    seen: dict[tuple[str, ...], float] = {}
    for g in groups:
        releases = ledger.touching(g) if g is not None else list(ledger)
        events = shared_sample_events(releases)
        key = tuple(sorted(repr(e) for e in events))
        if releases and key not in seen:
            seen[key] = event_epsilon(
                dp_accounting.ComposedDpEvent(fold_repeats(events)), delta, accountant, neighbours=relation
            )
    return max(seen.values(), default=0.0)


def fold_repeats(
    events: Sequence[dp_accounting.DpEvent], times: Sequence[int] | None = None
) -> list[dp_accounting.DpEvent]:
    """Equal events folded into one ``SelfComposedDpEvent`` each (composition does not depend on
    order): the PLD accountant then self-composes by FFT instead of convolving T times — the same
    ε to ~1e-9 relative, 3–7× faster for T = 10–50 Gaussian releases. ``times``: how often each
    event is composed (default once each), in order of first appearance."""
    counts: dict[Any, list[Any]] = {}
    for i, e in enumerate(events):
        try:
            hash(e)
            key: Any = e
        except TypeError:  # an event holding a list (a composition) is kept as it is
            key = ("unhashable", i)
        counts.setdefault(key, [e, 0])[1] += 1 if times is None else times[i]
    return [e if c == 1 else dp_accounting.SelfComposedDpEvent(e, c) for e, c in counts.values()]


def shared_sample_events(releases: Sequence[Release]) -> list[dp_accounting.DpEvent]:
    """The releases' events, with those computed on one Poisson sample (the same
    ``params["poisson_sample"]``) merged into one sampled mechanism: their Gaussians compose to
    the Gaussian (Σ z_i⁻²)^(−1/2), sampled once at q. Composing them as independently sampled
    events would not describe what was released."""
    out: list[dp_accounting.DpEvent] = []
    shared: dict[str, list[dp_accounting.PoissonSampledDpEvent]] = {}
    for r in releases:
        sample = r.params.get("poisson_sample") if isinstance(r.params, dict) else None
        if sample is None or not isinstance(r.event, dp_accounting.PoissonSampledDpEvent):
            out.append(r.event)
        else:
            shared.setdefault(str(sample), []).append(r.event)
    for sample, events in shared.items():
        rates = {e.sampling_probability for e in events}
        inner = [e.event for e in events]
        if len(rates) == 1 and all(isinstance(e, dp_accounting.GaussianDpEvent) for e in inner):
            z = sum(e.noise_multiplier**-2 for e in inner) ** -0.5
            out.append(dp_accounting.PoissonSampledDpEvent(rates.pop(), dp_accounting.GaussianDpEvent(z)))
        elif len(rates) == 1 and all(isinstance(e, SkellamDpEvent) for e in inner):
            # distributed DP: the Skellams of one sample are one sampled mechanism, accounted in RDP (their
            # curves add inside the subsampled bound)
            out.append(dp_accounting.PoissonSampledDpEvent(rates.pop(), dp_accounting.ComposedDpEvent(inner)))
        else:
            raise ValueError(
                f"releases on Poisson sample {sample!r} must share one rate and be all Gaussian or all Skellam; "
                f"got {events}"
            )
    return out


def gaussian_multipliers(event: dp_accounting.DpEvent) -> list[float] | None:
    """The noise multipliers of an event made only of Gaussian events, else None."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return [event.noise_multiplier]
    if isinstance(event, dp_accounting.ComposedDpEvent):
        parts = [gaussian_multipliers(e) for e in event.events]
        if any(p is None for p in parts):
            return None
        return [z for p in parts if p is not None for z in p]
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        inner = gaussian_multipliers(event.event)
        return None if inner is None else inner * event.count
    return None


class Calibrations:
    """The noise multipliers a protocol was calibrated with, keyed by what each depends on
    (:func:`calibration_key`). Passed to ``Experiment.protocol``: the server's table, sent
    with a Flower job, lets a node rebuild the same public protocol without running the
    accountant (the protocol digest check still refuses any mismatch); a key not in the table
    is solved and added."""

    def __init__(self, known: Mapping[str, float] | None = None) -> None:
        self.table: dict[str, float] = dict(known or {})

    def __call__(
        self,
        make_event: Callable[[float], dp_accounting.DpEvent],
        target_epsilon: float,
        target_delta: float,
        accountant: Accountant | str = Accountant.PLD,
        neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
    ) -> float:
        key = calibration_key(make_event, target_epsilon, target_delta, accountant, neighbours)
        if key not in self.table:
            self.table[key] = _calibrate(make_event, target_epsilon, target_delta, accountant, neighbours)
        return self.table[key]


def calibration_key(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    target_delta: float,
    accountant: Accountant | str,
    neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
) -> str:
    """What a calibration depends on: the event's shape (at z = 1 and 2), the target, the accountant
    and (when not replace-one, whose keys predate the choice) the neighbouring relation."""
    relation = neighbours_of(neighbours)
    return repr(
        (
            repr(make_event(1.0)),
            repr(make_event(2.0)),
            float(target_epsilon),
            float(target_delta),
            accountant_name(accountant),
            *(() if relation is Neighbours.REPLACE_ONE else (relation.value,)),
        )
    )


def calibrate_noise_multiplier(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    target_delta: float,
    accountant: Accountant | str = Accountant.PLD,
    calibrations: Calibrations | None = None,
    neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
) -> float:
    """Smallest noise multiplier z whose event meets (ε, δ) under ``neighbours``; ``make_event(z)`` is
    what one unit is touched by (z = σ / per-unit bound in every relation: the event is the same, its
    privacy loss is the relation's).

    Returns 0 for ε = ∞ (no noise). The accountant's ε at the result is ≤ the target and
    within 0.1% of it (Gaussian-only events) or within the bisection tolerance.
    ``calibrations``: look the result up there (and record it), see :class:`Calibrations`.
    """
    relation = neighbours_of(neighbours)
    if calibrations is not None:
        if relation is Neighbours.REPLACE_ONE:  # the default: a table that predates the choice is asked as before
            return calibrations(make_event, target_epsilon, target_delta, accountant)
        return calibrations(make_event, target_epsilon, target_delta, accountant, relation)
    return _calibrate(make_event, target_epsilon, target_delta, accountant, relation)


def check_rule_meets_target(
    rule: str,
    event: dp_accounting.DpEvent,
    target_epsilon: float,
    target_delta: float,
    accountant: Accountant | str = Accountant.PLD,
) -> None:
    """Refuse, before any work, noise set by a paper's own ``rule`` whose ``event`` spends more than the
    target ε by ``accountant``: the rule is then outside the range its derivation holds in (the classical
    Gaussian formula needs ε < 1 per release; Theorem 4.2's bound is linear in Δ/σ where the exact ε
    grows faster), and a run of it would publish a result that breaks its own stated target."""
    if math.isinf(target_epsilon):
        return
    spent = event_epsilon(event, target_delta, accountant)
    if spent > target_epsilon * (1 + 1e-9):
        raise ValueError(
            f"calibration: {rule} would spend ε = {spent:.4g} by {accountant_name(accountant)} for target ε = "
            f"{target_epsilon:g} at these values (outside the range the rule holds in); lower --epsilon, or use "
            "--calibration accountant (the smallest noise that meets the target)"
        )


def meets_target(
    make_event: Callable[[float], dp_accounting.DpEvent],
    z: float,
    target_epsilon: float,
    target_delta: float,
    accountant: Accountant | str,
    neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
) -> bool:
    """Whether noise multiplier ``z`` meets the target (ε at ``target_delta`` ≤ ``target_epsilon``), at full
    resolution: what a cached multiplier must pass, and what a node checks of a multiplier it is sent."""
    relation = neighbours_of(neighbours)
    if math.isinf(target_epsilon):
        return True
    # first on the event as the ledger composes the plan's releases: the ε a run of the plan
    # reports is this one, computed once (the two forms' ε differ by ~1e-11 from rounding)
    return (
        event_epsilon(ledger_form(make_event(z)), target_delta, accountant, neighbours=relation) <= target_epsilon
        or event_epsilon(make_event(z), target_delta, accountant, neighbours=relation) <= target_epsilon
    )


def _calibrate(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    target_delta: float,
    accountant: Accountant | str,
    neighbours: Neighbours | str = Neighbours.REPLACE_ONE,
) -> float:
    _check_delta(target_delta)
    relation = neighbours_of(neighbours)
    check_relation(accountant, relation)
    acc = get_accountant(accountant)
    if target_delta < acc.min_delta:
        raise ValueError(
            f"delta must be >= {acc.min_delta:g} with the {acc.name} accountant (below it ε is infinite at "
            f"any noise); got {target_delta:g} (another accountant, e.g. --accountant rdp, may take it)"
        )
    if not target_epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {target_epsilon}")
    if math.isinf(target_epsilon):
        return 0.0

    def eps_at(z: float) -> float:
        return event_epsilon(make_event(z), target_delta, accountant, neighbours=relation)

    key = _cache_key(make_event, target_epsilon, target_delta, acc, relation)
    cached = calibration_cache.lookup(key) if key is not None else None
    if cached is not None and meets_target(make_event, cached, target_epsilon, target_delta, accountant, relation):
        return cached  # what the solve below returned for this key; its ε still checked at full resolution
    z = _solve_calibration(make_event, target_epsilon, target_delta, acc, eps_at, relation)
    if key is not None:
        calibration_cache.store(key, z)
    return z


def _cache_key(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    target_delta: float,
    acc: PrivacyAccountant,
    neighbours: Neighbours = Neighbours.REPLACE_ONE,
) -> str | None:
    """The calibration cache's key for this solve (None: the accountant's code cannot be read, so
    a cached answer could outlive a change to it)."""
    try:
        sources = sorted({__file__, inspect.getfile(type(acc))})
        settings = (PLD_DISCRETISATION, COARSE_DISCRETISATION, Z_MIN, acc.calibration_step, acc.coarse_discretisation)
        return calibration_cache.entry_key(
            calibration_key(make_event, target_epsilon, target_delta, acc.name, neighbours), settings, sources
        )
    except (OSError, TypeError):
        return None


def _solve_calibration(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    target_delta: float,
    acc: PrivacyAccountant,
    eps_at: Callable[[float], float],
    neighbours: Neighbours = Neighbours.REPLACE_ONE,
) -> float:
    accountant = acc.name
    unit = gaussian_multipliers(make_event(1.0))
    if unit is not None and all(z > 0 for z in unit):
        # Gaussian composition has a closed form (μ-GDP; zCDP's own): solve there, then confirm with the accountant.
        z = acc.closed_form_multiplier(unit, target_epsilon, target_delta, neighbours)
        steps = 0
        while eps_at(z) > target_epsilon:
            z *= 1.0 + acc.calibration_step
            steps += 1
            if steps == 50:  # still above: refuse if it would take CALIBRATION_STEPS more (minutes for PLD)
                far = z * (1.0 + acc.calibration_step) ** CALIBRATION_STEPS
                if eps_at(far) > target_epsilon:
                    raise ValueError(
                        f"epsilon {target_epsilon:g} is below what the {accountant} accountant resolves for this run "
                        f"at delta {target_delta:g}: its ε stays above it even at {far / z:.3g}x the noise the exact "
                        f"Gaussian bound needs (its grid is coarser than the target); raise --epsilon or use "
                        f"--accountant rdp"
                    )
        return z

    coarse = acc.coarse_discretisation
    if coarse is not None:
        # solve on the coarse grid, then check at full resolution; re-solve there only if the
        # coarse answer is not within 0.1% of the target (Poisson-sampled events: ~10× faster)
        z = _solve(
            lambda z: event_epsilon(
                make_event(z), target_delta, accountant, pld_discretisation=coarse, neighbours=neighbours
            ),
            target_epsilon,
            target_delta,
        )
        eps = eps_at(z)
        if target_epsilon * (1 - 1e-3) <= eps <= target_epsilon * (1 + 1e-3):
            while eps > target_epsilon:
                z *= 1.0 + 1e-4
                eps = eps_at(z)
            return z
    return _solve(eps_at, target_epsilon, target_delta)


def _solve(eps_at: Callable[[float], float], target_epsilon: float, target_delta: float) -> float:
    """Smallest z (to 1e-4 relative) with ``eps_at(z)`` ≤ the target: bracket by doubling, then Brent."""

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


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
