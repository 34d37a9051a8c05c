"""What an attempt's workers are started from: its setup, and each local rank's process
(``WorkerProcesses``, agent.workers, starts and stops them)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from elastrun.agent.attempt import AttemptSetup
from elastrun.agent.plan import LaunchPlan, resolve_env, stacks_file_beside
from elastrun.agent.spec import WorkerSpec
from elastrun.agent.watches import FileTimer
from elastrun.pace.agent.stall_watch import ProgressWatch
from elastrun.supervise.processes.group import GroupMember
from elastrun.supervise.processes.interpreter import WorkerInterpreter
from elastrun.supervise.processes.logs import LogsSpecs, format_line_prefix, reify_or_console
from elastrun.supervise.processes.numa import binding_cpus, numa_options_from
from elastrun.supervise.processes.relay import Console, OutputRelay, WorkerStdio
from elastrun.supervise.processes.spawn import (
    ForkStarter,
    FunctionCall,
    ProcessSpec,
    ProcessStarter,
    SubprocessStarter,
)
from elastrun.wire.env import ERROR_FILE_ENV, STACKS_FILE_ENV, TIMER_FILE_ENV

__all__ = ["AttemptSetups", "WorkerSettings"]


@dataclass(frozen=True)
class WorkerSettings:
    """How the agent starts its workers (from ``AgentOptions``).

    Args:
        interpreter: the interpreter of subprocess workers, and the agent's environment
            under every worker's own variables.
        start_method: ``fork`` runs function workers in a fork, else a fresh interpreter.
        prefix_template: template for tee'd lines (see ``format_line_prefix``).
    """

    interpreter: WorkerInterpreter
    start_method: str
    prefix_template: str | None


class AttemptSetups:
    """Makes each attempt's setup and its local ranks' process specs (no I/O but the
    log directories and the function workers' return-value directory).

    Args:
        spec: what to run (local world size, NUMA options, duplicate filters).
        settings: the interpreter, environment, start method and line prefix.
        logs: where worker output and error files go.
        console: where tee'd lines are shown (its sinks are made at each attempt).
        starter: the injected process starter (None: chosen per plan).
        file_timer: the expiration-timer watchdog, if on (its variables go to workers).
        progress: the progress board (its variables go to workers).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        settings: WorkerSettings,
        logs: LogsSpecs,
        console: Console,
        starter: ProcessStarter | None,
        file_timer: FileTimer | None,
        progress: ProgressWatch,
    ) -> None:
        self._spec = spec
        self._settings = settings
        self._logs = logs
        self._console = console
        self._starter = starter
        self._file_timer = file_timer
        self._progress = progress
        self._numa = numa_options_from(spec.numa_options)
        self._return_dir: str | None = None  # function workers' return values
        self._provided: dict[str, str] = {}

    def provide(self, values: Mapping[str, str]) -> None:
        """Values of run-time variables that the agent's other parts hold (the in-process
        recovery socket), for every later attempt's workers that the plan names them for."""
        self._provided.update(values)

    def setup(self, plan: LaunchPlan, number: int) -> AttemptSetup:
        """Everything the attempt's workers need, before the first one starts (a NUMA
        binding that cannot be made fails here, with nothing started)."""
        envs = self._worker_envs(plan)
        lws = self._spec.local_world_size
        cpus = {w.local_rank: binding_cpus(self._numa, w.local_rank, lws) for w in plan.workers}
        # A log directory that fails now (full disk, removed) must not end the agent.
        # The logs specs fill in TORCHELASTIC_ERROR_FILE themselves (torch's LogsSpecs
        # protocol: ``reify`` writes into the environments it is given).
        dest = reify_or_console(self._logs, envs)
        for w in plan.workers:
            stacks = stacks_file_beside(envs[w.local_rank].get(ERROR_FILE_ENV, ""))
            if stacks is not None and STACKS_FILE_ENV in w.runtime:
                envs[w.local_rank][STACKS_FILE_ENV] = stacks
        relay = OutputRelay(
            console=self._console,
            filtered_stdout=dest.filtered_stdout,
            filtered_stderr=dest.filtered_stderr,
            stdout_filters=self._spec.duplicate_stdout_filters or (),
            stderr_filters=self._spec.duplicate_stderr_filters or (),
        )
        return AttemptSetup(number, plan, envs, cpus, dest, relay, self._starter_for(plan))

    def member(self, setup: AttemptSetup, local_rank: int, append: bool = False) -> GroupMember:
        """How the worker of ``local_rank`` is started from ``setup`` (``append``: to its
        log files, not anew)."""
        w = setup.plan.workers[local_rank]
        shown = self._logs.local_ranks_filter
        return GroupMember(
            local_rank,
            prefix=format_line_prefix(
                self._settings.prefix_template, setup.plan.role, w.ranks.global_rank, local_rank
            ),
            show_on_console=shown is None or local_rank in shown,
            make_spec=lambda stdio: self._process_spec(setup, local_rank, stdio),
            append=append,
        )

    def _starter_for(self, plan: LaunchPlan) -> ProcessStarter:
        if self._starter is not None:
            return self._starter
        if plan.function is not None and self._settings.start_method == "fork":
            return ForkStarter()
        return SubprocessStarter(self._settings.interpreter.python)

    def _worker_envs(self, plan: LaunchPlan) -> dict[int, dict[str, str]]:
        """Each worker's environment before its log directory is made: the plan applied
        over the agent's environment, with the values of its run-time variables that the
        file timer, the progress board and :meth:`provide` hold."""
        provided = dict(self._provided)
        if self._file_timer is not None:
            provided[TIMER_FILE_ENV] = self._file_timer.start(plan.facts.run_id)
        slots = self._progress.worker_values(w.local_rank for w in plan.workers)
        environ = self._settings.interpreter.environ
        return {
            w.local_rank: resolve_env(environ, w, {**provided, **slots.get(w.local_rank, {})})
            for w in plan.workers
        }

    def _process_spec(
        self, setup: AttemptSetup, local_rank: int, stdio: WorkerStdio
    ) -> ProcessSpec:
        plan, worker = setup.plan, setup.plan.workers[local_rank]
        call = None
        if plan.function is not None:  # (its worker has no argv)
            if self._return_dir is None:
                self._return_dir = tempfile.mkdtemp(prefix="elastrun-ret-")
            ret = os.path.join(self._return_dir, f"a{setup.number}_r{local_rank}.pkl")
            call = FunctionCall(plan.function, worker.args, ret)
        return ProcessSpec(
            local_rank, setup.envs[local_rank], argv=worker.argv, call=call,
            stdout_fd=stdio.stdout_fd, stderr_fd=stdio.stderr_fd, cpus=setup.cpus[local_rank],
        )  # fmt: skip

    def close(self) -> None:
        """Remove the function workers' return values (after the last attempt)."""
        if self._return_dir:
            shutil.rmtree(self._return_dir, ignore_errors=True)

    def __repr__(self) -> str:
        return (
            f"AttemptSetups(start_method={self._settings.start_method!r}, "
            f"starter={self._starter!r}, provided={sorted(self._provided)})"
        )
