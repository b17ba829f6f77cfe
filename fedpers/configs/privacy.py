"""The privacy choices a config names: its accountant (a registry name) and how its noise is calibrated.

The accountants themselves live in :mod:`fedpers.privacy.accountant` (dp-accounting, scipy: seconds
to import). What a config needs to refuse a bad choice is lighter: the registered names and
whether each accounts Poisson-sampled releases. :data:`SAMPLING` holds that for the built-in
accountants from the start, and :func:`fedpers.privacy.accountant.register_accountant` declares
every accountant it registers here too (refusing one whose capability contradicts what is
declared), so both views list the same names whichever was imported first.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from fedpers.config import meta


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


SAMPLING: dict[str, bool] = {Accountant.PLD.value: True, Accountant.RDP.value: False, Accountant.ZCDP.value: False}
"""Registered accountant name → whether it accounts Poisson-sampled releases (replace-one, with
amplification): the built-in ones, then each one :func:`declare_accountant` adds."""


def declare_accountant(name: str, poisson_sampling: bool) -> None:
    """Add ``name`` to the names a config accepts (called by the accountant registry). A name
    declared with the other capability is refused (ValueError): the two views never disagree."""
    if SAMPLING.get(name, poisson_sampling) != poisson_sampling:
        raise ValueError(
            f"accountant {name!r} is declared with poisson_sampling={SAMPLING[name]}; got {poisson_sampling}"
        )
    SAMPLING[name] = poisson_sampling


def forget_accountant(name: str) -> None:
    """Remove a registered, not built-in, ``name`` (the registry unregistering it)."""
    if name not in {a.value for a in Accountant}:
        SAMPLING.pop(name, None)


def accountant_names() -> tuple[str, ...]:
    """Every registered accountant's name, in registration order (the built-in ones first)."""
    return tuple(SAMPLING)


def accountant_name(accountant: Accountant | str) -> str:
    """The registry key of ``accountant`` (an :class:`Accountant` or a registered name)."""
    return accountant.value if isinstance(accountant, Accountant) else str(accountant)


def check_accountant(accountant: Accountant | str) -> None:
    """Refuse a config's ``accountant`` that is not registered (naming the registered ones)."""
    if accountant_name(accountant) not in SAMPLING:
        raise ValueError(f"accountant must be one of {', '.join(SAMPLING)}; got {accountant_name(accountant)!r}")


def accountant_field(default: Accountant, help: str) -> Any:
    """A config field naming a registered accountant: ``fedpers run``'s flag lists the registry at
    parse time (``choices``); the config's ``check`` calls :func:`check_accountant`."""
    return dataclasses.field(default=default.value, metadata={**meta(help), "choices": accountant_names})


def sampling_accountants() -> tuple[str, ...]:
    """The registered accountants that account Poisson-sampled releases."""
    return tuple(name for name, sampling in SAMPLING.items() if sampling)


def check_poisson_accountant(accountant: Accountant | str, where: str) -> None:
    """Refuse an accountant without Poisson sampling for a run that samples (``where``: its setting)."""
    check_accountant(accountant)
    if not SAMPLING[accountant_name(accountant)]:
        raise ValueError(
            f"accountant must be {' or '.join(sampling_accountants())} with {where} (the sampled replace-one "
            f"accountant); got {accountant_name(accountant)}"
        )
