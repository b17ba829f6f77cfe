"""The privacy choices a config names: its accountant (a registry name) and how its noise is calibrated.

The accountants themselves live in :mod:`fedpers.privacy.accountant` (dp-accounting, scipy: seconds
to import). What a config needs to refuse a bad choice is lighter: the registered names, the
neighbouring relations each accounts, and under which it accounts Poisson-sampled releases.
:data:`CAPABILITIES` holds that for the built-in accountants from the start, and
:func:`fedpers.privacy.accountant.register_accountant` declares every accountant it registers here
too (refusing one whose capability contradicts what is declared), so both views list the same names
whichever was imported first.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from fedpers.config import Neighbours, meta, neighbours_of


class Accountant(str, enum.Enum):
    """The built-in accountants' names (each registered in
    :data:`fedpers.privacy.accountant.ACCOUNTANTS`; a registered accountant is named by its string,
    see :func:`accountant_names`)."""

    PLD = "pld"
    RDP = "rdp"
    ZCDP = "zcdp"


class Calibration(str, enum.Enum):
    """How the noise is chosen for a target (ε, δ): the paper's own rule, or the smallest noise
    the accountant certifies (the ledger's ε is reported either way)."""

    PAPER = "paper"
    ACCOUNTANT = "accountant"


BOTH = (Neighbours.REPLACE_ONE.value, Neighbours.ADD_REMOVE.value)
CAPABILITIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    Accountant.PLD.value: (BOTH, BOTH),
    Accountant.RDP.value: (BOTH, (Neighbours.ADD_REMOVE.value,)),
    Accountant.ZCDP.value: (BOTH, ()),
    "mmcc": ((Neighbours.ADD_REMOVE.value,), (Neighbours.ADD_REMOVE.value,)),
}
"""Registered accountant name → (the neighbouring relations it accounts, those under which it
accounts Poisson-sampled releases with amplification): the built-in ones and ``mmcc`` (MMCC for
Poisson-sampled correlated noise, fedpers.privacy.mmcc: declared here so a config naming it is checked
without importing dp-accounting), then each one
:func:`declare_accountant` adds (the registry's ``relations`` and ``poisson_relations``)."""


def declare_accountant(name: str, relations: tuple[str, ...], poisson_relations: tuple[str, ...]) -> None:
    """Add ``name`` to the names a config accepts (called by the accountant registry). A name
    declared with other capabilities is refused (ValueError): the two views never disagree."""
    declared = (tuple(relations), tuple(poisson_relations))
    if CAPABILITIES.get(name, declared) != declared:
        raise ValueError(f"accountant {name!r} is declared with capabilities {CAPABILITIES[name]}; got {declared}")
    CAPABILITIES[name] = declared


def forget_accountant(name: str) -> None:
    """Remove a registered, not built-in, ``name`` (the registry unregistering it)."""
    if name not in {a.value for a in Accountant}:
        CAPABILITIES.pop(name, None)


def accountant_names() -> tuple[str, ...]:
    """Every registered accountant's name, in registration order (the built-in ones first)."""
    return tuple(CAPABILITIES)


def accountant_name(accountant: Accountant | str) -> str:
    """The registry key of ``accountant`` (an :class:`Accountant` or a registered name)."""
    return accountant.value if isinstance(accountant, Accountant) else str(accountant)


def check_accountant(accountant: Accountant | str, neighbours: Neighbours | str | None = None) -> None:
    """Refuse a config's ``accountant`` that is not registered (naming the registered ones), or that
    does not account its ``neighbours`` relation (when given)."""
    if accountant_name(accountant) not in CAPABILITIES:
        raise ValueError(f"accountant must be one of {', '.join(CAPABILITIES)}; got {accountant_name(accountant)!r}")
    if neighbours is not None:
        check_relation(accountant, neighbours)


def check_relation(accountant: Accountant | str, neighbours: Neighbours | str) -> None:
    """Refuse (before any release) a neighbouring relation the accountant does not account."""
    name, relation = accountant_name(accountant), neighbours_of(neighbours).value
    if name not in CAPABILITIES:
        raise ValueError(f"accountant must be one of {', '.join(CAPABILITIES)}; got {name!r}")
    relations = CAPABILITIES[name][0]
    if relation not in relations:
        raise ValueError(f"neighbours must be one of {', '.join(relations)} with the {name} accountant; got {relation}")


def accountant_field(default: Accountant, help: str) -> Any:
    """A config field naming a registered accountant: ``fedpers run``'s flag lists the registry at
    parse time (``choices``); the config's ``check`` calls :func:`check_accountant`."""
    return dataclasses.field(default=default.value, metadata={**meta(help), "choices": accountant_names})


def sampling_accountants(neighbours: Neighbours | str = Neighbours.REPLACE_ONE) -> tuple[str, ...]:
    """The registered accountants that account Poisson-sampled releases under ``neighbours``."""
    relation = neighbours_of(neighbours).value
    return tuple(name for name, (_, sampled) in CAPABILITIES.items() if relation in sampled)


def accounts_sampling(accountant: Accountant | str, neighbours: Neighbours | str = Neighbours.REPLACE_ONE) -> bool:
    """Whether ``accountant`` accounts Poisson-sampled releases under ``neighbours``."""
    name = accountant_name(accountant)
    return name in CAPABILITIES and neighbours_of(neighbours).value in CAPABILITIES[name][1]


def check_poisson_accountant(
    accountant: Accountant | str, where: str, neighbours: Neighbours | str = Neighbours.REPLACE_ONE
) -> None:
    """Refuse an accountant without Poisson sampling under ``neighbours`` for a run that samples
    (``where``: its setting). The config does not know the trust model, so the message says what the flag
    does under each: central DP accounts the sampled releases with it; distributed DP accounts its sampled
    Skellam releases by subsampled RDP whatever it names, and calibrates with it only the central noise
    multiplier the nodes' plan starts from (a sampled calibration like any other)."""
    check_accountant(accountant)
    relation = neighbours_of(neighbours).value
    if not accounts_sampling(accountant, relation):
        raise ValueError(
            f"accountant must be {' or '.join(sampling_accountants(relation))} with {where} (the sampled {relation} "
            f"accountant); got {accountant_name(accountant)}. Under --dp-model central it accounts the sampled "
            "releases; under --dp-model distributed the nodes' sampled Skellam releases are accounted by subsampled "
            "RDP whatever it names (docs/accounting.md), and it calibrates only the central noise multiplier the "
            "nodes' plan starts from (its first guess, and what --bits 0 chooses), a sampled calibration too"
        )
