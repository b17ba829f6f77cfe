"""Runtimes move messages; they never compute statistics or add noise."""

from fedpers.runtime.driver import ClientReply, RoundFailed, RoundRecord, drive
from fedpers.runtime.local import run_local

__all__ = ["ClientReply", "RoundFailed", "RoundRecord", "drive", "run_local"]
