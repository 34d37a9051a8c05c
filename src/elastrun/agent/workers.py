"""The agent's worker processes: starting an attempt's group (all at once: see
``supervise.processes.group``) or one local rank's worker, and stopping them.

``WorkerProcesses`` is the one place that turns a launch plan into running processes
(from the setup ``AttemptSetups`` computes once per attempt) and back.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Protocol

from elastrun.agent.attempt import Attempt, AttemptSetup
from elastrun.agent.plan import LaunchPlan
from elastrun.agent.setups import AttemptSetups
from elastrun.agent.spec import WorkerGroup
from elastrun.core.clock import Clock
from elastrun.core.procinfo import process_start_time
from elastrun.core.shutdown import ShutdownRequest
from elastrun.observe.sinks import MetricSink
from elastrun.supervise.processes.group import start_group, start_worker
from elastrun.supervise.processes.procset import ProcessSet
from elastrun.supervise.processes.spawn import WorkerProcess
from elastrun.wire import workers as workers_file
from elastrun.wire.env import STACKS_FILE_ENV

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
        group: the worker group whose workers' ids and ranks are kept current.
        setups: what each attempt's workers are started from.
        guard: told of every worker's process group.
        shutdown: the agent's stop request (a second one cuts a stop's grace short:
            its ``grace`` scope).
        shutdown_timeout: grace between the stop signal and SIGKILL.
        clock, metrics: the agent's.
    """

    def __init__(
        self,
        group: WorkerGroup,
        setups: AttemptSetups,
        *,
        guard: Guard,
        shutdown: ShutdownRequest,
        shutdown_timeout: float,
        clock: Clock,
        metrics: MetricSink,
    ) -> None:
        self._group = group
        self._setups = setups
        self._guard = guard
        self._shutdown = shutdown
        self._shutdown_timeout = shutdown_timeout
        self._clock = clock
        self._metrics = metrics

    # -- starting --------------------------------------------------------------------

    def start(self, plan: LaunchPlan, number: int) -> Attempt:
        """Start every worker of ``plan`` as attempt ``number``: all of them or none.

        Raises whatever a start raises, after killing the workers already started.
        """
        setup = self._setups.setup(plan, number)
        members = [self._setups.member(setup, w.local_rank) for w in plan.workers]
        try:
            procs = start_group(setup.starter, setup.relay, setup.dest, members)
        except BaseException:
            setup.relay.close()
            raise
        for proc in procs:
            self._guard.watch(proc.pid)
            self._group.workers[proc.local_rank].id = proc.pid
        attempt = Attempt(setup=setup, procs=ProcessSet(procs, clock=self._clock))
        self.update_ranks(plan)
        _write_workers_file(setup.envs, procs)
        return attempt

    def replace_worker(self, attempt: Attempt, setup: AttemptSetup, local_rank: int) -> int:
        """Start a new worker for ``local_rank``, whose worker of ``attempt`` exited, from
        ``setup`` (the attempt's, with the new round's environment; its output wired
        through the attempt's relay, its log files added to, not started anew); returns
        its pid."""
        old = attempt.procs.processes[local_rank].pid
        member = self._setups.member(setup, local_rank, append=True)
        proc = start_worker(setup.starter, setup.relay, setup.dest, member)
        self._guard.forget(old)
        self._guard.watch(proc.pid)
        self._group.workers[local_rank].id = proc.pid
        attempt.procs.replace(proc)
        attempt.setup = setup
        _write_workers_file(setup.envs, list(attempt.procs.processes.values()))
        return proc.pid

    def provide(self, values: Mapping[str, str]) -> None:
        """Values of run-time variables that the agent's other parts hold (the in-process
        recovery socket), for every later attempt's workers that the plan names them for."""
        self._setups.provide(values)

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
        attempt.setup.relay.close()
        attempt.procs.close()
        if running:
            took_ms = (self._clock.monotonic() - t0) * 1000
            self._metrics.put("agent.workers_stop.duration_ms", took_ms)
            log.info(
                "stopped %d worker(s) in %.0f ms%s",
                len(running),
                took_ms,
                f" ({len(report.killed)} needed SIGKILL)" if report.killed else "",
            )

    def close(self) -> None:
        """Remove the function workers' return values (after the last attempt)."""
        self._setups.close()

    def __repr__(self) -> str:
        return (
            f"WorkerProcesses(local_world_size={self._group.spec.local_world_size}, "
            f"setups={self._setups!r})"
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
