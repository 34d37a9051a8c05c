"""The agent's worker processes: starting an attempt's group (all at once) or one local
rank's worker, and stopping them.

``WorkerProcesses`` is the one place that turns a launch plan into running processes
(and back): per attempt it computes the setup once (environments, CPUs, log
destinations, relay, starter), starts the workers of every local rank together (all or
none: see ``supervise.processes.group``), records which process
serves which local rank (the ``ProcessSet`` keyed by local rank, the worker group's ids,
``workers.json`` for ``elastrun stacks``) and stops the attempt with the one shutdown
ladder.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Protocol

from elastrun.agent.attempt import Attempt, AttemptSetup
from elastrun.agent.plan import LaunchPlan, resolve_env, stacks_file_beside
from elastrun.agent.spec import WorkerGroup, WorkerSpec
from elastrun.agent.watches import FileTimer
from elastrun.core.clock import Clock
from elastrun.core.procinfo import process_start_time
from elastrun.core.shutdown import ShutdownRequest
from elastrun.observe.sinks import MetricSink
from elastrun.pace.agent.stall_watch import ProgressWatch
from elastrun.supervise.processes.group import GroupMember, start_group, start_worker
from elastrun.supervise.processes.logs import LogsSpecs, format_line_prefix, reify_or_console
from elastrun.supervise.processes.numa import binding_cpus, numa_options_from
from elastrun.supervise.processes.procset import ProcessSet
from elastrun.supervise.processes.relay import Console, OutputRelay, WorkerStdio
from elastrun.supervise.processes.spawn import (
    ForkStarter,
    FunctionCall,
    ProcessSpec,
    ProcessStarter,
    SubprocessStarter,
    WorkerProcess,
)
from elastrun.wire import workers as workers_file
from elastrun.wire.env import ERROR_FILE_ENV, STACKS_FILE_ENV, TIMER_FILE_ENV

log = logging.getLogger("elastrun.agent")


class Guard(Protocol):
    """Kills the workers' groups if the agent dies abruptly (see ``OrphanGuard``)."""

    def start(self) -> None: ...

    def watch(self, pgid: int) -> None: ...

    def forget(self, pgid: int) -> None: ...

    def remove_if_orphaned(self, path: str) -> None: ...

    def close(self) -> None: ...


class WorkerProcesses:
    """Starts and stops the worker processes of the agent's attempts.

    Args:
        spec: what to run (local world size, NUMA options, duplicate filters).
        group: the worker group whose workers' ids and ranks are kept current.
        logs: where worker output and error files go.
        start_method: ``fork`` runs function workers in a fork, else a fresh interpreter.
        prefix_template: template for tee'd lines (see ``format_line_prefix``).
        console: where tee'd lines are shown (its sinks are made at each attempt).
        starter: the injected process starter (None: chosen per plan).
        environ: the agent's environment, under every worker's own variables.
        python: the interpreter of subprocess workers.
        guard: told of every worker's process group.
        file_timer: the expiration-timer watchdog, if on (its variables go to workers).
        progress: the progress board (its variables go to workers).
        shutdown: the agent's stop request (a second one cuts a stop's grace short:
            its ``grace`` scope).
        shutdown_timeout: grace between the stop signal and SIGKILL.
        clock, metrics: the agent's.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        group: WorkerGroup,
        logs: LogsSpecs,
        *,
        start_method: str,
        prefix_template: str | None,
        console: Console,
        starter: ProcessStarter | None,
        environ: Mapping[str, str],
        python: str,
        guard: Guard,
        file_timer: FileTimer | None,
        progress: ProgressWatch,
        shutdown: ShutdownRequest,
        shutdown_timeout: float,
        clock: Clock,
        metrics: MetricSink,
    ) -> None:
        self._spec = spec
        self._group = group
        self._logs = logs
        self._start_method = start_method
        self._prefix_template = prefix_template
        self._console = console
        self._starter = starter
        self._environ = environ
        self._python = python
        self._guard = guard
        self._file_timer = file_timer
        self._progress = progress
        self._shutdown = shutdown
        self._shutdown_timeout = shutdown_timeout
        self._clock = clock
        self._metrics = metrics
        self._numa = numa_options_from(spec.numa_options)
        self._return_dir: str | None = None  # function workers' return values
        self._provided: dict[str, str] = {}

    # -- starting --------------------------------------------------------------------

    def start(self, plan: LaunchPlan, number: int) -> Attempt:
        """Start every worker of ``plan`` as attempt ``number``: all of them or none.

        Raises whatever a start raises, after killing the workers already started.
        """
        setup = self._setup(plan, number)
        members = [self._member(setup, w.local_rank) for w in plan.workers]
        try:
            procs = start_group(setup.starter, setup.relay, setup.dest, members)
        except BaseException:
            setup.relay.close()
            raise
        for proc in procs:
            self._guard.watch(proc.pid)
            self._group.workers[proc.local_rank].id = proc.pid
        attempt = Attempt(
            setup=setup,
            procs=ProcessSet(procs, clock=self._clock),
            started_at=self._clock.time(),
        )
        self.update_ranks(plan)
        _write_workers_file(setup.envs, procs)
        return attempt

    def start_worker(
        self, setup: AttemptSetup, local_rank: int, *, replacing: bool = False
    ) -> WorkerProcess:
        """Start the worker of one local rank of an attempt (its output wired through
        the attempt's relay); the guard and the worker group are not told.
        ``replacing``: the rank's previous worker of this attempt exited (in-process
        recovery): its log files are added to, not started anew."""
        member = self._member(setup, local_rank, append=replacing)
        return start_worker(setup.starter, setup.relay, setup.dest, member)

    def _member(self, setup: AttemptSetup, local_rank: int, append: bool = False) -> GroupMember:
        w = setup.plan.workers[local_rank]
        shown = self._logs.local_ranks_filter
        return GroupMember(
            local_rank,
            prefix=format_line_prefix(
                self._prefix_template, setup.plan.role, w.ranks.global_rank, local_rank
            ),
            show_on_console=shown is None or local_rank in shown,
            make_spec=lambda stdio: self._process_spec(setup, local_rank, stdio),
            append=append,
        )

    def replace_worker(self, attempt: Attempt, setup: AttemptSetup, local_rank: int) -> int:
        """Start a new worker for ``local_rank``, whose worker of ``attempt`` exited, from
        ``setup`` (the attempt's, with the new round's environment); returns its pid."""
        old = attempt.procs.processes[local_rank].pid
        proc = self.start_worker(setup, local_rank, replacing=True)
        self._guard.forget(old)
        self._guard.watch(proc.pid)
        self._group.workers[local_rank].id = proc.pid
        attempt.procs.replace(proc)
        attempt.setup = setup
        _write_workers_file(setup.envs, list(attempt.procs.processes.values()))
        return proc.pid

    def _setup(self, plan: LaunchPlan, number: int) -> AttemptSetup:
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

    def provide(self, values: Mapping[str, str]) -> None:
        """Values of run-time variables that the agent's other parts hold (the in-process
        recovery socket), for every later attempt's workers that the plan names them for."""
        self._provided.update(values)

    def _starter_for(self, plan: LaunchPlan) -> ProcessStarter:
        if self._starter is not None:
            return self._starter
        if plan.function is not None and self._start_method == "fork":
            return ForkStarter()
        return SubprocessStarter(self._python)

    def _worker_envs(self, plan: LaunchPlan) -> dict[int, dict[str, str]]:
        """Each worker's environment before its log directory is made: the plan applied
        over the agent's environment, with the values of its run-time variables that the
        file timer, the progress board and :meth:`provide` hold."""
        provided = dict(self._provided)
        if self._file_timer is not None:
            provided[TIMER_FILE_ENV] = self._file_timer.start(plan.facts.run_id)
        slots = self._progress.worker_values(w.local_rank for w in plan.workers)
        return {
            w.local_rank: resolve_env(self._environ, w, {**provided, **slots.get(w.local_rank, {})})
            for w in plan.workers
        }

    def _process_spec(
        self, setup: AttemptSetup, local_rank: int, stdio: WorkerStdio
    ) -> ProcessSpec:
        plan = setup.plan
        env = setup.envs[local_rank]
        cpus = setup.cpus[local_rank]
        out, err = stdio.stdout_fd, stdio.stderr_fd
        if plan.function is None:
            argv = plan.workers[local_rank].argv
            return ProcessSpec(local_rank, env, argv=argv, stdout_fd=out, stderr_fd=err, cpus=cpus)
        if self._return_dir is None:
            self._return_dir = tempfile.mkdtemp(prefix="elastrun-ret-")
        ret = os.path.join(self._return_dir, f"a{setup.number}_r{local_rank}.pkl")
        call = FunctionCall(plan.function, plan.workers[local_rank].args, ret)
        return ProcessSpec(local_rank, env, call=call, stdout_fd=out, stderr_fd=err, cpus=cpus)

    def update_ranks(self, plan: LaunchPlan) -> None:
        """Record the plan's ranks in the worker group (a new attempt, or an in-process
        round whose world changed)."""
        for w in plan.workers:
            worker = self._group.workers[w.local_rank]
            worker.global_rank = w.ranks.global_rank
            worker.role_rank = w.ranks.role_rank
            worker.world_size = w.ranks.world_size
            worker.role_world_size = w.ranks.role_world_size

    # -- stopping --------------------------------------------------------------------

    def stop(self, attempt: Attempt, sig: int) -> None:
        """Stop whatever still runs of ``attempt`` (``sig``, SIGKILL after the grace)
        and drain its output."""
        t0 = self._clock.monotonic()
        running = attempt.procs.running()
        report = attempt.procs.stop(sig, self._shutdown_timeout, grace=self._shutdown.grace)
        for pid in attempt.procs.pids().values():
            self._guard.forget(pid)
        attempt.relay.close()
        attempt.procs.close()
        if running:
            self._metrics.put(
                "agent.workers_stop.duration_ms", (self._clock.monotonic() - t0) * 1000
            )
            log.info(
                "stopped %d worker(s) in %.0f ms%s",
                len(running),
                (self._clock.monotonic() - t0) * 1000,
                f" ({len(report.killed)} needed SIGKILL)" if report.killed else "",
            )

    def close(self) -> None:
        """Remove the function workers' return values (after the last attempt)."""
        if self._return_dir:
            shutil.rmtree(self._return_dir, ignore_errors=True)

    def __repr__(self) -> str:
        return (
            f"WorkerProcesses(local_world_size={self._spec.local_world_size}, "
            f"start_method={self._start_method!r}, starter={self._starter!r})"
        )


def _write_workers_file(envs: dict[int, dict[str, str]], procs: list[WorkerProcess]) -> None:
    """``<attempt>/workers.json``: each local rank's pid, for ``elastrun stacks``."""
    entries = {
        p.local_rank: workers_file.WorkerEntry(p.pid, f, process_start_time(p.pid))
        for p in procs
        if (f := envs[p.local_rank].get(STACKS_FILE_ENV))
    }
    if not entries:
        return
    attempt_dir = os.path.dirname(os.path.dirname(next(iter(entries.values())).stacks))
    try:
        with open(os.path.join(attempt_dir, workers_file.FILE_NAME), "w", encoding="utf-8") as fh:
            fh.write(workers_file.encode(entries))
    except OSError as exc:
        log.debug("could not write %s: %s", workers_file.FILE_NAME, exc)
