"""Privacy: mechanisms (the only noise in fedpers), the ledger, and the accountant."""

from fedpers.privacy.accountant import (
    Accountant,
    Calibrations,
    UnsupportedEvent,
    analytic_gaussian_epsilon,
    calibrate_noise_multiplier,
    event_epsilon,
    ledger_epsilon,
    zcdp_epsilon,
    zcdp_rho,
    zcdp_rho_for,
)
from fedpers.privacy.ledger import ALL_UNITS, EpsilonDeltaDpEvent, Ledger, PureDpEvent, Release
from fedpers.privacy.mechanisms import (
    Condition,
    CovarianceRelease,
    DpCovarianceParams,
    Privatizer,
    dp_covariance_conditions,
)

__all__ = [
    "ALL_UNITS",
    "Accountant",
    "Calibrations",
    "Condition",
    "CovarianceRelease",
    "DpCovarianceParams",
    "EpsilonDeltaDpEvent",
    "Ledger",
    "Privatizer",
    "PureDpEvent",
    "Release",
    "UnsupportedEvent",
    "analytic_gaussian_epsilon",
    "calibrate_noise_multiplier",
    "dp_covariance_conditions",
    "event_epsilon",
    "ledger_epsilon",
    "zcdp_epsilon",
    "zcdp_rho",
    "zcdp_rho_for",
]
