"""Command-line flags written once, on the config field they set (mini-sglang's ServerArgs idea).

    page_size: int = flag(16, "tokens per KV page")                      # --page-size, type int
    policy: str = flag("fcfs", "waiting-queue order", choices=POLICIES)   # choices from the owner
    chunk_size: int | None = flag(512, "...", none_as=0)                  # 0 on the command line -> None

`add_flags(group, config)` adds one argparse option per flagged field of a config instance (its
values are the defaults shown by --help), with `dest` = the field's name; `flag_values(args, cls)`
reads them back as `{field: value}`, undoing the command-line spellings (`none_as`, `negate`).
`flag_names(cls)` maps field names to flags, for error messages that name what the user typed.
A new option is the field with its flag and the code that uses it: nothing else to touch.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

_UNSET: Any = object()


@dataclass(frozen=True)
class Flag:
    help: str
    name: Optional[str] = None  # default: "--" + the field's name with dashes
    type: Optional[type] = None  # default: the type of the field's default value
    choices: Optional[tuple] = None
    none_as: Any = _UNSET  # the command-line value that stands for None (-1, 0)
    negate: bool = False  # a switch that sets the field to False (--no-radix-cache)
    cli_default: Any = _UNSET  # the command line's default where the field's differs (--model smollm2)


def flag(default: Any = _UNSET, help: str = "", *, default_factory: Any = _UNSET, **spec: Any) -> Any:
    """A dataclass field with its command-line flag (Flag's fields as keywords)."""
    meta = {"flag": Flag(help=help, **spec)}
    if default_factory is not _UNSET:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flagged_fields(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def option_name(field: dataclasses.Field, spec: Flag) -> str:
    return spec.name or "--" + field.name.replace("_", "-")


def add_flags(group: Any, config: Any, suppress: bool = False) -> None:
    """One option per flagged field of `config` (an instance: its values are the defaults). With `suppress`,
    an option not given sets nothing (`given_flag_values` reads the ones given)."""
    for f, spec in flagged_fields(type(config)):
        value = getattr(config, f.name)
        name = option_name(f, spec)
        default = spec.cli_default if spec.cli_default is not _UNSET else value
        if value is None and spec.none_as is not _UNSET:
            default = spec.none_as
        kind = spec.type or (type(default) if default is not None else None)
        if spec.negate or (kind is bool and default is False):
            action = group.add_argument(name, dest=f.name, action="store_true", help=spec.help)
        elif kind is bool:  # True or None (the device's default): --x / --no-x
            action = group.add_argument(
                name, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=spec.help
            )
        else:
            action = group.add_argument(
                name,
                dest=f.name,
                type=kind if kind is not str else None,
                default=default,
                choices=list(spec.choices) if spec.choices is not None else None,
                metavar=None if spec.choices is not None else name.lstrip("-").upper().replace("-", "_"),
                help=spec.help,
            )
        if suppress:
            action.default = argparse.SUPPRESS


def given_flag_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """{field: value} of the flagged fields of `cls` given on the command line (options added with
    `add_flags(..., suppress=True)`: the others are absent from `args`)."""
    out = {}
    for f, spec in flagged_fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if spec.negate:
            value = not value
        elif spec.none_as is not _UNSET and value == spec.none_as:
            value = None
        out[f.name] = value
    return out


def flag_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """{field: value} of `cls`'s flagged fields from parsed arguments."""
    out = {}
    for f, spec in flagged_fields(cls):
        value = getattr(args, f.name)
        if spec.negate:
            value = not value
        elif spec.none_as is not _UNSET and value == spec.none_as:
            value = None
        out[f.name] = value
    return out


def flag_names(*classes: type) -> dict[str, str]:
    """field name -> its flag, over these config classes."""
    return {f.name: option_name(f, spec) for cls in classes for f, spec in flagged_fields(cls)}
