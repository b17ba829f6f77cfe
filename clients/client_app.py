"""The fedpers ClientApp (``[tool.flwr.app.components] clientapp``).

Thin by design: :func:`fedpers.app.make_client_app` is the Flower runtime's node side
(:mod:`fedpers.runtime.flower.client`) with the app layer's node builder injected: it
rebuilds the protocol from the job, loads this node's units (its ``partition-id`` range; a
``data-file`` in the node config replaces the config's data path) and calls
``protocol.client_update``.
"""
from fedpers.app import make_client_app

app = make_client_app()
