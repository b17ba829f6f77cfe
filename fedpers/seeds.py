"""Named seeds: every random stream of a run derives from the run seed here (imports nothing of fedpers)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    class Seeded(DataclassInstance, Protocol):
        """A config with a run seed (every :class:`fedpers.config.RunConfig`)."""

        @property
        def seed(self) -> int: ...


C = TypeVar("C", bound="Seeded")


def derived_seed(seed: int, stream: str) -> int:
    """Independent named generator seeds from one run seed (data, cohorts, noise, ...)."""
    key = [int(seed)] + [ord(c) for c in stream]
    return int(np.random.SeedSequence(key).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def split_seed(cfg: C) -> tuple[C, int]:
    """(config with the public seed, secret DP-noise seed), both derived from ``cfg.seed``.

    Everything a client may know (its data, the public cohort permutation) derives from
    the public seed; the noise seed is a separate derivation of the run seed. Whoever holds
    the run seed (it is in ``config.json``) can recompute the noise, and a small run seed can
    be found from the public one by trying seeds: for real users run with ``secure_noise``,
    which uses no seed at all.
    """
    return dataclasses.replace(cfg, seed=derived_seed(cfg.seed, "public")), derived_seed(cfg.seed, "dp-noise")
