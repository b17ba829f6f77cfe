"""The Flower runtime: the same protocol as Flower ClientApps (many units per node) and a ServerApp.

- :mod:`codec`: record names and keys shared by both ends; encode/decode.
- :mod:`partition`: partition index → contiguous unit-id range.
- :mod:`client`: the node side (an injected builder rebuilds the protocol and loads units; ``client_update``).
- :mod:`server`: discovery and a Grid-backed ``gather`` for the shared ``drive`` loop.
- :mod:`simulation`: ``run_flower`` on a ServerApp's Grid, and the simulation's settings (resources, Ray).
- :mod:`managed`: Flower's supported simulation path for one run (a private SuperLink, ``flwr run``).
"""

from fedpers.runtime.flower.client import make_client_app
from fedpers.runtime.flower.simulation import run_flower

__all__ = ["make_client_app", "run_flower"]
