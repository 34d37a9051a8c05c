"""argparse plumbing for ``elastrun``: split argv, record what was typed, read ``PET_*``.

argparse only splits argv; defaults, environment fallbacks and conversions happen
afterwards (:class:`Values`) so that every error can name where its value came from.
A prefix shared by the dash and underscore spellings of one option is not ambiguous,
and argparse's complaints become one-line ConfigError lines (see :mod:`elastrun.launch.cli`
for how this differs from torchrun).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn, TypeVar

from elastrun.core.errors import ConfigError
from elastrun.launch.options import BY_DEST, OPTIONS

__all__ = ["Values", "blame", "build_parser", "split_argv"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class _Given:
    """A value given on the command line, and the option string that carried it."""

    value: str | bool
    option: str


class _StoreGiven(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        value: str | bool = True if self.nargs == 0 else str(values)
        setattr(namespace, self.dest, _Given(value, option_string or self.dest))


class _Parser(argparse.ArgumentParser):
    """argparse, with errors raised as ConfigError and same-option prefixes accepted."""

    def error(self, message: str) -> NoReturn:
        raise _translate_argparse_error(message) from None

    # Why override a private method: argparse decides ambiguity here, and counts
    # ``--nproc-per-node`` and ``--nproc_per_node`` as two candidates for ``--nproc``.
    # Collapsing candidates that share an action keeps every genuinely ambiguous
    # prefix an error. The tuple layout differs across Python versions, but the action
    # is always the first element, which is all this relies on.
    def _get_option_tuples(
        self, option_string: str
    ) -> list[tuple[argparse.Action, str, str | None]]:
        unique: dict[int, tuple[argparse.Action, str, str | None]] = {}
        for candidate in super()._get_option_tuples(option_string):
            unique.setdefault(id(candidate[0]), candidate)
        return list(unique.values())


class _HelpFormatter(argparse.HelpFormatter):
    """Lists each option once: the underscore spellings are noted in the epilog."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        spellings = [o for o in action.option_strings if "_" not in o]
        if not spellings or spellings == action.option_strings:
            return super()._format_action_invocation(action)
        if action.nargs == 0:
            return ", ".join(spellings)
        metavar = self._format_args(action, action.dest.upper())
        return ", ".join(f"{option} {metavar}" for option in spellings)


def build_parser() -> argparse.ArgumentParser:
    """The ``elastrun`` argument parser: it records each option as given (see the module
    docstring), and its ``error()`` raises :class:`ConfigError`."""
    parser = _Parser(
        prog="elastrun",
        description="Fault-tolerant, elastic launcher for distributed PyTorch; "
        "a drop-in replacement for torchrun.",
        epilog="Every --dashed-option is also accepted as --dashed_option, and any "
        "unambiguous prefix of an option works. Options marked [elastrun] are not torchrun "
        "options. Everything after the script is passed to it unchanged.",
        formatter_class=_HelpFormatter,
        allow_abbrev=True,
        exit_on_error=False,
        argument_default=argparse.SUPPRESS,
    )
    for opt in OPTIONS:
        notes = []
        if opt.default not in (None, ""):
            notes.append(f"default: {opt.default}")
        if opt.env:
            notes.append(f"env: {opt.env_name}")
        help_text = opt.help + (f" ({'; '.join(notes)})" if notes else "")
        if opt.ours:
            help_text += " [elastrun]"
        parser.add_argument(
            *opt.names,
            dest=opt.dest,
            action=_StoreGiven,
            nargs=0 if opt.flag else None,
            metavar=opt.metavar,
            help=help_text.replace("%", "%%"),
        )
    parser.add_argument(
        "training_script",
        metavar="script",
        help="the Python script, the module (-m) or the program (--no-python) to run",
    )
    parser.add_argument(
        "training_script_args",
        metavar="...",
        nargs=argparse.REMAINDER,
        default=[],
        help="arguments for the script, passed through unchanged",
    )
    return parser


_ARGUMENT_RE = re.compile(r"^argument (?P<name>[^:]+): (?P<msg>.*)$")
_AMBIGUOUS_RE = re.compile(r"^ambiguous option: (?P<opt>\S+) could match (?P<matches>.*)$")
_EXPLICIT_RE = re.compile(r"^ignored explicit argument '(?P<value>.*)'$")


def _translate_argparse_error(message: str, name: str | None = None) -> ConfigError:
    """Turn one of argparse's messages into a one-line ConfigError."""
    message = " ".join(message.split())
    if name is None and (match := _ARGUMENT_RE.match(message)):
        name, message = match["name"], match["msg"]
    if name is not None:
        # argparse names an option by all its spellings: "--log-dir/--log_dir".
        field = name.split("/")[0]
        if message == "expected one argument":
            return ConfigError(field, None, "expects a value")
        if match := _EXPLICIT_RE.match(message):
            return ConfigError(field, match["value"], "is a flag and takes no value")
        return ConfigError(field, None, message)
    if match := _AMBIGUOUS_RE.match(message):
        opt = match["opt"]
        return ConfigError(
            opt.split("=", 1)[0], opt, f"ambiguous abbreviation, could be {match['matches']}"
        )
    if message.startswith("the following arguments are required"):
        return ConfigError("script", None, "no script, module or program to run was given")
    if message.startswith("unrecognized arguments: "):
        arg = message.removeprefix("unrecognized arguments: ").split(" ")[0]
        return ConfigError(arg.split("=", 1)[0], arg, "unknown option")
    return ConfigError("command line", None, message)


class Values:
    """Each option's value: the command line, else ``PET_<DEST>``, else the default.

    Every value comes with its source, the name to blame in an error: the option string
    as typed (``--nproc``, ``--nproc_per_node``) or the variable.
    """

    def __init__(self, namespace: argparse.Namespace, environ: Mapping[str, str]) -> None:
        self._ns = namespace
        self._environ = environ

    def given(self, dest: str) -> bool:
        """Whether the option was set on the command line or through its variable."""
        return self._lookup(dest)[0] is not None

    def source(self, dest: str) -> str:
        """The name to blame for the option's value: the option or the variable."""
        return self._lookup(dest)[1]

    def text(self, dest: str) -> tuple[str | None, str]:
        """The option's raw string (or its default, maybe None) and its source."""
        value, source = self._lookup(dest)
        return (BY_DEST[dest].default if value is None else str(value)), source

    def parsed(self, dest: str, parse: Callable[[str, str], _T]) -> _T | None:
        """The option's value through ``parse(raw, source)``; None when it has none."""
        raw, source = self.text(dest)
        return None if raw is None else parse(raw, source)

    def required(self, dest: str) -> tuple[str, str]:
        """:meth:`text` for an option that has a default."""
        value, source = self.text(dest)
        if value is None:
            raise LookupError(f"option {dest} has no default")  # a bug in the table
        return value, source

    def flag(self, dest: str) -> bool:
        value, source = self._lookup(dest)
        if value is None or isinstance(value, bool):
            return bool(value)
        # torchrun reads these variables with bool(int(value)).
        try:
            return int(value) != 0
        except ValueError:
            raise ConfigError(source, value, "must be 0 or 1") from None

    def _lookup(self, dest: str) -> tuple[str | bool | None, str]:
        opt = BY_DEST[dest]
        given = getattr(self._ns, dest, None)
        if isinstance(given, _Given):
            return given.value, given.option
        if opt.env:
            raw = self._environ.get(opt.env_name)
            if raw:
                return raw, opt.env_name
        return None, opt.canonical


def split_argv(argv: Sequence[str]) -> argparse.Namespace:
    """Split the command line into options (as given) and the script with its arguments.

    Raises:
        ConfigError: argparse's complaint, as one line naming the option.
    """
    parser = build_parser()
    try:
        namespace, extras = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise _translate_argparse_error(exc.message, exc.argument_name) from None
    if extras:
        raise _translate_argparse_error(f"unrecognized arguments: {' '.join(extras)}")
    return namespace


def blame(exc: ConfigError, sources: Mapping[str, str]) -> ConfigError:
    """Name the option as the user gave it (a variable or the other spelling), also in
    ``--rdzv-conf KEY`` fields."""
    option, space, rest = exc.field.partition(" ")
    given = sources.get(option, option)
    return exc if given == option else ConfigError(given + space + rest, exc.value, exc.reason)
