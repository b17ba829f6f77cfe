"""`fedpers deploy certs DIR`: the lab's keys, secrets, policy and recipe (:mod:`fedpers.deploy.recipe`).

Public Flower only: ``cryptography`` writes the files, and the commands are Flower's own CLIs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def make_certs(
    out: str | Path, hosts: Sequence[str], supernodes: int, *, days: int = 365, force: bool = False, **layout: Any
) -> dict[str, Path]:
    """The lab's keys, secrets, policy and ``commands.txt``, one directory per machine.

    ``layout``: port, link_port, node_port, data_file, app_hash, listen
    (:class:`fedpers.deploy.recipe.Layout`), policy (TOML text)."""
    from fedpers.deploy.recipe import Layout
    from fedpers.deploy.recipe import make_certs as write

    policy = layout.pop("policy", None)
    return write(Layout(Path(out), tuple(hosts), supernodes, **layout), days=days, force=force, policy=policy)
