"""The ``elastrun`` command line: argv + environment -> one validated :class:`Launch`.

Parity with torchrun 2.13: every option with its dash and underscore spellings, the
``PET_<DEST>`` environment fallbacks (an explicit option beats the variable), the same
defaults, unambiguous prefixes, and everything after the script handed to the script
untouched, even when it looks like one of our options.

Deliberate differences from torchrun (improvements):

* A prefix is accepted when every option it matches is a spelling of the *same* option:
  ``--nproc=2`` means ``--nproc-per-node=2`` here, while torchrun calls it ambiguous
  because its dash and underscore aliases are distinct strings.
* Every bad input, whether from argv or a ``PET_*`` variable, is a :class:`ConfigError`
  naming where the value came from (``--max-restarts`` or ``PET_MAX_RESTARTS``) and the
  value, never an ``AssertionError``, a traceback or an argparse exit.
* An empty ``PET_*`` variable counts as unset (torchrun would feed ``""`` to the option).
* Nothing here changes the process: ``OMP_NUM_THREADS`` is reported as a notice for the
  launcher to export to the workers, instead of being written into ``os.environ``.
* Unknown rendezvous backends, event handlers and log specs are rejected up front
  instead of failing at first use; the GPU count is read without importing torch.
"""

from __future__ import annotations

import argparse
import enum
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import NoReturn

from elastrun.core.errors import ConfigError
from elastrun.core.values import parse_host_port, parse_int, parse_port, parse_seconds
from elastrun.launch.config import (
    DEFAULT_SIGNALS,
    MAX_NODES,
    MAX_NPROC_PER_NODE,
    START_METHODS,
    LaunchConfig,
    parse_signals,
)
from elastrun.launch.paths import check_log_dir, check_writable_file
from elastrun.launch.slurm import SlurmSettings
from elastrun.supervise.processes.logs import (
    DefaultLogsSpecs,
    LogsSpecs,
    Std,
    parse_duplicate_filters,
    parse_local_ranks_filter,
)

__all__ = [
    "BUILTIN_RDZV_BACKENDS",
    "Launch",
    "ScriptKind",
    "build_parser",
    "count_nvidia_gpus",
    "parse_launch",
    "parse_nnodes",
    "parse_nproc_per_node",
    "parse_rdzv_conf",
]

BUILTIN_RDZV_BACKENDS = ("c10d", "static", "etcd", "etcd-v2")
RDZV_ENTRY_POINT_GROUPS = ("elastrun.rendezvous", "torchrun.handlers")
LOGS_SPECS_ENTRY_POINT_GROUPS = ("elastrun.logs_specs", "torchrun.logs_specs")
EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous", "file:PATH")
NUMA_BINDINGS = ("node", "socket", "exclusive", "core-complex")
DEFAULT_MASTER_PORT = 29500
NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")


class ScriptKind(enum.Enum):
    """How the workers run the script the user named."""

    SCRIPT = "script"  # python -u <script> ...
    MODULE = "module"  # python -u -m <module> ...
    BINARY = "binary"  # <program> ... (--no-python)
    RUN_PATH = "run_path"  # runpy.run_path(<script>) in a child (--run-path)


@dataclass(frozen=True)
class Launch:
    """One parsed and validated ``elastrun`` invocation.

    Attributes:
        config: the launch configuration.
        kind: how the workers run ``script``.
        script: the script path, module name or program, as the user gave it.
        script_args: the arguments after the script, untouched.
        python: the interpreter for SCRIPT and MODULE (``PYTHON_EXEC`` or ours).
        dry_run: print the plan and exit instead of launching.
        standalone: a single node hosting its own rendezvous (explicit or implicit).
        notices: lines the launcher should log when it starts.
    """

    config: LaunchConfig
    kind: ScriptKind
    script: str
    script_args: tuple[str, ...]
    python: str
    dry_run: bool
    standalone: bool
    notices: tuple[str, ...]


# --------------------------------------------------------------------------------------
# The option table. A new option is one more row here plus the code that reads it.


@dataclass(frozen=True)
class _Option:
    names: tuple[str, ...]
    help: str
    default: str | None = None
    flag: bool = False
    #: Whether torchrun reads a ``PET_<DEST>`` fallback for it.
    env: bool = True
    #: An elastrun addition (not a torchrun option).
    ours: bool = False
    metavar: str | None = None

    @property
    def canonical(self) -> str:
        """The first long spelling, used when no option string was typed."""
        return next(n for n in self.names if n.startswith("--"))

    @property
    def dest(self) -> str:
        return self.canonical[2:].replace("-", "_")

    @property
    def env_name(self) -> str:
        return f"PET_{self.dest.upper()}"


def _option(
    name: str,
    metavar: str | None,
    help: str,
    default: str | None = None,
    *,
    short: str | None = None,
    env: bool = True,
    ours: bool = False,
) -> _Option:
    """One table row; ``metavar=None`` makes a flag. Adds the underscore spelling."""
    under = "--" + name[2:].replace("-", "_")
    names = (*([short] if short else []), name, *([under] if under != name else []))
    return _Option(names, help, default, metavar is None, env, ours, metavar)


_OPTIONS: tuple[_Option, ...] = (
    _option("--nnodes", "N", "number of nodes: N, or MIN:MAX", "1:1"),
    _option(
        "--nproc-per-node",
        "N",
        "workers per node: a positive integer, cpu, gpu or auto (GPUs if any, else CPUs)",
        "1",
    ),
    _option(
        "--rdzv-backend",
        "NAME",
        "rendezvous backend: c10d, static, etcd (v3), or a registered plugin",
        "static",
    ),
    _option("--rdzv-endpoint", "HOST[:PORT]", "rendezvous endpoint", ""),
    _option("--rdzv-id", "ID", "run id shared by every node of the job", "none"),
    _option("--rdzv-conf", "K=V,...", "extra rendezvous settings", ""),
    _option(
        "--standalone",
        None,
        "run one node with its own rendezvous on a free local port; "
        "--rdzv-backend, --rdzv-endpoint and --rdzv-id are then ignored",
    ),
    _option("--max-restarts", "N", "worker-group restarts allowed after failures", "0"),
    _option("--monitor-interval", "SECONDS", "time between worker health checks", "0.1"),
    _option(
        "--start-method",
        "METHOD",
        f"start method for function workers: {', '.join(START_METHODS)}",
        "spawn",
    ),
    _option(
        "--event-log-handler",
        "NAME",
        f"destination of events: {', '.join(EVENT_LOG_HANDLERS)}",
        "null",
    ),
    _option("--role", "ROLE", "role name of the workers (ROLE_NAME)", "default"),
    _option("--module", None, "run the script as a module, like python -m", short="-m"),
    _option("--no-python", None, "run the script as a program, without python"),
    _option(
        "--run-path",
        None,
        "run the script with runpy.run_path in a child interpreter; "
        "takes precedence over -m and --no-python",
    ),
    _option("--log-dir", "DIR", "base directory for worker logs (default: a temp dir)"),
    _option(
        "--redirects",
        "SPEC",
        "streams written to log files: 0 none, 1 stdout, 2 stderr, 3 both; "
        "or per local rank, e.g. 0:3,1:1",
        "0",
        short="-r",
    ),
    _option("--tee", "SPEC", "like --redirects, and also shown on the console", "0", short="-t"),
    _option(
        "--local-ranks-filter",
        "RANKS",
        "local ranks whose output reaches the console, e.g. 0,1 (files are unaffected)",
        "",
    ),
    _option(
        "--duplicate-stdout-filters",
        "TEXT,...",
        "tee'd stdout lines containing one of these are also written to "
        "filtered_stdout.log (,, is a literal comma)",
        "",
    ),
    _option("--duplicate-stderr-filters", "TEXT,...", "the same for stderr", ""),
    _option("--node-rank", "N", "this node's rank (static backend only)", "0"),
    _option(
        "--master-addr",
        "HOST",
        "address of the rank-0 node (static backend only); IPv6 as [addr]",
        "127.0.0.1",
    ),
    _option(
        "--master-port",
        "PORT",
        "port on the rank-0 node (static backend only; default 29500); "
        "giving it keeps a single node on the static backend",
    ),
    _option("--local-addr", "HOST", "this node's address (default: the host's FQDN)"),
    _option(
        "--logs-specs",
        "NAME",
        "log layout plugin: an entry point in elastrun.logs_specs or torchrun.logs_specs",
        env=False,
    ),
    _option(
        "--numa-binding",
        "MODE",
        f"bind workers to CPUs near their GPU (or spread over NUMA nodes without GPUs): "
        f"{', '.join(NUMA_BINDINGS)}",
        env=False,
    ),
    _option(
        "--signals-to-handle",
        "SIG,...",
        "signals the launcher traps to stop the workers",
        DEFAULT_SIGNALS,
    ),
    _option(
        "--shutdown-timeout",
        "SECONDS",
        "time workers get to exit before SIGKILL "
        "(default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)",
    ),
    _option(
        "--stuck-exit-timeout",
        "SECONDS",
        "after every other local worker exited successfully, a worker still running this "
        "long gets its stacks dumped and is named in a warning (not stopped); 0 turns it "
        "off (default 60)",
        "60",
        ours=True,
    ),
    _option("--virtual-local-rank", None, "give every worker LOCAL_RANK=0 and only its own GPU"),
    _option(
        "--dry-run",
        None,
        "print the launch plan and exit without starting anything",
        env=False,
        ours=True,
    ),
    _option(
        "--metrics-port",
        "PORT",
        "serve the agent's metrics at http://127.0.0.1:PORT/metrics (Prometheus text format)",
        ours=True,
    ),
    _option(
        "--preload",
        "MOD,...",
        "modules the worker template imports once, before forking workers "
        "(default: torch when the script imports it)",
        "",
        ours=True,
    ),
    _option(
        "--slurm",
        None,
        "inside srun, one elastrun per node: take the node count, run id, rendezvous "
        "endpoint (the first node), this node's address and rank from the Slurm step; "
        "options given explicitly win",
        ours=True,
    ),
    _option(
        "--no-template",
        None,
        "start every Python worker as a fresh interpreter instead of forking it from "
        "the pre-imported template process",
        ours=True,
    ),
)
_BY_DEST = {opt.dest: opt for opt in _OPTIONS}


# --------------------------------------------------------------------------------------
# The parser. argparse only splits argv; defaults, environment fallbacks and
# conversions happen afterwards so that every error can name where its value came from.


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
        seen: set[int] = set()
        unique = []
        for candidate in super()._get_option_tuples(option_string):
            if id(candidate[0]) not in seen:
                seen.add(id(candidate[0]))
                unique.append(candidate)
        return unique


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
    """Build the ``elastrun`` argument parser.

    The parser only splits the command line: each option's value is recorded as it
    was given (or left absent); :func:`parse_launch` applies defaults, ``PET_*``
    fallbacks and validation. Its ``error()`` raises :class:`ConfigError`.
    """
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
    for opt in _OPTIONS:
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


# --------------------------------------------------------------------------------------
# Values: the command line, else PET_<DEST>, else the default; with their source.


class _Values:
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
        if value is None:
            return _BY_DEST[dest].default, source
        return str(value), source

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
        opt = _BY_DEST[dest]
        given = getattr(self._ns, dest, None)
        if isinstance(given, _Given):
            return given.value, given.option
        if opt.env:
            raw = self._environ.get(opt.env_name)
            if raw:
                return raw, opt.env_name
        return None, opt.canonical


# --------------------------------------------------------------------------------------
# Parsers of single values. Each raises ConfigError naming ``source``.


def parse_nnodes(value: str, source: str = "--nnodes") -> tuple[int, int]:
    """Parse ``N`` or ``MIN:MAX`` into ``(min_nodes, max_nodes)``.

    Raises:
        ConfigError: not one or two integers, or not ``1 <= min <= max <= MAX_NODES``.
    """
    parts = value.split(":")
    if len(parts) > 2:
        raise ConfigError(source, value, "must be N or MIN:MAX")
    numbers = []
    for part in parts:
        try:
            numbers.append(parse_int(part, source, low=1, high=MAX_NODES))
        except ConfigError as exc:
            raise ConfigError(source, value, f"N or MIN:MAX: each {exc.reason}") from None
    low, high = numbers[0], numbers[-1]
    if high < low:
        raise ConfigError(source, value, "the maximum must not be below the minimum")
    return low, high


def count_nvidia_gpus(environ: Mapping[str, str], gpus_dir: Path = NVIDIA_GPUS_DIR) -> int:
    """Count the NVIDIA GPUs this process may use, without importing torch.

    The driver lists one entry per GPU under ``/proc/driver/nvidia/gpus``. When
    ``CUDA_VISIBLE_DEVICES`` is set in ``environ`` it narrows the count the way CUDA
    reads it: entries up to the first invalid one, and none at all if one repeats.
    """
    try:
        physical = sum(1 for _ in gpus_dir.iterdir())
    except OSError:
        return 0
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    seen: set[str | int] = set()
    for raw in visible.split(","):
        item = raw.strip()
        ident: str | int
        if item.startswith(("GPU-", "MIG-")):
            ident = item
        else:
            match = re.match(r"[+-]?\d+", item)
            if match is None:
                break
            ident = int(match.group())
            if not 0 <= ident < physical:
                break
        if ident in seen:
            return 0
        seen.add(ident)
    return min(len(seen), physical)


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # pragma: no cover - platforms without affinity masks


def parse_nproc_per_node(
    value: str,
    environ: Mapping[str, str],
    source: str = "--nproc-per-node",
    gpus_dir: Path = NVIDIA_GPUS_DIR,
) -> tuple[int, str | None]:
    """Resolve ``--nproc-per-node`` into a worker count.

    Returns ``(count, device)``: ``device`` is ``"cpu"`` or ``"gpu"`` when the count
    was derived from the machine, None for a plain number.

    Raises:
        ConfigError: not an integer from 1 to ``MAX_NPROC_PER_NODE`` nor ``cpu``,
            ``gpu``, ``auto``; ``gpu`` without any GPU; ``xpu``, which elastrun does not
            support.
    """
    if re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return parse_int(value, source, low=1, high=MAX_NPROC_PER_NODE), None
    if value == "cpu":
        cpus = _cpu_count()
        if cpus > MAX_NPROC_PER_NODE:
            raise ConfigError(
                source, value, f"{cpus} CPUs: more than {MAX_NPROC_PER_NODE} workers per node"
            )
        return cpus, "cpu"
    if value == "gpu":
        gpus = count_nvidia_gpus(environ, gpus_dir)
        if gpus == 0:
            raise ConfigError(source, value, "no GPU found (counted NVIDIA GPUs only)")
        return gpus, "gpu"
    if value == "auto":
        gpus = count_nvidia_gpus(environ, gpus_dir)
        return (gpus, "gpu") if gpus else (_cpu_count(), "cpu")
    if value == "xpu":
        raise ConfigError(source, value, "XPU devices are not supported by elastrun")
    raise ConfigError(
        source, value, f"must be an integer from 1 to {MAX_NPROC_PER_NODE}, cpu, gpu or auto"
    )


def parse_rdzv_conf(value: str, source: str = "--rdzv-conf") -> dict[str, str]:
    """Parse ``KEY=VALUE,KEY=VALUE`` into a dict of strings (torchrun's rules).

    Items are split on ``,`` and each on its first ``=``; keys and values are stripped.

    Raises:
        ConfigError: an item with an empty key or an empty value, naming the item.
    """
    config: dict[str, str] = {}
    if not value.strip():
        return config
    for item in value.strip().split(","):
        key, sep, val = item.partition("=")
        if not key.strip():
            what = "an empty item" if not item.strip() else "an item with an empty key"
            raise ConfigError(source, item, f"{what} in {value!r}; expected KEY=VALUE,...")
        if not sep or not val.strip():
            raise ConfigError(source, item, f"the key {key.strip()!r} has no value")
        config[key.strip()] = val.strip()
    return config


def _to_choice(raw: str, source: str, choices: Sequence[str]) -> str:
    if raw not in choices:
        raise ConfigError(source, raw, f"must be one of {', '.join(choices)}")
    return raw


def _to_std(raw: str, source: str) -> Std | dict[int, Std]:
    try:
        return Std.from_str(raw)
    except ValueError as exc:
        raise ConfigError(source, raw, "must be 0-3, or LOCAL_RANK:0-3,...") from exc


def _parse_filters(values: _Values, dest: str) -> list[str] | None:
    filters = parse_duplicate_filters(values.required(dest)[0])
    return filters or None


# --------------------------------------------------------------------------------------
# Plugins: looked up by name in entry points, never imported for the rendezvous.


def _find_entry_point(groups: Sequence[str], name: str) -> metadata.EntryPoint | None:
    for group in groups:
        for entry in metadata.entry_points(group=group).select(name=name):
            return entry
    return None


def _check_rdzv_backend(name: str, source: str) -> None:
    if name in BUILTIN_RDZV_BACKENDS:
        return
    if _find_entry_point(RDZV_ENTRY_POINT_GROUPS, name) is None:
        raise ConfigError(
            source,
            name,
            f"unknown rendezvous backend; built in: {', '.join(BUILTIN_RDZV_BACKENDS)}, "
            f"plugins: entry points in {' or '.join(RDZV_ENTRY_POINT_GROUPS)}",
        )


def _build_logs_specs(
    *,
    name: str | None,
    source: str,
    log_dir: str | None,
    redirects: Std | dict[int, Std],
    tee: Std | dict[int, Std],
    local_ranks_filter: set[int] | None,
) -> LogsSpecs:
    factory: object = DefaultLogsSpecs
    # ``default`` is ours even though torch registers the same name: loading torch's
    # entry point would import torch into the launcher.
    if name is not None and name != "default":
        entry = _find_entry_point(LOGS_SPECS_ENTRY_POINT_GROUPS, name)
        if entry is None:
            groups = " or ".join(LOGS_SPECS_ENTRY_POINT_GROUPS)
            raise ConfigError(source, name, f"no entry point of that name in {groups}")
        try:
            factory = entry.load()
        except Exception as exc:  # a plugin can fail to import in any way
            raise ConfigError(source, name, f"cannot load {entry.value}: {exc}") from exc
    if not callable(factory):
        raise ConfigError(source, name, "the entry point is not a class")
    try:
        specs = factory(
            log_dir=log_dir, redirects=redirects, tee=tee, local_ranks_filter=local_ranks_filter
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(source, name, f"cannot be built: {exc}") from exc
    if not isinstance(specs, LogsSpecs):
        raise ConfigError(source, name, f"built a {type(specs).__name__}, not a LogsSpecs")
    return specs


# --------------------------------------------------------------------------------------
# The entrypoint.


def _script_kind(values: _Values, notices: list[str]) -> ScriptKind:
    module, no_python = values.flag("module"), values.flag("no_python")
    if module and no_python:
        raise ConfigError(values.source("no_python"), True, "cannot be combined with -m/--module")
    if values.flag("run_path"):
        if module or no_python:
            notices.append("--run-path takes precedence over -m/--module and --no-python")
        return ScriptKind.RUN_PATH
    if module:
        return ScriptKind.MODULE
    return ScriptKind.BINARY if no_python else ScriptKind.SCRIPT


def _check_script(kind: ScriptKind, script: str, environ: Mapping[str, str]) -> None:
    if kind is ScriptKind.MODULE:
        return  # importing it here would run user code in the launcher
    if kind is ScriptKind.BINARY:
        if shutil.which(script, path=environ.get("PATH", os.defpath)) is None:
            where = "is not an executable file" if os.sep in script else "is not found on PATH"
            raise ConfigError("script", script, f"{where} (--no-python)")
        return
    if not os.path.exists(script):
        raise ConfigError("script", script, "no such file")


# --------------------------------------------------------------------------------------
# The steps of parse_launch.


def _split_argv(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    try:
        namespace, extras = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise _translate_argparse_error(exc.message, exc.argument_name) from None
    if extras:
        raise _translate_argparse_error(f"unrecognized arguments: {' '.join(extras)}")
    return namespace


def _sizes(values: _Values, environ: Mapping[str, str], notices: list[str]) -> tuple[int, int, int]:
    min_nodes, max_nodes = parse_nnodes(*values.required("nnodes"))
    nproc_raw, nproc_source = values.required("nproc_per_node")
    nproc, device = parse_nproc_per_node(nproc_raw, environ, nproc_source)
    if device is not None:
        notices.append(f"{nproc_source}={nproc_raw}: starting {nproc} workers, one per {device}")
    if "OMP_NUM_THREADS" not in environ and nproc > 1:
        # torchrun writes this into its own os.environ; we only report it, and the
        # launcher exports it to the workers.
        notices.append(
            "OMP_NUM_THREADS is not set: each worker gets OMP_NUM_THREADS=1 so that "
            f"{nproc} workers do not overload the machine; set it to tune performance"
        )
    return min_nodes, max_nodes, nproc


@dataclass(frozen=True)
class _Rendezvous:
    backend: str
    endpoint: str
    run_id: str
    configs: dict[str, str]
    standalone: bool
    node_rank: int
    master_addr: str
    master_port: int


def _rendezvous(
    values: _Values, max_nodes: int, notices: list[str], slurm: SlurmSettings | None = None
) -> _Rendezvous:
    """torchrun's run()/config_from_args() rendezvous steps (standalone, static), then
    ``--slurm``'s settings for whatever the user did not give."""
    configs = parse_rdzv_conf(*values.required("rdzv_conf"))
    node_rank = parse_int(*values.required("node_rank"), low=0, high=MAX_NODES - 1)
    port_raw, port_source = values.text("master_port")
    master_port = None if port_raw is None else parse_port(port_raw, port_source)
    master_addr, master_addr_source = values.required("master_addr")
    backend, backend_source = values.required("rdzv_backend")
    endpoint, _ = values.required("rdzv_endpoint")
    run_id, _ = values.required("rdzv_id")

    if slurm is not None:
        backend = backend if values.given("rdzv_backend") else "c10d"
        endpoint = slurm.endpoint
        run_id = run_id if values.given("rdzv_id") else slurm.run_id
        if backend == "static" and not values.given("node_rank"):
            node_rank = slurm.node_rank
        if slurm.is_host is not None:
            configs.setdefault("is_host", "true" if slurm.is_host else "false")

    standalone = values.flag("standalone")
    if standalone:
        ignored = [
            values.source(dest)
            for dest in ("rdzv_backend", "rdzv_endpoint", "rdzv_id")
            if values.given(dest)
        ]
        if ignored:
            notices.append(f"--standalone: ignoring {', '.join(ignored)}")
        why = "--standalone"
    elif backend == "static" and not endpoint and master_port is None and max_nodes == 1:
        # torchrun's implicit standalone: a plain single-node launch needs no master.
        standalone = True
        why = "one node and no --master-port or --rdzv-endpoint"
    if standalone:
        backend, endpoint, run_id = "c10d", "localhost:0", str(uuid.uuid4())
        notices.append(
            f"running standalone ({why}): rendezvous backend c10d on localhost:0 "
            f"(a free port), run id {run_id}"
        )
    else:
        _check_rdzv_backend(backend, backend_source)
    if master_port is None:
        master_port = DEFAULT_MASTER_PORT
    if max_nodes > 1 and not run_id.strip():
        raise ConfigError(
            values.source("rdzv_id"),
            run_id,
            "must not be empty for a multi-node job: every node needs the same run id",
        )

    if backend == "static":
        if node_rank >= max_nodes:
            raise ConfigError(
                values.source("node_rank"),
                node_rank,
                f"must be below the number of nodes ({max_nodes}) with the static backend",
            )
        configs["rank"] = str(node_rank)  # overrides a rank= in --rdzv-conf, as torchrun
        endpoint = endpoint or _master_endpoint(master_addr, master_addr_source, master_port)
    else:
        if values.given("master_addr") and not endpoint:
            notices.append(f"{master_addr_source} is only used by the static backend; ignored")
        if node_rank != 0:
            notices.append(f"{values.source('node_rank')} is only used by the static backend")
    return _Rendezvous(
        backend, endpoint, run_id, configs, standalone, node_rank, master_addr, master_port
    )


def _master_endpoint(addr: str, source: str, port: int) -> str:
    """``--master-addr`` and ``--master-port`` as the static backend's endpoint.

    A bare IPv6 address gets its brackets (torchrun would glue the port onto it).
    """
    host, given_port = parse_host_port(addr, source, None)
    if given_port is not None:
        raise ConfigError(source, addr, "give the address only; the port is --master-port")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _logs_specs(values: _Values, nproc: int) -> LogsSpecs:
    ranks_raw, ranks_source = values.required("local_ranks_filter")
    try:
        ranks = parse_local_ranks_filter(ranks_raw)
    except ValueError as exc:
        raise ConfigError(
            ranks_source, ranks_raw, "must be a comma-separated list of local ranks"
        ) from exc
    _check_local_ranks(ranks or (), nproc, ranks_raw, ranks_source)
    streams = {}
    for dest in ("redirects", "tee"):
        raw, source = values.required(dest)
        streams[dest] = std = _to_std(raw, source)
        if isinstance(std, dict):
            _check_local_ranks(std, nproc, raw, source)
    name, source = values.text("logs_specs")
    log_dir, log_dir_source = values.text("log_dir")
    specs = _build_logs_specs(
        name=name,
        source=source,
        log_dir=log_dir,
        redirects=streams["redirects"],
        tee=streams["tee"],
        local_ranks_filter=ranks,
    )
    if isinstance(specs, DefaultLogsSpecs) and log_dir and log_dir != os.devnull:
        check_log_dir(log_dir, log_dir_source)
    return specs


def _check_local_ranks(ranks: Iterable[int], nproc: int, raw: str, source: str) -> None:
    """A local rank that no worker of this node has is a typo, not an empty filter."""
    missing = sorted(rank for rank in ranks if rank >= nproc)
    if missing:
        raise ConfigError(
            source,
            raw,
            f"local rank {missing[0]} does not exist: this node runs {nproc} worker(s), "
            f"local ranks 0 to {nproc - 1}",
        )


def _numa_options(mode: str | None) -> object | None:
    if mode is None:
        return None
    from elastrun.supervise.processes.numa import AffinityMode, NumaOptions

    return NumaOptions(AffinityMode(mode))


def _event_handler(raw: str, source: str) -> str:
    from elastrun.observe.eventlog import FILE_PREFIX, make_event_sink

    make_event_sink(raw, field=source)  # validates only: no file is opened yet
    if raw.startswith(FILE_PREFIX):
        check_writable_file(raw[len(FILE_PREFIX) :], source, raw)
    return raw


def _refuse_not_implemented(values: _Values, backend: str) -> None:
    if backend == "etcd-v2":
        from elastrun.rendezvous.etcd import ETCD_V2_REASON

        raise ConfigError(values.source("rdzv_backend"), backend, ETCD_V2_REASON)


def _slurm(values: _Values, environ: Mapping[str, str], notices: list[str]) -> SlurmSettings | None:
    if not values.flag("slurm"):
        return None
    if values.flag("standalone"):
        raise ConfigError(values.source("standalone"), True, "cannot be combined with --slurm")
    from elastrun.launch.slurm import slurm_overrides

    settings = slurm_overrides(environ, rdzv_endpoint=values.text("rdzv_endpoint")[0] or "")
    notices.extend(settings.notices)
    return settings


def _python(kind: ScriptKind, environ: Mapping[str, str]) -> str:
    """The interpreter of script and module workers: ``PYTHON_EXEC``, else ours."""
    python = environ.get("PYTHON_EXEC") or sys.executable
    if kind not in (ScriptKind.SCRIPT, ScriptKind.MODULE) or not environ.get("PYTHON_EXEC"):
        return python
    if shutil.which(python, path=environ.get("PATH", os.defpath)) is None:
        where = "is not an executable file" if os.sep in python else "is not found on PATH"
        raise ConfigError("PYTHON_EXEC", python, where)
    return python


def _blame(exc: ConfigError, sources: Mapping[str, str]) -> ConfigError:
    """Name the option as the user gave it (a variable or the other spelling), also in
    ``--rdzv-conf KEY`` fields."""
    option, space, rest = exc.field.partition(" ")
    given = sources.get(option, option)
    if given == option:
        return exc
    return ConfigError(given + space + rest, exc.value, exc.reason)


def parse_launch(argv: Sequence[str], environ: Mapping[str, str]) -> Launch:
    """Parse an ``elastrun`` command line into a validated :class:`Launch`.

    Args:
        argv: the arguments after the program name.
        environ: the environment to read ``PET_*``, ``PYTHON_EXEC``, ``PATH``,
            ``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES`` and
            ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` from, and to check the agent's
            torch variables in (``TORCHELASTIC_HEALTH_CHECK_PORT``...); it is never
            modified. (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is read by
            :class:`LaunchConfig` from the process environment.)

    Everything that would only fail once something started is checked here too: the
    rendezvous parameters as the backend will read them, the log directory, the event
    log and the interpreter.

    Raises:
        ConfigError: any invalid option, variable or script, naming it and the value;
            also ``etcd-v2``, whose etcd API is gone (use ``etcd``).
        SystemExit: only for ``-h``/``--help``, after printing the help.
    """
    namespace = _split_argv(argv)
    values = _Values(namespace, environ)
    notices: list[str] = []
    min_nodes, max_nodes, nproc = _sizes(values, environ, notices)
    slurm = _slurm(values, environ, notices)
    if slurm is not None and not values.given("nnodes"):
        min_nodes = max_nodes = slurm.nnodes
    max_restarts = parse_int(*values.required("max_restarts"), low=0)
    monitor_interval = parse_seconds(*values.required("monitor_interval"), low_open=True)
    timeout_raw, timeout_source = values.text("shutdown_timeout")
    shutdown_timeout = None if timeout_raw is None else parse_seconds(timeout_raw, timeout_source)
    stuck_exit_timeout = parse_seconds(*values.required("stuck_exit_timeout"))
    start_method = _to_choice(*values.required("start_method"), START_METHODS)
    events = _event_handler(*values.required("event_log_handler"))
    metrics_raw, metrics_source = values.text("metrics_port")
    metrics_port = None if metrics_raw is None else parse_port(metrics_raw, metrics_source)
    preload_raw, _ = values.required("preload")
    preload = tuple(m.strip() for m in preload_raw.split(",") if m.strip())
    numa_raw, numa_source = values.text("numa_binding")
    numa = None if numa_raw is None else _to_choice(numa_raw, numa_source, NUMA_BINDINGS)
    signals, signals_source = values.required("signals_to_handle")
    role, _ = values.required("role")
    try:
        parse_signals(signals)
    except ConfigError as exc:
        raise ConfigError(signals_source, exc.value, exc.reason) from None
    rdzv = _rendezvous(values, max_nodes, notices, slurm)
    kind = _script_kind(values, notices)
    script: str = namespace.training_script
    _check_script(kind, script, environ)
    logs_specs = _logs_specs(values, nproc)
    python = _python(kind, environ)
    # Everything is valid; now what this version cannot do yet.
    _refuse_not_implemented(values, rdzv.backend)

    sources = {opt.canonical: values.source(opt.dest) for opt in _OPTIONS}
    try:
        config = LaunchConfig(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            nproc_per_node=nproc,
            logs_specs=logs_specs,
            run_id=rdzv.run_id,
            role=role,
            rdzv_endpoint=rdzv.endpoint,
            rdzv_backend=rdzv.backend,
            rdzv_configs=rdzv.configs,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            start_method=start_method,
            log_line_prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
            local_addr=values.text("local_addr")[0] or (slurm.local_addr if slurm else None),
            event_log_handler=events,
            numa_options=_numa_options(numa),
            metrics_port=metrics_port,
            preload=preload,
            use_template=not values.flag("no_template"),
            signals_to_handle=signals,
            duplicate_stdout_filters=_parse_filters(values, "duplicate_stdout_filters"),
            duplicate_stderr_filters=_parse_filters(values, "duplicate_stderr_filters"),
            virtual_local_rank=values.flag("virtual_local_rank"),
            shutdown_timeout=shutdown_timeout,
            stuck_exit_timeout=stuck_exit_timeout,
            node_rank=rdzv.node_rank,
            master_addr=rdzv.master_addr,
            master_port=rdzv.master_port,
        )
        config.check_before_start(environ)
    except ConfigError as exc:
        raise _blame(exc, sources) from exc
    return Launch(
        config=config,
        kind=kind,
        script=script,
        script_args=tuple(namespace.training_script_args),
        python=python,
        dry_run=values.flag("dry_run"),
        standalone=rdzv.standalone,
        notices=tuple(notices),
    )
