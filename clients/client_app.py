"""The fedpers ClientApp (``[tool.flwr.app.components] clientapp``).

Thin by design: :func:`fedpers.app.make_client_app` is the Flower runtime's node side
(:mod:`fedpers.runtime.flower.client`) with the app layer's node builder injected: it
rebuilds the protocol from the job, loads this node's units (its ``partition-id`` range; a
``data-file`` in the node config replaces the config's data path) and calls
``protocol.client_update``.
"""

# Refuse to run unless the fedpers imported here is this app's own (the check is loaded by path, not through fedpers).
import importlib.util as _util
from pathlib import Path as _Path

_spec = _util.spec_from_file_location(
    "_fedpers_fab_integrity", _Path(__file__).resolve().parents[1] / "fedpers" / "deploy" / "integrity.py"
)
_integrity = _util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(_integrity)  # type: ignore[union-attr]
_integrity.require_fab_code(_Path(__file__).resolve().parents[1])
from fedpers.app import make_client_app, register_app_entries

app = make_client_app(register_app_entries(_Path(__file__).resolve().parents[1]))  # and to its Ray actors
