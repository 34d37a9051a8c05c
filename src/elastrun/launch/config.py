"""``LaunchConfig``: the validated, frozen description of one launch.

Field names and meanings follow torch's ``torch.distributed.launcher.api.LaunchConfig``.
Differences: the default rendezvous backend is ``c10d`` (a single node with no
endpoint then runs standalone, needing no external service), validation raises
``ConfigError`` naming the field, and a few fields of ours are added at the end.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastrun.core.errors import ConfigError
from elastrun.core.values import (
    MAX_SECONDS,
    check_host,
    parse_host_port,
    parse_int,
    parse_port,
    parse_seconds,
)
from elastrun.nodecheck.agent.verdicts import NodeCheckRule
from elastrun.pace.agent.hang import AutoTimeout, parse_hang_timeout
from elastrun.pace.agent.straggler import StragglerSettings
from elastrun.rendezvous.exclusion import ExclusionRule
from elastrun.wire.env import SHUTDOWN_TIMEOUT_ENV, STORE_ENGINE_ENV

if TYPE_CHECKING:
    from elastrun.agent.options import AgentOptions
    from elastrun.agent.spec import Entrypoint, WorkerSpec
    from elastrun.rendezvous.api import RendezvousHandler, RendezvousParameters
    from elastrun.supervise.processes.logs import LogsSpecs
    from elastrun.supervise.processes.numa import NumaOptions

#: The c10d backend's port when the endpoint names none (torchrun's).
C10D_DEFAULT_PORT = 29400
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
START_METHODS = ("spawn", "fork", "forkserver")
#: Upper bounds: beyond them a value is a typo (and some would take minutes to plan).
MAX_NODES = 100_000
MAX_NPROC_PER_NODE = 1024
#: A run id names the log directory ``<run_id>_<random>``, one path component: most file
#: systems cap that at 255 bytes (a longer id would send every attempt's output to the
#: console instead). 200 leaves room for the random suffix.
MAX_RUN_ID_BYTES = 200


@dataclass(frozen=True)
class LaunchConfig:
    """Everything the launcher needs besides the entrypoint and its arguments.

    Raises:
        ConfigError: for an invalid value, naming the field.
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: LogsSpecs | None = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "c10d"
    rdzv_configs: dict[str, str] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: NumaOptions | str | None = None  # a mode name is taken too
    signals_to_handle: str = DEFAULT_SIGNALS
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: float | None = None
    # --- elastrun's own fields -------------------------------------------------
    #: Static backend only: this node's rank and the rendezvous master address.
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    exit_barrier_timeout: float = 300.0
    #: Seconds a worker may run on after its local peers all exited successfully before
    #: it is reported with its stacks (0: never).
    stuck_exit_timeout: float = 60.0
    #: Seconds without progress after which a reporting worker is hung, "auto", or None.
    hang_timeout: float | str | AutoTimeout | None = None
    #: Restarts in a row without progress before giving up (exit 93); 0: never.
    stalled_restarts: int = 3
    #: Stop restarting (exit 93) when a rank fails the same way at the same step twice.
    crash_loop_stop: bool = True
    #: When a node whose workers keep failing sits out a cool-down (off by default).
    exclusion: ExclusionRule = ExclusionRule()  # noqa: RUF009 (frozen)
    #: Whether and how a node is checked before it joins (off by default).
    node_check: NodeCheckRule = NodeCheckRule()  # noqa: RUF009 (frozen)
    #: How stragglers are found and reported (None: not at all).
    stragglers: StragglerSettings | None = StragglerSettings()  # noqa: RUF009 (frozen)
    #: Serve the agent's metrics in Prometheus format on this port (None: off).
    metrics_port: int | None = None
    #: Modules the worker template pre-imports (Python script workers).
    preload: tuple[str, ...] = ()
    #: Fork Python script workers from a pre-imported template process.
    use_template: bool = True

    def __post_init__(self) -> None:
        self._check_numbers()
        if self.max_nodes < self.min_nodes:
            raise ConfigError(
                "--nnodes",
                f"{self.min_nodes}:{self.max_nodes}",
                "the maximum must not be below the minimum",
            )
        if self.start_method not in START_METHODS:
            raise ConfigError(
                "--start-method", self.start_method, f"must be one of {', '.join(START_METHODS)}"
            )
        parse_signals(self.signals_to_handle)
        # torch injects the legacy rendezvous timeout into the rendezvous configuration.
        configs = dict(self.rdzv_configs)
        if self.rdzv_timeout != -1:
            configs["timeout"] = str(self.rdzv_timeout)
        else:
            configs.setdefault("timeout", "900")
        parse_seconds(configs["timeout"], "--rdzv-conf timeout", low_open=True)
        if (barrier := configs.get("exit_barrier_timeout")) is not None:
            seconds = parse_seconds(barrier, "--rdzv-conf exit_barrier_timeout")
            object.__setattr__(self, "exit_barrier_timeout", seconds)
        object.__setattr__(self, "rdzv_configs", configs)
        self._check_metrics_port()
        # Explicit, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 seconds.
        if self.shutdown_timeout is not None:
            resolved = parse_seconds(self.shutdown_timeout, "--shutdown-timeout")
        else:
            raw = os.environ.get(SHUTDOWN_TIMEOUT_ENV, "").strip()
            resolved = parse_seconds(raw, SHUTDOWN_TIMEOUT_ENV) if raw else DEFAULT_SHUTDOWN_TIMEOUT
        object.__setattr__(self, "shutdown_timeout", resolved)

    def _check_numbers(self) -> None:
        """Every number through the one checker (a Python caller may pass NaN)."""
        parse_int(self.min_nodes, "--nnodes", low=1, high=MAX_NODES)
        parse_int(self.max_nodes, "--nnodes", low=1, high=MAX_NODES)
        parse_int(self.nproc_per_node, "--nproc-per-node", low=1, high=MAX_NPROC_PER_NODE)
        parse_int(self.max_restarts, "--max-restarts", low=0)
        parse_seconds(self.monitor_interval, "--monitor-interval", low_open=True)
        parse_seconds(self.exit_barrier_timeout, "exit_barrier_timeout")
        parse_seconds(self.stuck_exit_timeout, "--stuck-exit-timeout")
        parse_int(self.stalled_restarts, "--stalled-restarts", low=0)
        if self.hang_timeout is not None and not isinstance(self.hang_timeout, AutoTimeout):
            object.__setattr__(
                self, "hang_timeout", parse_hang_timeout(self.hang_timeout, "--hang-timeout")
            )
        parse_int(self.node_rank, "--node-rank", low=0, high=MAX_NODES - 1)
        size = len(self.run_id.encode("utf-8", "surrogatepass"))
        if size > MAX_RUN_ID_BYTES:
            shown = self.run_id if len(self.run_id) <= 40 else f"{self.run_id[:40]}..."
            why = f"is {size} bytes long; at most {MAX_RUN_ID_BYTES} (it names the log directory)"
            raise ConfigError("--rdzv-id", shown, why)
        if self.local_addr:  # empty: this host's name, as None
            check_host(self.local_addr, "--local-addr")
        if self.rdzv_timeout != -1:
            parse_int(self.rdzv_timeout, "rdzv_timeout", low=1, high=MAX_SECONDS)
        ports = (("--master-port", self.master_port), ("--metrics-port", self.metrics_port))
        for name, port in ports:
            if port is not None:
                parse_port(port, name)

    def _check_metrics_port(self) -> None:
        """The metrics endpoint must not take the rendezvous store's port.

        Whichever binds first wins, and the store lost: the job failed a minute later
        blaming the store. Refused whatever the endpoint's host: every node runs the
        same command, so the node that serves the store would collide.
        """
        if self.metrics_port is None or self.rdzv_backend not in ("c10d", "static"):
            return
        try:
            _, port = parse_host_port(self.rdzv_endpoint, "--rdzv-endpoint", C10D_DEFAULT_PORT)
        except ConfigError:
            return  # the rendezvous check reports a bad endpoint
        if port == self.metrics_port:
            raise ConfigError(
                "--metrics-port",
                self.metrics_port,
                f"is the rendezvous store's port ({self.rdzv_endpoint}); choose another",
            )

    def rendezvous_parameters(self, run_id: str | None = None) -> RendezvousParameters:
        """The rendezvous handler's parameters (``run_id`` overrides the config's)."""
        from elastrun.rendezvous.api import RendezvousParameters

        return RendezvousParameters(
            self.rdzv_backend,
            self.rdzv_endpoint,
            self.run_id if run_id is None else run_id,
            self.min_nodes,
            self.max_nodes,
            self.local_addr,
            **self.rdzv_configs,
        )

    def worker_spec(
        self,
        handler: RendezvousHandler | None,
        entrypoint: Entrypoint,
        args: Sequence[object],
    ) -> WorkerSpec:
        """What this node's agent runs (``handler`` None: this node runs alone)."""
        from elastrun.agent.spec import WorkerSpec

        return WorkerSpec(
            role=self.role,
            local_world_size=self.nproc_per_node,
            rdzv_handler=handler,
            entrypoint=entrypoint,
            args=tuple(args),
            max_restarts=self.max_restarts,
            monitor_interval=self.monitor_interval,
            local_addr=self.local_addr,
            event_log_handler=self.event_log_handler,
            numa_options=self.numa_options,
            duplicate_stdout_filters=self.duplicate_stdout_filters,
            duplicate_stderr_filters=self.duplicate_stderr_filters,
            virtual_local_rank=self.virtual_local_rank,
        )

    def agent_options(self, environ: Mapping[str, str]) -> AgentOptions:
        """The options of this node's agent, whose environment is ``environ`` (the
        settings it holds are read from it: ``AgentOptions.from_environ``). A zero
        ``stuck_exit_timeout`` or ``stalled_restarts`` turns that check off.

        Raises:
            ConfigError: a variable of ``environ`` with a bad value, named.
        """
        from elastrun.agent.options import AgentOptions

        assert self.shutdown_timeout is not None  # resolved in __post_init__
        return AgentOptions.from_environ(
            environ,
            start_method=self.start_method,
            exit_barrier_timeout=self.exit_barrier_timeout,
            log_line_prefix_template=self.log_line_prefix_template,
            shutdown_timeout=self.shutdown_timeout,
            stuck_exit_timeout=self.stuck_exit_timeout or None,
            stalled_restarts=self.stalled_restarts or None,
            crash_loop_stop=self.crash_loop_stop,
            exclusion=self.exclusion,
            node_check=self.node_check,
            stragglers=self.stragglers,
            hang_timeout=self.hang_timeout,
        )

    def check_before_start(self, environ: Mapping[str, str]) -> None:
        """Refuse what would only fail later, before anything starts.

        Checks the rendezvous parameters the way the built-in backend will read them
        (without connecting), the variables the agent reads (the torch ones, with the
        file timer's FIFO path, and ``ELASTRUN_STORE_ENGINE``: an engine this install
        has), and a :class:`DefaultLogsSpecs`' log directory.

        Raises:
            ConfigError: naming the option, ``--rdzv-conf`` key or variable; ``log_dir``
                for a log directory that is a file or cannot be written (torch raises
                NotADirectoryError from ``DefaultLogsSpecs()`` for a file; ours does no
                I/O when built, and the agent would have sent every attempt's output
                to the console instead, as after a full disk).
        """
        from elastrun.launch.paths import check_fifo_path, check_log_dir
        from elastrun.observe.health import port_from_env
        from elastrun.rendezvous.registry import rendezvous_handler_registry
        from elastrun.supervise.processes.dstate import timeout_from_env
        from elastrun.supervise.processes.logs import DefaultLogsSpecs
        from elastrun.wire.timer import TORCHELASTIC_TIMER_FILE, file_timer_enabled

        rendezvous_handler_registry.check(self.rendezvous_parameters(self.run_id or "check"))
        # TORCHELASTIC_HEALTH_CHECK_PORT, TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT and
        # TORCHELASTIC_ENABLE_FILE_TIMER are read by the functions the agent's wiring uses;
        # torchrun ignores a bad value of each, silently or with a log line.
        port_from_env(environ)
        timeout_from_env(environ)
        # The store's package only for a name other than the default (empty counts as
        # unset, as an empty PET_* variable does).
        if environ.get(STORE_ENGINE_ENV, "") not in ("", "auto"):
            from elastrun.store.torchwire.engine import choose_engine

            choose_engine(environ=environ)
        # With the file timer on, the agent makes its FIFO there.
        if file_timer_enabled(environ) and environ.get(TORCHELASTIC_TIMER_FILE):
            check_fifo_path(environ[TORCHELASTIC_TIMER_FILE], TORCHELASTIC_TIMER_FILE)
        specs = self.logs_specs
        if isinstance(specs, DefaultLogsSpecs) and not specs.is_temporary and not specs.is_devnull:
            check_log_dir(str(specs.log_dir), "log_dir")


#: Signals whose default action is not to end a process. The launcher treats every
#: handled signal as "stop the job", so handling one of these turns an everyday event
#: into a stop: SIGCHLD arrives at the first worker exit, SIGWINCH at a terminal resize,
#: SIGCONT after every resume. torchrun takes any name; refusing them up front is
#: kinder than a job that stops itself with status 128+N.
NOT_TERMINATING = frozenset(
    getattr(signal, name)
    for name in ("SIGCHLD", "SIGCONT", "SIGURG", "SIGWINCH", "SIGTSTP", "SIGTTIN", "SIGTTOU")
    if hasattr(signal, name)
)


def parse_signals(spec: str) -> tuple[signal.Signals, ...]:
    """Parse ``"SIGTERM,SIGINT"`` into signals.

    Raises:
        ConfigError: an unknown name, SIGKILL or SIGSTOP (they cannot be handled), or a
            signal that does not end a process by default (:data:`NOT_TERMINATING`).
    """
    out: list[signal.Signals] = []
    for raw in spec.split(","):
        name = raw.strip()
        if not name:
            continue
        try:
            sig = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        except KeyError:
            raise ConfigError("--signals-to-handle", name, "is not a signal name") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError("--signals-to-handle", name, "cannot be handled")
        if sig in NOT_TERMINATING:
            raise ConfigError(
                "--signals-to-handle",
                name,
                "does not ask a process to end (the job would stop at the first one "
                "the system sends); handle termination signals only",
            )
        if sig not in out:
            out.append(sig)
    return tuple(out)
