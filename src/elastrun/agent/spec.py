"""What the agent runs (``WorkerSpec``) and what it reports (``RunResult``).

The names and fields follow torch's ``torch.distributed.elastic.agent.server`` so that
code written against torch keeps working; the differences are that a spec needs no
rendezvous handler on a single node, and validation raises ``ConfigError``.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastrun.core.errors import ConfigError

if TYPE_CHECKING:
    from elastrun.rendezvous.api import RendezvousHandler
    from elastrun.supervise.failures.failure import ProcessFailure
    from elastrun.supervise.processes.numa import NumaOptions

#: A worker entry point: a Python callable (function workers), or the path of an
#: executable that is started with ``args`` as its arguments.
Entrypoint = Callable[..., object] | str


class WorkerState(str, enum.Enum):
    """State of a worker group (torch-compatible values)."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


@dataclass
class WorkerSpec:
    """The workers one agent runs for one role.

    Args:
        role: role name, exported as ``ROLE_NAME``.
        local_world_size: number of workers on this node (> 0).
        entrypoint: a callable, or the executable to start (``sys.executable`` for
            Python scripts, with ``args`` beginning ``("-u", "script.py", ...)``).
        args: arguments for the entrypoint; the string ``${local_rank}`` is replaced
            by each worker's local rank.
        rdzv_handler: the rendezvous; ``None`` means this node runs alone.
        max_restarts: how many times a failed worker group is restarted.
        monitor_interval: longest pause between health checks that cannot be
            driven by events (the agent reacts to worker exits immediately).
        master_addr, master_port: override the rendezvous' bootstrap address.

    Raises:
        ConfigError: on a non-positive world size or interval, or no entrypoint.
    """

    role: str = "default"
    local_world_size: int = 1
    rdzv_handler: RendezvousHandler | None = None
    fn: Callable[..., object] | None = None
    entrypoint: Entrypoint | None = None
    args: tuple[object, ...] = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    master_port: int | None = None
    master_addr: str | None = None
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: NumaOptions | str | None = None  # a mode name is taken too
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False

    def __post_init__(self) -> None:
        if self.fn is not None and self.entrypoint is None:
            self.entrypoint = self.fn
        if self.local_world_size <= 0:
            raise ConfigError("local_world_size", self.local_world_size, "must be > 0")
        if self.monitor_interval <= 0:
            raise ConfigError("monitor_interval", self.monitor_interval, "must be > 0")
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", self.max_restarts, "must be >= 0")
        if self.entrypoint is None:
            raise ConfigError("entrypoint", None, "a WorkerSpec needs an entrypoint")

    def get_entrypoint_name(self) -> str:
        """The executable's base name, or the callable's qualified name."""
        if isinstance(self.entrypoint, str):
            return os.path.basename(self.entrypoint)
        assert self.entrypoint is not None  # guaranteed by __post_init__
        return getattr(self.entrypoint, "__qualname__", repr(self.entrypoint))


class Worker:
    """One worker process of a group; ``id`` is its pid once started."""

    __slots__ = ["global_rank", "id", "local_rank", "role_rank", "role_world_size", "world_size"]

    def __init__(
        self,
        local_rank: int,
        global_rank: int = -1,
        role_rank: int = -1,
        world_size: int = -1,
        role_world_size: int = -1,
    ) -> None:
        self.id: int | None = None
        self.local_rank = local_rank
        self.global_rank = global_rank
        self.role_rank = role_rank
        self.world_size = world_size
        self.role_world_size = role_world_size

    def __str__(self) -> str:
        return (
            f"local_rank={self.local_rank},global_rank={self.global_rank},"
            f"role_rank={self.role_rank},world_size={self.world_size},"
            f"role_world_size={self.role_world_size}"
        )

    def __repr__(self) -> str:
        return f"Worker(id={self.id}, {self})"


class WorkerGroup:
    """The workers of one spec on this node, with the rendezvous round they belong to."""

    __slots__ = [
        "group_rank",
        "group_world_size",
        "master_addr",
        "master_port",
        "spec",
        "state",
        "store",
        "workers",
    ]

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.workers = [Worker(local_rank=i) for i in range(spec.local_world_size)]
        self.store: object | None = None
        self.group_rank: int | None = None
        self.group_world_size: int | None = None
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self.state = WorkerState.INIT

    def __repr__(self) -> str:
        return (
            f"WorkerGroup(role={self.spec.role!r}, state={self.state.value}, "
            f"group_rank={self.group_rank}, group_world_size={self.group_world_size})"
        )


@dataclass
class RunResult:
    """Outcome of a run: return values and failures, each keyed by global rank."""

    state: WorkerState
    return_values: dict[int, object] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED
