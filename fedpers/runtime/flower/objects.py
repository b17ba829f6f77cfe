"""A Flower app around Python objects, for Flower's supported simulation path.

``fedpers run --runtime flower`` hands its run to the fedpers apps (``server/``, ``clients/``) as a run
config. Some callers hold objects instead: an audit's canary nodes and its recording server, a test's
faulty nodes, a benchmark's bare rounds. :func:`fedpers.app.simulate_objects` pickles them
(``cloudpickle``, what Ray uses) into the run's private directory (0700: this uid only), whose path
reaches every process of the simulation as ``$FEDPERS_OBJECTS``, and stages this module as the app's
ServerApp and ClientApp: Flower loads :data:`server_app` and :data:`client_app` by name, as it loads any
app, and they run the objects:

- ``server.pkl``: a callable ``(grid, context) -> result``; its result is written to ``result.pkl``, an
  exception it raises to ``error.pkl`` (then raised again, so Flower marks the run failed);
- ``client.pkl``: the ClientApp itself (:data:`client_app`, loaded when Flower imports this module).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

OBJECTS = "FEDPERS_OBJECTS"
"""Environment variable naming the directory of the pickled objects."""
SERVER, CLIENT, RESULT, ERROR = "server.pkl", "client.pkl", "result.pkl", "error.pkl"


def _path(name: str) -> Path:
    where = os.environ.get(OBJECTS)
    if not where:
        raise RuntimeError(f"${OBJECTS} is not set: this app runs only as fedpers.app.simulate_objects starts it")
    return Path(where) / name


def load(name: str) -> Any:
    import cloudpickle

    with open(_path(name), "rb") as f:
        return cloudpickle.load(f)


def dump(name: str, value: Any) -> None:
    import cloudpickle

    path = _path(name)
    tmp = path.with_name(f".{name}.tmp")
    with open(tmp, "wb") as f:
        cloudpickle.dump(value, f)
    os.replace(tmp, path)


server_app = ServerApp()


@server_app.main()
def _main(grid: Grid, context: Context) -> None:
    try:
        result = load(SERVER)(grid, context)
    except BaseException as e:
        try:
            dump(ERROR, e)
        except Exception:  # an exception that cannot be pickled: its kind and message
            dump(ERROR, RuntimeError(f"{type(e).__name__}: {e}"))
        raise
    dump(RESULT, result)


def _client_app() -> ClientApp:
    """The pickled ClientApp, loaded where Flower loads the app's components (the simulation's process),
    which hands this object to its node actors with every message (they may run on a Ray cluster
    started elsewhere, without this run's environment). Outside such a run: an empty ClientApp."""
    if not os.environ.get(OBJECTS):
        return ClientApp()
    app = load(CLIENT)
    if not isinstance(app, ClientApp):
        raise TypeError(f"{CLIENT} holds a {type(app).__name__}, not a ClientApp")
    return app


client_app = _client_app()
