"""`fedpers deploy`: running the fedpers Flower apps across machines (optional; nothing in a local run
or a Flower simulation imports this package: tests/test_import_layers.py).

Public Flower only, on every supported Flower series:

- :mod:`.certs`: ``fedpers deploy certs DIR``: one directory per machine (CA, SuperLink certificate, SuperNode
  keys, the SuperExec secret, the lab policy) and the commands (:mod:`fedpers.deploy.recipe`);
- :mod:`.run`: ``fedpers deploy run``: ``flwr run`` that exits non-zero unless the run completed;
- :mod:`.fleetproxy`: ``fedpers deploy fleet-proxy``: the Fleet API alone on the network, its buffers bounded;
- :mod:`.isolation`: every process these commands start runs as ``python -I`` without telemetry;

Flower's private internals, gated by :mod:`.flower` to the Flower series they were checked on
(another series is refused with what to run instead):

- :mod:`.forkserver`: ``fedpers deploy superexec``: Flower's SuperExec with warm forked ClientApps;
  ``fedpers deploy app-hash`` and ``--trust-app``;
- :mod:`.supernode`: ``fedpers deploy supernode``: Flower's SuperNode with shorter polls, starting
  ``fedpers deploy superexec`` as its SuperExec;
- :mod:`.superlink`: ``fedpers deploy superlink``: Flower's SuperLink answering only the lab's uid;
- :mod:`.pulls`: shorter retries for message objects that have not arrived yet (in those processes,
  and in a deployed ServerApp: ``server/server_app.py``).
"""

from fedpers.deploy.certs import make_certs
from fedpers.deploy.run import run_and_wait

__all__ = ["make_certs", "run_and_wait"]
