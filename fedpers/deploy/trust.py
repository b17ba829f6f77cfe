"""Which Flower app bundles (FABs) a lab trusts: ``$FEDPERS_TRUSTED_APPS`` (``--trust-app``), read by both
sides of a deployment (the SuperNode's fork server and the SuperLink's ServerApp guard)."""

from __future__ import annotations

import os

TRUSTED_APPS_ENV = "FEDPERS_TRUSTED_APPS"
"""Comma-separated SHA-256s of the FABs (Flower app bundles) this node may run; unset: any app."""


class UntrustedApp(RuntimeError):
    """A ClientApp whose FAB is not in ``$FEDPERS_TRUSTED_APPS``: refused before any of its code loads."""


def trusted_apps() -> frozenset[str]:
    """The FAB SHA-256s in ``$FEDPERS_TRUSTED_APPS`` (empty: no restriction)."""
    text = os.environ.get(TRUSTED_APPS_ENV, "")
    found = frozenset(h.strip().lower() for h in text.replace(" ", ",").split(",") if h.strip())
    bad = sorted(h for h in found if len(h) != 64 or any(c not in "0123456789abcdef" for c in h))
    if bad:
        raise SystemExit(
            f"{TRUSTED_APPS_ENV} / --trust-app: expected SHA-256 hex digests (fedpers deploy app-hash DIR); got {bad}"
        )
    return found
