"""noisyhead (moving into a package)."""

from fedpers.experiments.noisyhead.protocol import *  # noqa: F403
