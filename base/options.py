"""Options as dataclasses whose fields are the one source of their flags (vLLM's EngineArgs).

From one options dataclass come the flags a service parses (add_arguments), the options they parse into
(from_args) and the flags that hand the options to another process (to_argv: what `ferry up` starts a service
with). Adding an option is adding a field. A field's metadata holds what its flag adds:
  help        the help text; --help adds the default (DefaultsHelpFormatter)
  choices     the values it takes
  switch_on   the flag that turns a default-off bool on (--enforce-eager)
  switch_off  the flag that turns a default-on bool off (--no-prefix-caching)
  flag        the flag, where it is not --field-name
  env         the variable (base/environment.py) whose value, where set, is the flag's default
  repeat      a list, its flag given once per item
  many        with repeat: one flag may also take several items (--lora-modules a=X b=Y, as vLLM's)
  nested      a dataclass of options: its fields' flags are this one's
  no_flag     set by the program, not by a flag of its own (a TlsConfig, a secret read from a file)
  in_process  set only where the options are built in the process that uses them (a benchmark baseline): no flag,
              and to_argv refuses options where it is not at its default
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import MISSING, Field, field, fields
from typing import Any

from base import environment


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A field with a flag; a list default is copied for each instance."""
    if isinstance(default, list):
        return field(default_factory=default.copy, metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


def nested(default: Any) -> Any:
    """A field holding a dataclass of options (each with its flag)."""
    return field(default_factory=lambda: copy.copy(default), metadata={"nested": True})


def no_flag(default: Any) -> Any:
    """A field the program sets (from other flags, files or the environment)."""
    return field(default_factory=lambda: copy.copy(default), metadata={"no_flag": True})


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default:" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if action.nargs == 0:   # a switch
            return f"{text} (default: off)"
        return f"{text} (default: {shown(action.default)})"


def shown(value: Any) -> str:
    if value is None or value == []:
        return "none"
    if value == "":
        return "''"
    return str(value).replace("%", "%%")


def flag_fields(options_type: type, skip: set[str] = frozenset()) -> list[Field]:
    """The fields with a flag, those of nested options in their place."""
    found = []
    for option_field in fields(options_type):
        if option_field.name in skip or option_field.metadata.get("no_flag") or option_field.metadata.get("in_process"):
            continue
        if option_field.metadata.get("nested"):
            found += flag_fields(type(default_of(option_field)), skip)
        else:
            found.append(option_field)
    return found


def default_of(option_field: Field) -> Any:
    if option_field.default is not MISSING:
        return option_field.default
    return option_field.default_factory()


def flag_name(option_field: Field) -> str:
    return option_field.metadata.get("flag") or "--" + option_field.name.replace("_", "-")


def dest(option_field: Field) -> str:
    """Where argparse keeps the flag's value: a switch's under the field's name, any other's under the flag's
    (--max-tokens-per-minute-per-key: max_tokens_per_minute_per_key)."""
    if "switch_on" in option_field.metadata or "switch_off" in option_field.metadata:
        return option_field.name
    return flag_name(option_field).removeprefix("--").replace("-", "_")


def add_arguments(parser: argparse.ArgumentParser, options_type: type, skip: set[str] = frozenset()) -> None:
    """One flag per field of options_type (and of its nested options), but for the fields named in skip and those
    whose flag the parser has already (shared by two services' options: one flag sets both)."""
    for option_field in flag_fields(options_type, skip):
        if flag_name(option_field) not in parser._option_string_actions:
            add_argument(parser, option_field)


def add_argument(parser: argparse.ArgumentParser, option_field: Field) -> None:
    meta, default = option_field.metadata, default_of(option_field)
    text = meta.get("help")
    if isinstance(default, bool) and not ("switch_on" in meta or "switch_off" in meta):
        raise TypeError(f"option {option_field.name}: a bool needs a switch_on or a switch_off flag")
    if "switch_off" in meta:
        parser.add_argument(meta["switch_off"], dest=dest(option_field), action="store_false",
                            help=f"{text} (default: {switched(option_field)} on)")
    elif "switch_on" in meta:
        parser.add_argument(meta["switch_on"], dest=dest(option_field), action="store_true",
                            help=f"{text} (default: {switched(option_field)} off)")
    elif meta.get("repeat") and meta.get("many"):
        parser.add_argument(flag_name(option_field), dest=dest(option_field), action="extend", nargs="+", default=[],
                            metavar=meta.get("metavar"), help=f"{text} (one or more, repeatable)")
    elif meta.get("repeat"):
        parser.add_argument(flag_name(option_field), dest=dest(option_field), action="append", default=[],
                            metavar=meta.get("metavar"), help=f"{text} (repeatable)")
    elif "env" in meta:   # the help names the variable, never its value (a URL may hold a password)
        parser.add_argument(flag_name(option_field), dest=dest(option_field), type=type(default),
                            default=environment.value(meta["env"]),
                            choices=meta.get("choices"), metavar=meta.get("metavar"),
                            help=f"{text} (default: ${meta['env']}, else {shown(default)})")
    else:
        names = [flag_name(option_field)] + ([meta["short"]] if "short" in meta else [])
        parser.add_argument(*names, dest=dest(option_field), type=type(default), default=default,
                            choices=meta.get("choices"), metavar=meta.get("metavar"), help=text)


def switched(option_field: Field) -> str:
    """What a switch turns on or off, in words: enable_prefix_caching: prefix caching."""
    return option_field.name.removeprefix("enable_").replace("_", " ")


def from_args(options_type: type, args: argparse.Namespace, skip: set[str] = frozenset(), **given: Any) -> Any:
    """options_type from the parsed flags (those args has, but for the fields named in skip; the others keep their
    defaults), given's fields as given; ValueError, from the dataclass's own checks, when a value is wrong."""
    values = {}
    for option_field in fields(options_type):
        if (option_field.name in given or option_field.name in skip or option_field.metadata.get("no_flag")
                or option_field.metadata.get("in_process")):
            continue
        if option_field.metadata.get("nested"):
            values[option_field.name] = from_args(type(default_of(option_field)), args, skip)
        elif hasattr(args, dest(option_field)):
            values[option_field.name] = getattr(args, dest(option_field))
    return options_type(**values, **given)


def to_argv(options: Any) -> list[str]:
    """The flags that give another process these options (what add_arguments parses back into them): one for each
    field not at its default, the default being the same on both sides. A field a variable gives the default of
    is thus left, at its default, to the variable (which the process inherits)."""
    argv = []
    for option_field in fields(options):
        value, meta = getattr(options, option_field.name), option_field.metadata
        if meta.get("in_process") and value != default_of(option_field):
            raise ValueError(f"{option_field.name} is set in-process only (a benchmark baseline), not by a flag")
        if meta.get("no_flag") or meta.get("in_process"):
            continue
        if meta.get("nested"):
            argv += to_argv(value)
        elif value == default_of(option_field):
            continue
        elif "switch_off" in meta or "switch_on" in meta:
            argv.append(meta.get("switch_off") or meta["switch_on"])
        elif meta.get("repeat"):
            argv += [a for item in value for a in (flag_name(option_field), str(item))]
        else:
            argv += [flag_name(option_field), str(value)]
    return argv


def add_log_level_argument(parser: argparse.ArgumentParser) -> None:
    """--log-level, for the processes (the services' and the worker's), not an option of what they serve."""
    parser.add_argument("--log-level", default=environment.FERRY_LOG_LEVEL,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="what the process logs (default: $FERRY_LOG_LEVEL, else INFO)")
