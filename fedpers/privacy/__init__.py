"""Privacy: mechanisms (the only noise in fedpers), the ledger, and the accountant."""

from fedpers.privacy.accountant import (
    ACCOUNTANTS,
    Accountant,
    Calibrations,
    PrivacyAccountant,
    UnsupportedEvent,
    accountant_names,
    analytic_gaussian_epsilon,
    calibrate_noise_multiplier,
    event_epsilon,
    get_accountant,
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
    "ACCOUNTANTS",
    "ALL_UNITS",
    "Accountant",
    "Calibrations",
    "Condition",
    "CovarianceRelease",
    "DpCovarianceParams",
    "EpsilonDeltaDpEvent",
    "Ledger",
    "PrivacyAccountant",
    "Privatizer",
    "PureDpEvent",
    "Release",
    "UnsupportedEvent",
    "accountant_names",
    "analytic_gaussian_epsilon",
    "calibrate_noise_multiplier",
    "dp_covariance_conditions",
    "event_epsilon",
    "get_accountant",
    "ledger_epsilon",
    "zcdp_epsilon",
    "zcdp_rho",
    "zcdp_rho_for",
]
