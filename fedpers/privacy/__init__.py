"""Privacy: mechanisms (the only noise in fedpers), the ledger, and the accountant."""
from fedpers.privacy.accountant import (
    Accountant,
    analytic_gaussian_epsilon,
    calibrate_noise_multiplier,
    event_epsilon,
    ledger_epsilon,
)
from fedpers.privacy.ledger import ALL_UNITS, Ledger, PureDpEvent, Release
from fedpers.privacy.mechanisms import Privatizer

__all__ = [
    "ALL_UNITS",
    "Accountant",
    "Ledger",
    "Privatizer",
    "PureDpEvent",
    "Release",
    "analytic_gaussian_epsilon",
    "calibrate_noise_multiplier",
    "event_epsilon",
    "ledger_epsilon",
]
