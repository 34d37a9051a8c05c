"""``LaunchConfig``: the validated, frozen description of one launch.

Field names and meanings follow torch's ``torch.distributed.launcher.api.LaunchConfig``.
Differences: the default rendezvous backend is ``c10d`` (a single node with no
endpoint then runs standalone, needing no external service), validation raises
``ConfigError`` naming the field, and a few fields of ours are added at the end.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastrun.core.errors import ConfigError

if TYPE_CHECKING:
    from elastrun.supervise.processes.logs import LogsSpecs

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
START_METHODS = ("spawn", "fork", "forkserver")


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
    numa_options: object | None = None
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
    #: Serve the agent's metrics in Prometheus format on this port (None: off).
    metrics_port: int | None = None
    #: Modules the worker template pre-imports (Python script workers).
    preload: tuple[str, ...] = ()
    #: Fork Python script workers from a pre-imported template process.
    use_template: bool = True

    def __post_init__(self) -> None:
        if self.min_nodes <= 0:
            raise ConfigError("--nnodes", self.min_nodes, "the minimum must be at least 1")
        if self.max_nodes < self.min_nodes:
            raise ConfigError(
                "--nnodes",
                f"{self.min_nodes}:{self.max_nodes}",
                "the maximum must not be below the minimum",
            )
        if self.nproc_per_node <= 0:
            raise ConfigError("--nproc-per-node", self.nproc_per_node, "must be at least 1")
        if self.max_restarts < 0:
            raise ConfigError("--max-restarts", self.max_restarts, "must be >= 0")
        if self.monitor_interval <= 0:
            raise ConfigError("--monitor-interval", self.monitor_interval, "must be > 0")
        if self.start_method not in START_METHODS:
            raise ConfigError(
                "--start-method", self.start_method, f"must be one of {', '.join(START_METHODS)}"
            )
        if self.exit_barrier_timeout < 0:
            raise ConfigError("exit_barrier_timeout", self.exit_barrier_timeout, "must be >= 0")
        parse_signals(self.signals_to_handle)
        # torch injects the legacy rendezvous timeout into the rendezvous configuration.
        configs = dict(self.rdzv_configs)
        if self.rdzv_timeout != -1:
            configs["timeout"] = str(self.rdzv_timeout)
        else:
            configs.setdefault("timeout", "900")
        object.__setattr__(self, "rdzv_configs", configs)
        object.__setattr__(
            self, "shutdown_timeout", resolve_shutdown_timeout(self.shutdown_timeout)
        )

    @property
    def effective_shutdown_timeout(self) -> float:
        assert self.shutdown_timeout is not None  # resolved in __post_init__
        return self.shutdown_timeout


def resolve_shutdown_timeout(value: float | None) -> float:
    """Explicit value, else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 seconds."""
    source = "--shutdown-timeout"
    if value is None:
        raw = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
        if raw is None or raw == "":
            return DEFAULT_SHUTDOWN_TIMEOUT
        source = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(source, raw, "must be a number of seconds") from None
    if value < 0:
        raise ConfigError(source, value, "must be >= 0")
    return float(value)


def parse_signals(spec: str) -> tuple[signal.Signals, ...]:
    """Parse ``"SIGTERM,SIGINT"`` into signals; unknown names are a ``ConfigError``."""
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
        if sig not in out:
            out.append(sig)
    return tuple(out)
