"""Per-round checkpoints: what the round loop needs to continue a killed run exactly.

After every round :func:`~fedpers.runtime.driver.drive` writes, atomically (temporary file,
fsync, rename), the server state, the index of the next round, the round records and the
privatizer's generator states and ledger length. The checkpoint is written *before*
anything derived from the round is published (the round's line in ``rounds.jsonl``, the
next broadcast), so a release that is not in a checkpoint was never seen by anyone.

A resumed run restores the generators and continues the same random streams: the releases
it re-draws after the checkpoint (a crash between a release and the checkpoint) are the
same values, and the ledger is not extended twice for them (see
:func:`fedpers.runner.resume_directory`). A secure-noise run writes no generator state
(its generators are seeded from OS entropy and must stay unknown); its re-drawn, never
published releases are fresh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT = 1


@dataclass
class Checkpoint:
    """The loop's state after ``next_round`` rounds (``records``: the last round's
    ``RoundRecord.to_dict()`` without metrics, kept constant-size so a checkpoint costs the
    same at round 1,000 as at round 1; ``privatizer``: :meth:`Privatizer.state_dict`)."""

    next_round: int
    state: Any
    records: list[dict[str, Any]] = field(default_factory=list)
    privatizer: dict[str, Any] = field(default_factory=dict)
    run: str = ""
    """The digest of the run's configuration (a checkpoint resumes only the run that wrote it)."""


class Checkpointer:
    """Writes checkpoints to ``path`` and, when resuming, hands the loaded one to the loop."""

    def __init__(self, path: str | Path, run: str = "", resume: Checkpoint | None = None) -> None:
        self.path, self.run, self.resume = Path(path), run, resume

    def save(self, checkpoint: Checkpoint) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        payload = {
            "format": FORMAT,
            "next_round": int(checkpoint.next_round),
            "state": _to_cpu(checkpoint.state),
            "records": checkpoint.records,
            "privatizer": checkpoint.privatizer,
            "run": self.run,
        }
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)


def load(path: str | Path, device: torch.device | str = "cpu") -> Checkpoint:
    """Read a checkpoint (tensors, numbers and strings only: no code is unpickled)."""
    path = Path(path)
    try:
        payload = torch.load(path, map_location=torch.device(device), weights_only=True)
    except FileNotFoundError:
        raise ValueError(
            f"{path.parent}: no checkpoint ({path.name}); the run stopped before its first round ended"
        ) from None
    except Exception as e:
        raise ValueError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path}: not a fedpers checkpoint of format {FORMAT}")
    return Checkpoint(
        int(payload["next_round"]),
        payload["state"],
        list(payload["records"]),
        dict(payload["privatizer"]),
        str(payload.get("run", "")),
    )


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
