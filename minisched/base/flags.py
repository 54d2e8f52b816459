"""Command-line flags written once, on the config field they set (mini-sglang's ServerArgs idea).

    page_size: int = flag(16, "tokens per KV page")                      # --page-size, type int
    policy: str = flag("fcfs", "waiting-queue order", choices=POLICIES)   # choices from the owner
    chunk_size: int | None = flag(512, "...", none_as=0)                  # 0 on the command line -> None
    router: RouterConfig = section(RouterConfig, "data parallelism", prefix="router_")   # a config in a config

`add_flags(parser, config)` adds one argparse option per flagged field of a config instance (its values
are the defaults shown by --help), with `dest` = the field's name, and those of each `section` field (a
config of its own) under the section's prefix, in its --help group. `from_flags(cls, args)` builds the
config back, sections included; `flag_values(args, cls)` reads one level as `{field: value}`, undoing the
command-line spellings (`none_as`, `negate`). `flag_names(cls)` maps field names to flags, for error
messages that name what the user typed (`name_fields`).

What the user typed is known: every option `add_flags` makes notes its dest in the namespace when it is
given, so `given_flag_values(args, cls)` returns those alone, and a profile merges with the command line
in one way, `{**defaults, **profile, **given}`: what the user typed wins, even a value equal to the default.

A new option is the field with its flag and the code that uses it: nothing else to touch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

_UNSET: Any = object()
GIVEN = "_given_flags"  # the namespace attribute: dests of the options the user typed
OWN = ""  # Flag.group: the command's own options (not its section's group)


@dataclass(frozen=True)
class Flag:
    help: str = ""
    name: Optional[str] = None  # default: "--" + the prefixed field's name with dashes
    type: Optional[type] = None  # default: the type of the field's default value
    choices: Optional[tuple] = None
    none_as: Any = _UNSET  # the command-line value that stands for None (-1, 0)
    negate: bool = False  # a switch that sets the field to False (--no-radix-cache)
    cli_default: Any = _UNSET  # the command line's default where the field's differs (--model smollm2)
    metavar: Optional[str] = None  # default: the option's name in capitals
    group: Optional[str] = None  # the --help group's title (None: its section's; OWN: the command's own)
    # --help says the default this way, "(default 32 MiB)", instead of argparse's "(default: 33554432)"; such an
    # option sets nothing when it is not given (the field's default holds)
    default_words: Optional[Callable[[Any], str]] = None
    env: Optional[str] = None  # the command line's default is this environment variable where it is set


@dataclass(frozen=True)
class Section:
    cls: type
    title: str  # the --help group of its flags
    prefix: str = ""  # before its fields' names, in dests and option names


def flag(default: Any = _UNSET, help: str = "", *, default_factory: Any = _UNSET, **spec: Any) -> Any:
    """A dataclass field with its command-line flag (Flag's fields as keywords)."""
    meta = {"flag": Flag(help=help, **spec)}
    if default_factory is not _UNSET:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, title: str, prefix: str = "") -> Any:
    """A dataclass field holding a config of its own (default: `cls()`), whose flags form a --help group."""
    return dataclasses.field(default_factory=cls, metadata={"section": Section(cls, title, prefix)})


def flagged_fields(cls: type, flags: Optional[Mapping[str, Flag]] = None) -> list[tuple[dataclasses.Field, Flag]]:
    """(field, flag) of `cls`'s flagged fields; `flags` (field name -> Flag, in option order) gives them for a
    config that does not carry its own (a lower layer's, whose fields have no command-line face)."""
    if flags is not None:
        by_name = {f.name: f for f in dataclasses.fields(cls)}
        return [(by_name[name], spec) for name, spec in flags.items()]
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def option_name(field: dataclasses.Field, spec: Flag, prefix: str = "") -> str:
    return spec.name or "--" + (prefix + field.name).replace("_", "-")


def _note(namespace: Any, dest: str) -> None:
    setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {dest})


class _Store(argparse.Action):
    """argparse's "store", noting the option as given."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, values)
        _note(namespace, self.dest)


class _Append(argparse.Action):
    """argparse's "append" (a repeatable option), noting it as given."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), values])
        _note(namespace, self.dest)


class _StoreTrue(argparse.Action):
    """argparse's "store_true", noting the switch as given."""

    def __init__(self, option_strings: Any, dest: str, default: Any = False, help: Optional[str] = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, True)
        _note(namespace, self.dest)


class _Switch(argparse.BooleanOptionalAction):
    """--x / --no-x, noting the switch as given."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _note(namespace, self.dest)


def add_flags(
    parser: Any,
    config: Any,
    *,
    suppress: bool = False,
    prefix: str = "",
    flags: Optional[Mapping[str, Flag]] = None,
) -> None:
    """One option per flagged field of `config` (an instance: its values are the defaults) and the options of
    its sections, in field order. `parser` is a parser, or an argument group when no flag or section names a
    group of its own. With `suppress`, an option not given sets nothing (`given_flag_values` reads the ones
    given). `flags` (field name -> Flag, in option order): the flags of a config that carries none itself."""
    _add_flags(parser, config, suppress, prefix, flags, {OWN: parser}, parser)


def _add_flags(
    parser: Any,
    config: Any,
    suppress: bool,
    prefix: str,
    flags: Optional[Mapping[str, Flag]],
    groups: dict,
    here: Any,
) -> None:
    def group(title: Optional[str], default: Any) -> Any:
        if title is None:
            return default
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        return groups[title]

    if flags is not None:
        for f, spec in flagged_fields(type(config), flags):
            _add_one(group(spec.group, here), f, spec, getattr(config, f.name), prefix, suppress)
        return
    for f in dataclasses.fields(type(config)):
        sec = f.metadata.get("section")
        if sec is not None:
            sub = getattr(config, f.name)
            _add_flags(parser, sub, suppress, prefix + sec.prefix, None, groups, group(sec.title, here))
        elif "flag" in f.metadata:
            own: Flag = f.metadata["flag"]
            _add_one(group(own.group, here), f, own, getattr(config, f.name), prefix, suppress)


def _add_one(group: Any, f: dataclasses.Field, spec: Flag, value: Any, prefix: str, suppress: bool) -> None:
    name = option_name(f, spec, prefix)
    dest = prefix + f.name
    default = spec.cli_default if spec.cli_default is not _UNSET else value
    if value is None and spec.none_as is not _UNSET:
        default = spec.none_as
    if spec.env is not None:
        default = os.environ.get(spec.env, default)
    kind = spec.type or (type(default) if default is not None else None)
    help = spec.help if spec.default_words is None else f"{spec.help} (default {spec.default_words(value)})"
    if spec.negate or (kind is bool and default is False):
        action = group.add_argument(name, dest=dest, action=_StoreTrue, help=help)
    elif kind is bool:  # True or None (the device's default): --x / --no-x
        action = group.add_argument(name, dest=dest, action=_Switch, default=default, help=help)
    else:
        many = isinstance(default, tuple)  # a tuple field: a repeatable option (--stop a --stop b)
        action = group.add_argument(
            name,
            dest=dest,
            action=_Append if many else _Store,
            type=kind if kind is not str else None,
            default=list(default) if many else default,
            choices=list(spec.choices) if spec.choices is not None else None,
            metavar=spec.metavar or (None if spec.choices is not None else name.lstrip("-").upper().replace("-", "_")),
            help=help,
        )
    if suppress or spec.default_words is not None:
        action.default = argparse.SUPPRESS


def _read(spec: Flag, value: Any) -> Any:
    """A parsed option's value as the field's: the command-line spellings undone."""
    if spec.negate:
        return not value
    if spec.none_as is not _UNSET and value == spec.none_as:
        return None
    if isinstance(value, list):
        return tuple(value)
    return value


def byte_size(n: int) -> str:
    """`n` bytes in words: "32 MiB", "64 KiB", "100 bytes" (for default_words)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def given(args: argparse.Namespace) -> frozenset:
    """The dests of the options the user typed."""
    return getattr(args, GIVEN, frozenset())


def given_flag_values(
    args: argparse.Namespace, cls: type, *, prefix: str = "", flags: Optional[Mapping[str, Flag]] = None
) -> dict[str, Any]:
    """{field: value} of the flagged fields of `cls` that the user typed."""
    typed = given(args)
    return {
        f.name: _read(spec, getattr(args, prefix + f.name))
        for f, spec in flagged_fields(cls, flags)
        if prefix + f.name in typed
    }


def flag_values(
    args: argparse.Namespace, cls: type, *, prefix: str = "", flags: Optional[Mapping[str, Flag]] = None
) -> dict[str, Any]:
    """{field: value} of `cls`'s flagged fields from parsed arguments (an option without a default that was
    not given is left out: the field's default holds)."""
    have = vars(args)
    return {
        f.name: _read(spec, have[prefix + f.name]) for f, spec in flagged_fields(cls, flags) if prefix + f.name in have
    }


def from_flags(cls: type, args: argparse.Namespace, *, prefix: str = "") -> Any:
    """The config `cls` from parsed arguments, its sections built the same way (ValueError: a config's own)."""
    values = flag_values(args, cls, prefix=prefix)
    for f in dataclasses.fields(cls):
        sec = f.metadata.get("section")
        if sec is not None:
            values[f.name] = from_flags(sec.cls, args, prefix=prefix + sec.prefix)
    return cls(**values)


def flag_names(*classes: type, prefix: str = "") -> dict[str, str]:
    """field name -> its flag, over these config classes and their sections (a section's fields also by
    their prefixed names: `record_max_bytes` as `max_bytes`)."""
    out: dict[str, str] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            sec = f.metadata.get("section")
            if sec is not None:
                out.update(flag_names(sec.cls, prefix=prefix + sec.prefix))
        for f, spec in flagged_fields(cls):
            out.setdefault(f.name, option_name(f, spec, prefix))
            out[prefix + f.name] = option_name(f, spec, prefix)
    return out


def name_fields(message: str, names: Mapping[str, str]) -> str:
    """`message` with each field name of `names` (a whole word) replaced by its flag."""
    if not names:
        return message
    words = sorted(names, key=len, reverse=True)  # longest first: record_max_bytes before max_bytes
    return re.sub(r"(?<![\w-])(" + "|".join(map(re.escape, words)) + r")\b", lambda m: names[m.group(1)], message)
