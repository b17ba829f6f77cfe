"""``fedpers run ALGO``'s flags checked before anything heavy is imported.

The config classes live in the experiment modules, which import torch and dp-accounting (seconds).
:data:`fedpers.commands.flag_table.TABLE` is a snapshot of every built-in algorithm's fields (flag,
type, choices, range) and of the runtime options, with a fingerprint of the source files they were
read from (each field's help line too, so ``fedpers run ALGO --help`` is printed from it by the
parser :func:`fedpers.commands.cli.algorithm_parser` would build). :func:`precheck` refuses a mistyped flag (with a did-you-mean) or a value of the wrong
type or range from the snapshot alone, in milliseconds; a line it passes is parsed again, in full,
by the experiment's own parser. A snapshot older than its sources (or an algorithm it lacks, a
plugin) is skipped: the full parser then answers, only later. ``python -m fedpers.commands.flags``
rewrites the snapshot (tests/test_startup.py checks it is current).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedpers import config as config_lib

ROOT = Path(__file__).resolve().parent.parent
"""The fedpers package directory: snapshot source paths are relative to it."""
TABLE_FILE = Path(__file__).with_name("flag_table.py")
COMMON_FLAGS: dict[str, bool] = {
    "--config": True,
    "--out": True,
    "--json": False,
    "--quiet": False,
    "--track": True,
    "--track-uri": True,
}
"""The flags every ``fedpers run ALGO`` has beside the config fields: flag → takes a value."""
TRACKERS = ("tensorboard", "mlflow")
SIMPLE_TYPES: dict[str, type] = {"int": int, "float": float, "bool": bool, "str": str, "path": Path}


def field_schema(cls: type) -> list[dict[str, Any]]:
    """Each field of the dataclass ``cls``: name, flag, type, enum choices and its range metadata."""
    types = config_lib.field_types(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = types[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if args else tp
        default = f.default.value if isinstance(f.default, enum.Enum) else f.default
        entry: dict[str, Any] = {
            "name": f.name,
            "flag": f.metadata.get("flag") or "--" + f.name.replace("_", "-"),
            "help": f"{f.metadata.get('help', '')} (default: {default})",
        }
        if callable(f.metadata.get("choices")):
            # names a registry may extend at run time: listed in the help as registered now, their
            # check left to the full parser
            entry["type"], entry["choices"] = "registry", list(f.metadata["choices"]())
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            entry["type"], entry["choices"] = "enum", [e.value for e in tp]
        else:
            entry["type"] = next((k for k, v in SIMPLE_TYPES.items() if tp is v), "any")
        # a bound of 0 is a bound: only absent (None) or switched-off (False) entries are left out
        meta = {k: f.metadata.get(k) for k in ("gt", "ge", "lt", "le", "inf_ok", "words")}
        entry["meta"] = {k: v for k, v in meta.items() if v is not None and v is not False}
        out.append(entry)
    return out


def _sources(classes: Sequence[type]) -> list[str]:
    """The files whose text decides these classes' fields (their bases' and enum types' modules too)."""
    import inspect

    files = {ROOT / "config.py", ROOT / "experiments" / "__init__.py"}
    for cls in classes:
        for base in cls.__mro__:
            if dataclasses.is_dataclass(base):
                files.add(Path(inspect.getfile(base)).resolve())
        for f in dataclasses.fields(cls):
            if callable(f.metadata.get("choices")):  # the registry's own module (its built-in names)
                files.add(Path(inspect.getfile(f.metadata["choices"])).resolve())
            if isinstance(f.metadata.get(config_lib.DECLARED_BY), type):  # ``inherited(source)``: its declaring file
                files.add(Path(inspect.getfile(f.metadata[config_lib.DECLARED_BY])).resolve())
        for tp in config_lib.field_types(cls).values():
            for t in (tp, *typing.get_args(tp)):
                if isinstance(t, type) and issubclass(t, enum.Enum):
                    files.add(Path(inspect.getfile(t)).resolve())
    return sorted(str(p.relative_to(ROOT)) for p in files)


def fingerprint(sources: Sequence[str]) -> str:
    """SHA-256 over the named source files' bytes (a missing file gives a fingerprint no table has)."""
    h = hashlib.sha256()
    for rel in sources:
        h.update(rel.encode() + b"\0")
        try:
            h.update((ROOT / rel).read_bytes())
        except OSError:
            h.update(b"\0missing")
    return h.hexdigest()


def build_table() -> dict[str, Any]:
    """The snapshot of every built-in algorithm (imports them all: seconds)."""
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.experiments import ALGORITHMS, experiment

    table: dict[str, Any] = {"runtime": field_schema(RuntimeOptions), "algorithms": {}}
    for name in sorted(n for n, (module, _, _) in ALGORITHMS.items() if module.startswith("fedpers.")):
        cls = experiment(name).config_type
        sources = _sources([cls, RuntimeOptions])
        table["algorithms"][name] = {
            "module": ALGORITHMS[name][0],
            "fields": field_schema(cls),
            "sources": sources,
            "fingerprint": fingerprint(sources),
        }
    return table


def table_text(table: Mapping[str, Any]) -> str:
    """The snapshot module's text (JSON inside a string: no formatter rewrites it)."""
    body = json.dumps(table, indent=1, sort_keys=True, ensure_ascii=False)
    return (
        '"""Generated by ``python -m fedpers.commands.flags``: the flags of every built-in algorithm\n'
        '(see :mod:`fedpers.commands.flags`). Do not edit by hand."""\n\n'
        "import json\n\n"
        f'TABLE = json.loads(\n    r"""\n{body}\n"""\n)\n'
    )


def _load() -> Mapping[str, Any] | None:
    try:
        from fedpers.commands.flag_table import TABLE
    except (ImportError, ValueError):
        return None
    return TABLE


def current(algorithm: str) -> tuple[Mapping[str, Any], Mapping[str, Any]] | None:
    """The snapshot and ``algorithm``'s entry in it, or None where the snapshot cannot speak for
    it (no snapshot, an algorithm it lacks, or sources changed since it was written)."""
    table = _load()
    entry = (table or {}).get("algorithms", {}).get(algorithm)
    if table is None or entry is None or fingerprint(entry["sources"]) != entry["fingerprint"]:
        return None
    return table, entry


def asks_for_help(argv: Sequence[str]) -> bool:
    """``-h``/``--help`` among the flags (before any ``--``)."""
    args = list(argv)
    return bool({"-h", "--help"} & set(args[: args.index("--") if "--" in args else len(args)]))


def _check_value(entry: Mapping[str, Any], text: str) -> None:
    name, kind, m = entry["name"], entry["type"], entry.get("meta", {})
    value: Any = (m.get("words") or {}).get(text, text)
    if kind == "enum":
        if value not in entry["choices"]:
            raise ValueError(f"{name} must be one of {', '.join(entry['choices'])}; got {text!r}")
        return
    if kind in SIMPLE_TYPES and isinstance(value, str):
        value = config_lib.coerce_value(name, SIMPLE_TYPES[kind], value)
    config_lib.check_range(name, value, m)


def suggestion(flag: str, known: Sequence[str]) -> str:
    """``; did you mean --x?`` for the closest known flag(s), or an empty string."""
    import difflib  # only an unknown flag pays for it

    close = difflib.get_close_matches(flag, known, n=2, cutoff=0.75)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def precheck(algorithm: str, argv: Sequence[str]) -> None:
    """Refuse (ValueError) an unknown flag or a value the field cannot take, from the snapshot only.

    Does nothing where the snapshot cannot speak for ``algorithm`` (not in it, or its sources
    changed since): the full parser checks every line anyway."""
    found = current(algorithm)
    if found is None:
        return
    table, entry = found
    fields = {e["flag"]: e for e in [*entry["fields"], *table["runtime"]]}
    known = [*COMMON_FLAGS, *fields]
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token in ("-h", "--help") or token == "--":
            return
        if not token.startswith("-"):
            raise ValueError(f"run {algorithm}: unexpected argument {token!r} (flags take the form --name VALUE)")
        flag, eq, inline = token.partition("=")
        if flag not in fields and flag not in COMMON_FLAGS:
            raise ValueError(
                f"run {algorithm}: unknown flag {flag}{suggestion(flag, known)} "
                f"(`fedpers run {algorithm} --help` lists them)"
            )
        takes = COMMON_FLAGS.get(flag, True)
        if not takes:
            continue
        if eq:
            value = inline
        elif i < len(args):
            value, i = args[i], i + 1
        else:
            raise ValueError(f"run {algorithm}: {flag} needs a value")
        if flag == "--track" and value not in TRACKERS:
            raise ValueError(f"track must be one of {', '.join(TRACKERS)}; got {value!r}")
        if flag in fields:
            _check_value(fields[flag], value)


def main() -> None:
    """Rewrite the snapshot from the config classes."""
    TABLE_FILE.write_text(table_text(build_table()))
    print(f"wrote {TABLE_FILE}")
    from fedpers.app import write_flat_keys

    pyproject = TABLE_FILE.parents[2] / "pyproject.toml"
    if pyproject.is_file() and write_flat_keys(pyproject):  # the flat run-config keys of `flwr run .`
        print(f"wrote the flat keys of [tool.flwr.app.config] in {pyproject}")


if __name__ == "__main__":
    main()
