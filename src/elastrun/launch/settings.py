"""The launch's own settings read from options: sizes, restarts, intervals, handlers.

Each is converted and checked once here; the errors name the option or ``PET_*``
variable the value came from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypedDict

from elastrun.core.errors import ConfigError
from elastrun.core.values import check_number, parse_int, parse_port, parse_seconds
from elastrun.launch.argv import Values
from elastrun.launch.config import START_METHODS, parse_signals
from elastrun.launch.options import NUMA_BINDINGS
from elastrun.launch.parsers import parse_nnodes, parse_nproc_per_node, to_choice
from elastrun.launch.paths import check_writable_file
from elastrun.nodecheck.agent.verdicts import NodeCheckRule
from elastrun.pace.agent.hang import AutoTimeout, parse_hang_timeout
from elastrun.pace.agent.straggler import StragglerSettings, parse_straggler_factor
from elastrun.rendezvous.exclusion import ExclusionRule

if TYPE_CHECKING:
    from elastrun.supervise.processes.numa import NumaOptions

__all__ = ["Runtime", "runtime_settings", "sizes"]


def sizes(values: Values, environ: Mapping[str, str], notices: list[str]) -> tuple[int, int, int]:
    """``(min_nodes, max_nodes, nproc_per_node)``, and the notices they call for.

    Raises:
        ConfigError: a bad ``--nnodes`` or ``--nproc-per-node``.
    """
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


class Runtime(TypedDict):
    """How the agent runs and restarts the workers, and what it reports where: fields
    of ``LaunchConfig``, which takes them as they are (``LaunchConfig(**runtime, ...)``)."""

    max_restarts: int
    monitor_interval: float
    shutdown_timeout: float | None
    stuck_exit_timeout: float
    hang_timeout: float | AutoTimeout | None
    stalled_restarts: int
    exclusion: ExclusionRule
    node_check: NodeCheckRule
    stragglers: StragglerSettings | None
    start_method: str
    event_log_handler: str
    metrics_port: int | None
    preload: tuple[str, ...]
    numa_options: NumaOptions | str | None
    signals_to_handle: str
    role: str


def runtime_settings(values: Values) -> Runtime:
    """Restarts, intervals, timeouts, start method, handlers, preload, NUMA and signals.

    Raises:
        ConfigError: the first bad value, naming its option or variable.
    """
    preload_raw, _ = values.required("preload")
    # The keywords in the order the values are checked: the first bad one is reported.
    return Runtime(
        max_restarts=parse_int(*values.required("max_restarts"), low=0),
        monitor_interval=parse_seconds(*values.required("monitor_interval"), low_open=True),
        shutdown_timeout=values.parsed("shutdown_timeout", parse_seconds),
        stuck_exit_timeout=parse_seconds(*values.required("stuck_exit_timeout")),
        stalled_restarts=parse_int(*values.required("stalled_restarts"), low=0),
        exclusion=ExclusionRule(
            after=parse_int(*values.required("exclude_after"), low=0),
            window=parse_seconds(*values.required("exclude_window"), low_open=True),
            cooldown=parse_seconds(*values.required("exclude_cooldown"), low_open=True),
            exits=values.flag("exclude_exit"),
        ),
        hang_timeout=values.parsed("hang_timeout", parse_hang_timeout),
        stragglers=_stragglers(values),
        start_method=to_choice(*values.required("start_method"), START_METHODS),
        event_log_handler=_event_handler(*values.required("event_log_handler")),
        metrics_port=values.parsed("metrics_port", parse_port),
        preload=tuple(m.strip() for m in preload_raw.split(",") if m.strip()),
        numa_options=_numa_options(values),
        signals_to_handle=_signals(*values.required("signals_to_handle")),
        role=values.required("role")[0],
        node_check=_node_check(values),
    )


def _signals(signals: str, source: str) -> str:
    """``--signals-to-handle``, checked (the error names where the value came from)."""
    try:
        parse_signals(signals)
    except ConfigError as exc:
        raise ConfigError(source, exc.value, exc.reason) from None
    return signals


def _stragglers(values: Values) -> StragglerSettings | None:
    """``--straggler-factor`` and ``--straggler-window`` (None: detection off)."""
    factor = parse_straggler_factor(*values.required("straggler_factor"))
    window = parse_seconds(*values.required("straggler_window"), low_open=True)
    return None if factor is None else StragglerSettings(factor=factor, window=window)


def _node_check(values: Values) -> NodeCheckRule:
    """``--node-check`` and its timeout, script and slowdown (read even when it is off,
    so that a bad value is named at once)."""
    script, script_source = values.text("node_check_script")
    # Found here, not on each node at its first check (where every node would fail).
    if script and not os.path.isfile(script):
        raise ConfigError(script_source, script, "is not a file")
    if script and not script.endswith(".py") and not os.access(script, os.X_OK):
        raise ConfigError(
            script_source, script, "is not executable (only a .py file is run with python)"
        )
    if script and not os.access(script, os.R_OK):
        raise ConfigError(script_source, script, "is not readable")
    slowdown, slowdown_source = values.required("node_check_slowdown")
    return NodeCheckRule(
        enabled=values.flag("node_check"),
        timeout=parse_seconds(*values.required("node_check_timeout"), low_open=True),
        script=script or None,
        slowdown=check_number(slowdown, slowdown_source, low=1.0, low_open=True),
    )


def _numa_options(values: Values) -> NumaOptions | None:
    mode = values.parsed("numa_binding", lambda raw, src: to_choice(raw, src, NUMA_BINDINGS))
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
