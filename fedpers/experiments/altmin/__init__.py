"""altmin (moving into a package)."""

from fedpers.experiments.altmin.plan import *  # noqa: F403
