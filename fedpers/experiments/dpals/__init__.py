"""dpals (moving into a package)."""

from fedpers.experiments.dpals.experiment import *  # noqa: F403
