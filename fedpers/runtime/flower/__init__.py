"""The Flower runtime: the same protocol as Flower ClientApps (many units per node) and a ServerApp.

- :mod:`codec`: record names and keys shared by both ends; encode/decode.
- :mod:`partition`: partition index → contiguous unit-id range.
- :mod:`client`: the node side (an injected builder rebuilds the protocol and loads units; ``client_update``).
- :mod:`server`: discovery and a Grid-backed ``gather`` for the shared ``drive`` loop.
- :mod:`simulation`: ``run_flower`` on a ServerApp's Grid, and the simulation's settings (resources, Ray).
- :mod:`managed`: Flower's supported simulation path for one run (a private SuperLink, ``flwr run``).
"""

# Nothing is imported here: a package whose __init__ imports its own modules can deadlock CPython's
# per-module import locks when two threads import it and one of its modules at once (Flower's
# simulation loads the ServerApp and the ClientApp in different threads of one process).
