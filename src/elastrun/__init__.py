"""elastrun: a fault-tolerant, elastic launcher for distributed PyTorch training.

The public names are imported lazily, so that ``import elastrun`` (and the worker
bootstrap, which lives inside this package) stays cheap.
"""

from __future__ import annotations

import importlib

# Not ``typing.TYPE_CHECKING``: importing typing costs every worker start (the
# bootstrap lives in this package) a few milliseconds; mypy understands this name.
TYPE_CHECKING = False

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "LaunchConfig": "elastrun.launch.config",
    "elastic_launch": "elastrun.launch.api",
    "launch_agent": "elastrun.launch.api",
    "WorkerSpec": "elastrun.agent.spec",
    "WorkerState": "elastrun.agent.spec",
    "WorkerGroup": "elastrun.agent.spec",
    "Worker": "elastrun.agent.spec",
    "RunResult": "elastrun.agent.spec",
    "LocalElasticAgent": "elastrun.launch.local_agent",
    "RendezvousHandler": "elastrun.rendezvous.api",
    "RendezvousParameters": "elastrun.rendezvous.api",
    "RendezvousInfo": "elastrun.rendezvous.api",
    "RendezvousStoreInfo": "elastrun.rendezvous.api",
    "rendezvous_handler_registry": "elastrun.rendezvous.registry",
    "start_processes": "elastrun.supervise.api",
    "Std": "elastrun.supervise.processes.logs",
    "DefaultLogsSpecs": "elastrun.supervise.processes.logs",
    "LogsSpecs": "elastrun.supervise.processes.logs",
    "ChildFailedError": "elastrun.supervise.failures.report",
    "ProcessFailure": "elastrun.supervise.failures.failure",
    "record": "elastrun.worker.record",
    "progress": "elastrun.pace.worker.report",
    "init_process_group": "elastrun.worker.dist",
    "ElastrunError": "elastrun.core.errors",
    "ConfigError": "elastrun.core.errors",
}

__all__ = [
    "ChildFailedError",
    "ConfigError",
    "DefaultLogsSpecs",
    "ElastrunError",
    "LaunchConfig",
    "LocalElasticAgent",
    "LogsSpecs",
    "ProcessFailure",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStoreInfo",
    "RunResult",
    "Std",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "elastic_launch",
    "init_process_group",
    "launch_agent",
    "progress",
    "record",
    "rendezvous_handler_registry",
    "start_processes",
]

if TYPE_CHECKING:
    from elastrun.agent.spec import RunResult, Worker, WorkerGroup, WorkerSpec, WorkerState
    from elastrun.core.errors import ConfigError, ElastrunError
    from elastrun.launch.api import elastic_launch, launch_agent
    from elastrun.launch.config import LaunchConfig
    from elastrun.launch.local_agent import LocalElasticAgent
    from elastrun.pace.worker.report import progress
    from elastrun.rendezvous.api import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousParameters,
        RendezvousStoreInfo,
    )
    from elastrun.rendezvous.registry import rendezvous_handler_registry
    from elastrun.supervise.api import start_processes
    from elastrun.supervise.failures.failure import ProcessFailure
    from elastrun.supervise.failures.report import ChildFailedError
    from elastrun.supervise.processes.logs import DefaultLogsSpecs, LogsSpecs, Std
    from elastrun.worker.dist import init_process_group
    from elastrun.worker.record import record


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastrun' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
