"""fedrep (moving into a package)."""

from fedpers.experiments.fedrep.evaluation import *  # noqa: F403
