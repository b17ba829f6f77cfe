"""A run refused, before its first release, for a reason decided on its declared values alone."""

from __future__ import annotations


class RefusedBeforeRelease(ValueError):
    """The declared (public) parameters of a run cannot run it, found while planning it and before any
    release: e.g. too few bits for the modular sum of n units. Deciding it reads no data, so the refusal
    itself reveals nothing about anyone; a sweep records such a point as refused instead of stopping."""
