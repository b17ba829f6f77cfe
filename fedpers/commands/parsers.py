"""The parser of ``fedpers run ALGO`` (and ``fedpers audit ALGO``) built from the config classes, and the
config and runtime options of a parsed line: every flag, its help and every check are the classes' own
(:mod:`fedpers.configs`), so nothing here imports torch."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import tomllib
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedpers import config as config_lib

if TYPE_CHECKING:
    from fedpers.configs.runtime import RuntimeOptions


RUNTIME_FLAGS = "runtime options (every algorithm)"


class RegisteredAccountants:
    """The ``--accountant`` choices: the registered accountants' names, read when a line is parsed or
    help is printed (:mod:`fedpers.configs.privacy`: no accounting library is imported)."""

    def _names(self) -> tuple[str, ...]:
        from fedpers.configs.privacy import accountant_names

        return accountant_names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()


def add_fields(parser: argparse.ArgumentParser | Any, cls: type) -> None:
    """One flag per field of the config dataclass ``cls`` (``--name-with-dashes`` unless the field
    names its ``flag``): the value stays a string (the config's own :func:`fedpers.config.build`
    coerces and checks it, naming the field); an enum's values, or a registry's names as registered
    now, are its choices; the help ends with the default."""
    types = config_lib.field_types(cls)
    for f in dataclasses.fields(cls):
        tp = types[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0] if args else tp
        default = f.default.value if isinstance(f.default, enum.Enum) else f.default
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": argparse.SUPPRESS,
            "help": f"{f.metadata.get('help', '')} (default: {default})",
        }
        if callable(f.metadata.get("choices")):  # names a registry may extend at run time
            kwargs["choices"] = list(f.metadata["choices"]())
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            kwargs["choices"] = [e.value for e in tp]
        else:
            kwargs["metavar"] = f.name.upper()
        parser.add_argument(flag_name(f), **kwargs)


def out_directory(text: str) -> Path:
    """An ``--out`` directory; an empty one is refused (``Path("")`` is the current directory,
    where a run's files would land among whatever is there, e.g. from an unset shell variable)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name the directory to write")
    return Path(text)


def suggestion(flag: str, known: Sequence[str]) -> str:
    """``; did you mean --x?`` for the closest known flag(s), or an empty string."""
    import difflib  # only an unknown flag pays for it

    close = difflib.get_close_matches(flag, known, n=2, cutoff=0.75)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def choice_suggestion(message: str) -> str:
    """argparse's ``invalid choice: 'altmn' (choose from ...)`` with ``; did you mean 'altmin'?``
    added when one choice is close (a command or an algorithm name), else the message as it is."""
    import difflib
    import re

    found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if found is None:
        return message
    choices = re.findall(r"'?([A-Za-z0-9_.-]+)'?", found.group(2))
    close = difflib.get_close_matches(found.group(1), choices, n=1, cutoff=0.6)
    return f"{message}; did you mean '{close[0]}'?" if close else message


class ChoiceSuggestingParser(argparse.ArgumentParser):
    """The top-level parser and its commands' parsers: a misspelt command or algorithm name is
    answered with the closest one, as a misspelt flag is."""

    def error(self, message: str) -> typing.NoReturn:
        super().error(choice_suggestion(message))


def flag_name(f: dataclasses.Field[Any]) -> str:
    """A config field's flag: ``--name-with-dashes`` unless the field names its own ``flag``."""
    return str(f.metadata.get("flag") or "--" + f.name.replace("_", "-"))


def algorithms_with_flag(flag: str) -> tuple[list[str], str]:
    """The built-in algorithms whose config has ``flag`` and what the flag is (its help up to the
    first colon), read from the light config classes."""
    from fedpers.experiments import ALGORITHMS, config_type

    names, what = [], ""
    for name in ALGORITHMS:
        for f in dataclasses.fields(config_type(name)):
            if flag_name(f) == flag:
                names.append(name)
                what = what or str(f.metadata.get("help", "")).split(":")[0].split(";")[0].strip()
    return names, what


class SuggestingParser(argparse.ArgumentParser):
    """An algorithm's argument parser: a misspelt flag is answered with the closest known one(s); a
    flag that only other algorithms have is answered with the algorithms that have it (not with a
    look-alike flag of this one's that means something else); an error in one line (status 2)
    instead of the usage of every flag."""

    algorithm = ""

    def error(self, message: str) -> typing.NoReturn:
        flags = [a.partition("=")[0] for a in message.split(":", 1)[-1].split() if a.startswith("-")]
        if message.startswith("unrecognized arguments:") and flags:
            known = list(self._option_string_actions)
            message = "; ".join(self._unknown(f, known) for f in flags)
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")

    def _unknown(self, flag: str, known: list[str]) -> str:
        others, what = algorithms_with_flag(flag) if self.algorithm else ([], "")
        if others:
            return f"{self.algorithm} has no {flag} ({what}); it is a flag of {', '.join(others)}"
        return f"unknown flag {flag}{suggestion(flag, known)}"


def algorithm_parser(name: str) -> argparse.ArgumentParser:
    """Flags of ``fedpers run NAME``: the algorithm's config fields and the runtime options, read from
    their classes (:func:`fedpers.experiments.config_type`: for a built-in algorithm a module of
    :mod:`fedpers.configs`, which imports no torch)."""
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.experiments import ALGORITHMS, config_type

    p = SuggestingParser(prog=f"fedpers run {name}", description=ALGORITHMS[name][2], allow_abbrev=False)
    p.algorithm = name
    p.add_argument("--config", type=Path, help="TOML file with config fields (flags override it)")
    p.add_argument("--out", type=out_directory, help="run directory (default: runs/<algorithm>-<time>-s<seed>)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the result on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_tracking(p)
    add_fields(p.add_argument_group(f"{name} options"), config_type(name))
    add_fields(p.add_argument_group(RUNTIME_FLAGS), RuntimeOptions)
    return p


OWN_FLAGS = ("command", "algorithm", "config", "out", "json", "quiet", "track", "track_uri")
"""What an algorithm's parsed line holds beside config fields and runtime options."""


def run_settings(name: str, parsed: argparse.Namespace) -> tuple[Any, RuntimeOptions]:
    """The config of algorithm ``name`` and the runtime options of a parsed line (``--config FILE``,
    then the flags over it), each coerced and checked by its class: every bad value is refused here
    (ValueError naming the field), before anything heavy is imported."""
    from fedpers.configs.runtime import RuntimeOptions
    from fedpers.experiments import config_type

    cls = config_type(name)
    values: dict[str, Any] = {}
    if parsed.config is not None:
        try:
            values.update(tomllib.loads(parsed.config.read_text()))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"config: cannot read {parsed.config}: {e}") from None
        check_config_keys(cls, values, parsed.config)
    values.update({k: v for k, v in vars(parsed).items() if k not in OWN_FLAGS})
    algo_values, runtime_values = split_values(cls, values)
    return config_lib.build(cls, algo_values), config_lib.build(RuntimeOptions, runtime_values)


def add_tracking(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--track",
        choices=["tensorboard", "mlflow"],
        help="also log the run (config, per-round metrics, ε after each release, final metrics, baselines, "
        "figures) to TensorBoard or MLflow (pip install 'fedpers[track]')",
    )
    p.add_argument(
        "--track-uri",
        default=None,
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else MLflow's default sqlite:///mlflow.db); "
        "TensorBoard: the log directory (default: RUN_DIR/tensorboard)",
    )


def split_values(cls: type, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}, {k: v for k, v in values.items() if k not in names}


def check_config_keys(cls: type, values: Mapping[str, Any], path: Path) -> None:
    """Refuse a ``--config`` key that is neither a field of the algorithm nor a runtime option,
    naming the file and the nearest field (it was reported as an unknown runtime option)."""
    import difflib

    from fedpers.configs.runtime import RuntimeOptions

    known = {f.name for f in dataclasses.fields(cls)} | {f.name for f in dataclasses.fields(RuntimeOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        hints = [
            f"{k} (did you mean {near[0]}?)" if (near := difflib.get_close_matches(k, known, 1)) else k for k in unknown
        ]
        raise ValueError(
            f"config: {path}: unknown key(s) {', '.join(hints)}; the keys are the fields `--help` lists as flags"
        )
