"""Regenerate (or check) the sample outputs in the docs from the code that prints them.

A sample is a fenced block right after a ``<!-- sample: NAME -->`` line in a docs file; it holds
``$ COMMAND`` lines, each followed by what the command printed. This script runs every command
of the block again (through bash, ``fedpers`` from this checkout, ``/tmp/docs`` swapped for a
fresh temporary directory) and writes what they print now. A ``python`` sample is a block of
Python code followed by what it prints as ``# `` lines; the code runs again the same way:

    PYTHONPATH=. python docs/samples.py                 # rewrite every sample
    PYTHONPATH=. python docs/samples.py flower-sim8     # rewrite one
    PYTHONPATH=. python docs/samples.py --check NAME    # exit 1 if a sample is stale

The check compares with wall times masked (``18.1 s``, ``"seconds": ...``): everything else a
sample shows is the code's output for fixed seeds, digit for digit. tests/test_docs_samples.py
runs the check (the Flower one in the slow suite).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS_TMP = "/tmp/docs"


@dataclass(frozen=True)
class Sample:
    file: str
    stderr: bool
    """Whether the block shows what the commands print on stderr too (errors), or stdout only."""
    gap: bool = False
    """A blank line between one command's output and the next command."""
    python: bool = False
    """The block is Python code; what it prints follows as ``# `` lines."""


SAMPLES = {
    "readme-altmin": Sample("README.md", stderr=False, gap=True),
    "usage-errors": Sample("docs/usage.md", stderr=True),
    "usage-python": Sample("docs/usage.md", stderr=False, python=True),
    "noisygd-accountants": Sample("docs/mechanisms.md", stderr=False, gap=True),
    "noisygd-remedies": Sample("docs/mechanisms.md", stderr=False, gap=True),
    "flower-sim8": Sample("docs/flower.md", stderr=False, gap=True),
}
SLOW = ("noisygd-remedies", "flower-sim8")
"""Samples whose commands take more than a few seconds: checked in the slow suite."""
MARK = "<!-- sample: {name} -->"
_TIME = re.compile(r"\b\d+(\.\d+)? s\b|\"seconds\": [0-9.e+-]+")


def block(text: str, name: str) -> tuple[int, int]:
    """(start, end) of the fenced block's body after ``name``'s mark in ``text``."""
    mark = text.index(MARK.format(name=name))
    start = text.index("\n", text.index("```", mark)) + 1  # after the opening fence (```python too)
    return start, text.index("```\n", start)


def commands(body: str) -> list[str]:
    """The block's commands (a command continued with a trailing backslash spans its lines)."""
    out: list[str] = []
    lines = iter(body.splitlines())
    for line in lines:
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\"):
                cmd = cmd[:-1] + "\n" + next(lines)
            out.append(cmd)
    return out


def run(cmds: list[str], stderr: bool, gap: bool = False) -> str:
    """The block body: each command and what it prints now."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDPERS_CALIBRATION_CACHE": "0", "COLUMNS": "200"}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for cmd in cmds:
            done = subprocess.run(
                ["bash", "-c", cmd.replace(DOCS_TMP, tmp)],
                cwd=tmp,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if stderr else subprocess.DEVNULL,
                text=True,
                timeout=900,
            )
            out.append("$ " + cmd + "\n" + done.stdout.replace(tmp, DOCS_TMP))
    return ("\n" if gap else "").join(o if o.endswith("\n") else o + "\n" for o in out)


def run_python(body: str) -> str:
    """The block body: its code (every line but the ``# `` output lines) and what it prints now."""
    code = "".join(line + "\n" for line in body.splitlines() if not line.startswith("# "))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDPERS_CALIBRATION_CACHE": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp, env=env, stdout=subprocess.PIPE, text=True, timeout=900
        )
    return code + "".join("# " + line + "\n" for line in done.stdout.replace(tmp, DOCS_TMP).splitlines())


def masked(text: str) -> str:
    return _TIME.sub("<time>", text)


def regenerate(name: str, check: bool = False) -> bool:
    """Rewrite sample ``name`` (``check``: only compare); True if it was current."""
    sample = SAMPLES[name]
    path = ROOT / sample.file
    text = path.read_text()
    start, end = block(text, name)
    body = text[start:end]
    new = run_python(body) if sample.python else run(commands(body), sample.stderr, sample.gap)
    current = masked(new) == masked(text[start:end])
    if not check and new != text[start:end]:
        path.write_text(text[:start] + new + text[end:])
    if check and not current:
        print(f"{name} ({sample.file}) is stale; now it prints:\n{new}", file=sys.stderr)
    return current


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"samples (default: all of {', '.join(SAMPLES)})")
    parser.add_argument("--check", action="store_true", help="exit 1 if a sample is stale; write nothing")
    args = parser.parse_args()
    stale = [n for n in args.names or SAMPLES if not regenerate(n, args.check)]
    if args.check and stale:
        sys.exit(1)


if __name__ == "__main__":
    main()
