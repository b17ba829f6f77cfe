"""Small validators several configs share: a list of baselines, and which data files are long format."""

from __future__ import annotations

from pathlib import Path

LONG_FORMAT_SUFFIXES = (".parquet", ".pq", ".csv")
"""Data files read as long format (one row per sample; fedpers.data.long_format), by suffix."""


def is_long_format(path: str | Path) -> bool:
    return Path(path).suffix.lower() in LONG_FORMAT_SUFFIXES


BASELINES_HELP = "baselines on the same data: all, none, or a comma list of "
"""How every algorithm's ``--baselines`` flag begins its help (one convention: all | none | a list)."""


def parse_baselines(text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``all`` | ``none`` | a comma list of ``allowed`` → the names (refused otherwise). ``true``/``false``
    (a config.json of a run written when NoisyGD's flag was a yes/no) read as all/none."""
    text = text.strip()
    if text.lower() in ("all", "true"):
        return allowed
    if text.lower() in ("none", "", "false"):
        return ()
    names = tuple(n.strip() for n in text.split(","))
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(f"baselines: unknown {unknown}; use all, none or a comma list of {', '.join(allowed)}")
    return names
