"""The fedpers ClientApp (``[tool.flwr.app.components] clientapp``).

Thin by design: the handlers in :mod:`fedpers.runtime.flower.client` rebuild the
protocol from the job, load this node's units (its ``partition-id`` range; a
``data-file`` in the node config replaces the config's data path) and call
``protocol.client_update``.
"""
from fedpers.runtime.flower.client import make_client_app

app = make_client_app()
