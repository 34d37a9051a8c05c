"""``LocalElasticAgent``: the elastic loop of one node.

rendezvous -> plan -> start -> watch -> restart / finish. The loop blocks on events
(a worker exit through its pidfd, a signal through the shutdown waker) and checks the
rendezvous for waiting nodes at most every ``monitor_interval``; nothing sleeps a fixed
time on the recovery path.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from elastrun.agent.interrupt import call_interruptibly
from elastrun.agent.pace_watch import PaceWatch
from elastrun.agent.phases import AgentPhase, PhaseMachine
from elastrun.agent.plan import LaunchPlan, NodeSlot, RoundFacts, build_plan
from elastrun.agent.policy import (
    Decision,
    JobRestartBudget,
    LocalRestartBudget,
    RestartAll,
    RestartBudget,
    RestartPolicy,
)
from elastrun.agent.progress_watch import ProgressWatch, hang_reasons
from elastrun.agent.spec import RunResult, WorkerGroup, WorkerSpec, WorkerState
from elastrun.core.cancel import Cancelled
from elastrun.core.clock import SYSTEM_CLOCK, Clock, Deadline
from elastrun.core.errors import RendezvousError, ShutdownRequested, StoreError
from elastrun.core.procinfo import process_start_time
from elastrun.core.shutdown import ShutdownRequest
from elastrun.observe.sinks import EventSink, EventValue, MetricSink, NullEventSink, NullMetricSink
from elastrun.rendezvous.api import (
    BarrierResult,
    RendezvousHandler,
    RendezvousInfo,
    RoundOutcome,
)
from elastrun.rendezvous.elastic import ElasticRendezvous, as_elastic
from elastrun.rendezvous.local import LocalRendezvousHandler
from elastrun.store.torchwire.lazy import LazyTorchWireServer
from elastrun.supervise.failures.failure import ProcessFailure
from elastrun.supervise.processes.dstate import UninterruptibleWatch
from elastrun.supervise.processes.guard import OrphanGuard
from elastrun.supervise.processes.logs import (
    DefaultLogsSpecs,
    LogsDest,
    LogsSpecs,
    format_line_prefix,
    reify_or_console,
)
from elastrun.supervise.processes.numa import binding_cpus, numa_options_from
from elastrun.supervise.processes.procset import Exit, ProcessSet
from elastrun.supervise.processes.relay import OutputRelay
from elastrun.supervise.processes.spawn import (
    ForkStarter,
    FunctionCall,
    ProcessSpec,
    ProcessStarter,
    SubprocessStarter,
    WorkerProcess,
)
from elastrun.supervise.processes.stacks import request_stacks
from elastrun.supervise.progress import AutoTimeout, StragglerSettings

log = logging.getLogger("elastrun.agent")

T = TypeVar("T")

#: Default of ``stuck_exit_timeout``: a gloo/NCCL teardown ends well within a second of
#: its peers'; a rank 0 that saves or evaluates after the others left can take tens of
#: seconds. A minute separates the two, and the verdict is only a warning with stacks.
STUCK_EXIT_TIMEOUT = 60.0


class FileTimer(Protocol):
    """The agent's expiration-timer watchdog (``supervise.timers.agent_timer.AgentFileTimer``)."""

    def start(self, run_id: str) -> str: ...

    def worker_env(self) -> dict[str, str]: ...

    def expired_pids(self) -> dict[int, str]: ...

    def get_last_progress_time(self) -> float: ...

    def stop(self) -> None: ...


class Guard(Protocol):
    """Kills the workers' groups if the agent dies abruptly (see ``OrphanGuard``)."""

    def start(self) -> None: ...

    def watch(self, pgid: int) -> None: ...

    def forget(self, pgid: int) -> None: ...

    def close(self) -> None: ...


# Legal worker-group transitions; ``_transition`` enforces them and emits an event.
_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.INIT: frozenset({WorkerState.HEALTHY, WorkerState.FAILED, WorkerState.STOPPED}),
    WorkerState.HEALTHY: frozenset(
        {WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED, WorkerState.UNHEALTHY}
    ),
    WorkerState.UNHEALTHY: frozenset({WorkerState.FAILED, WorkerState.STOPPED}),
    WorkerState.STOPPED: frozenset({WorkerState.HEALTHY, WorkerState.FAILED}),
    WorkerState.SUCCEEDED: frozenset(),
    WorkerState.FAILED: frozenset(),
    WorkerState.UNKNOWN: frozenset(),
}


@dataclass
class _Attempt:
    """One start of the worker group: its plan, processes and output wiring."""

    number: int
    plan: LaunchPlan
    dest: LogsDest
    procs: ProcessSet
    relay: OutputRelay
    started_at: float
    stderr_files: dict[int, str] = field(default_factory=dict)
    stacks_files: dict[int, str] = field(default_factory=dict)
    #: Monotonic time since which every exited worker succeeded and some still run.
    lonely_since: float | None = None
    lonely_reported: bool = False
    hang_handled: bool = False

    def stack_requests(self, local_ranks: list[int]) -> dict[int, tuple[int, str]]:
        """``{local_rank: (pid, stacks file)}`` of these workers, for ``request_stacks``."""
        pids = self.procs.pids()
        return {
            lr: (pids[lr], self.stacks_files[lr]) for lr in local_ranks if lr in self.stacks_files
        }


class LocalElasticAgent:
    """Runs, watches and restarts the workers of one node.

    Args:
        spec: what to run. ``spec.rdzv_handler`` None means a single standalone node.
        logs_specs: where worker output and error files go (default: a temporary dir).
        start_method: for function workers: ``spawn`` (fresh interpreter; the default,
            ``forkserver`` behaves the same) or ``fork``.
        exit_barrier_timeout: how long a finished node waits for its peers.
        log_line_prefix_template: template for tee'd lines (``${role_name}``,
            ``${rank}``, ``${local_rank}``).
        shutdown_timeout: grace between the stop signal and SIGKILL, for restarts and
            the final stop alike.
        run_id: the run id when ``spec.rdzv_handler`` is None.
        shutdown: a request set by the launcher's signal handlers.
        metrics: where the agent's metrics go.
        file_timer: the expiration-timer watchdog (TORCHELASTIC_ENABLE_FILE_TIMER=1).
        stuck_watch: ends the run when a worker stays in uninterruptible sleep.
        hang_timeout: seconds without progress after which a worker that reported
            progress is hung (``AutoTimeout``: derived from its step times); its stacks
            are dumped, then it is killed and counts as a failure. None: off.
        stalled_restarts: stop restarting (``stalled`` is then set) after
            this many consecutive attempts in which no rank passed the step it had
            reached before; None turns it off. Scripts that report no progress are
            never stopped by it.
        stragglers: how ranks (and nodes) slower than their peers are found and
            reported (never stopped); None: off (step metrics are still put).
        stuck_exit_timeout: seconds a worker may keep running after every other local
            worker exited successfully before its stacks are dumped and a warning
            names it (it is not stopped); None turns the check off.
        starter, policy, budget, clock, environ, python, events, guard: injected
            collaborators (production defaults when None).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs | None = None,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: float = 30,
        health_check_server: object | None = None,
        *,
        run_id: str | None = None,
        shutdown: ShutdownRequest | None = None,
        starter: ProcessStarter | None = None,
        policy: RestartPolicy | None = None,
        budget: RestartBudget | None = None,
        clock: Clock = SYSTEM_CLOCK,
        environ: Mapping[str, str] | None = None,
        python: str = sys.executable,
        events: EventSink | None = None,
        hostname: str | None = None,
        guard: Guard | None = None,
        metrics: MetricSink | None = None,
        file_timer: FileTimer | None = None,
        stuck_watch: UninterruptibleWatch | None = None,
        stuck_exit_timeout: float | None = STUCK_EXIT_TIMEOUT,
        hang_timeout: float | AutoTimeout | None = None,
        stalled_restarts: int | None = 3,
        stragglers: StragglerSettings | None = StragglerSettings(),  # noqa: B008 (frozen)
    ) -> None:
        self._spec = spec
        self._logs = logs_specs if logs_specs is not None else DefaultLogsSpecs()
        self._start_method = start_method
        self._exit_barrier_timeout = exit_barrier_timeout
        self._prefix_template = log_line_prefix_template
        self._shutdown_timeout = shutdown_timeout
        self._handler: RendezvousHandler = spec.rdzv_handler or LocalRendezvousHandler(
            run_id or str(uuid.uuid4())
        )
        self._owns_shutdown = shutdown is None
        self._shutdown = shutdown if shutdown is not None else ShutdownRequest()
        self._starter = starter
        self._policy = policy if policy is not None else RestartAll()
        self._rdzv = as_elastic(self._handler)  # what the agent needs beyond torch's methods
        self._budget = budget if budget is not None else _default_budget(self._rdzv, spec)
        self._clock = clock
        self._environ = dict(os.environ if environ is None else environ)
        self._python = python
        self._events = events if events is not None else NullEventSink()
        self._metrics = metrics if metrics is not None else NullMetricSink()
        self._file_timer = file_timer
        self._stuck = stuck_watch
        self._stuck_exit_timeout = stuck_exit_timeout
        # Where workers report progress (shared memory, no store round trip), and the
        # verdicts read from it.
        self._progress = ProgressWatch(
            spec.local_world_size, hang_timeout, stalled_restarts or None, clock
        )
        self._pace = PaceWatch(stragglers, self._events, self._metrics, clock)
        #: Why restarting stopped because the restarts made no progress (else None).
        self.stalled: str | None = None
        # The workers' bootstrap store (MASTER_ADDR/PORT) of the current round, when this
        # node is its group rank 0: it outlives every worker of the round.
        self._bootstrap_store: LazyTorchWireServer | None = None
        self._phases = PhaseMachine(self._on_phase)
        self._reasons: dict[int, str] = {}  # pid -> why elastrun ended it on purpose
        self._numa = numa_options_from(spec.numa_options)
        #: Wall-clock time of the loop's last pass (the health check's "last progress").
        self.last_progress = clock.time()
        self._host = hostname or socket.getfqdn()
        self._group = WorkerGroup(spec)
        self._attempt: _Attempt | None = None
        self._attempts = 0
        self._guard: Guard = guard if guard is not None else OrphanGuard(python)
        self._return_dir: str | None = None
        self.history: list[str] = []  # one line per failure that caused a restart
        self.budget_note: str | None = None

    # -- public API ------------------------------------------------------------------

    @property
    def rdzv_handler(self) -> RendezvousHandler:
        return self._handler

    @property
    def logs_specs(self) -> LogsSpecs:
        return self._logs

    def get_worker_group(self, role: str = "default") -> WorkerGroup:
        return self._group

    def alive(self) -> float:
        """The last sign of progress (for the health check): the file timer's, if any."""
        if self._file_timer is not None:
            return max(self.last_progress, self._file_timer.get_last_progress_time())
        return self.last_progress

    @property
    def phase(self) -> AgentPhase:
        """What the agent is doing now (rendezvous, running, exit barrier...)."""
        return self._phases.phase

    def status(self) -> dict[str, object]:
        """A snapshot for the health check and status views."""
        g = self._group
        return {
            "state": g.state.value,
            "phase": self._phases.phase.value,
            "run_id": self._handler.get_run_id(),
            "attempt": self._attempts - 1,
            "restart_count": self._budget.used,
            "max_restarts": self._budget.limit,
            "group_rank": g.group_rank,
            "group_world_size": g.group_world_size,
            "workers": [w.id for w in g.workers],
            "progress": self._progress.status(),
        }

    def run(self, role: str = "default") -> RunResult:
        """Run the workers to completion, restarting them on failure.

        Returns the result (``FAILED`` with the failures when the restart budget ran
        out). Raises ``ShutdownRequested`` after stopping the workers on a signal.
        """
        try:
            return self._invoke_run()
        finally:
            self._phases.move(AgentPhase.DONE)
            self._rdzv.set_change_callback(lambda: None)  # its threads may outlive the waker
            self._finish_attempt(signal.SIGTERM)
            self._close_bootstrap_store()
            self._shutdown.stop_relay()
            self._pace.close()
            self._progress.close()
            self._guard.close()
            if self._file_timer is not None:
                self._file_timer.stop()
            if self._owns_shutdown:
                self._shutdown.waker.close()
            if self._return_dir:
                shutil.rmtree(self._return_dir, ignore_errors=True)

    # -- the loop ----------------------------------------------------------------------

    def _invoke_run(self) -> RunResult:
        self._shutdown.start_relay()
        self._rdzv.set_node_info(self._spec.role, self._spec.local_world_size)
        # Membership news from the rendezvous' watch thread wakes the loop at once.
        self._rdzv.set_change_callback(self._shutdown.waker.wake)
        self._guard.start()
        self._check_shutdown()
        self._start_round()
        while True:
            attempt = self._attempt
            assert attempt is not None
            attempt.procs.wait_for_exits(Deadline.after(self._spec.monitor_interval, self._clock))
            self._shutdown.waker.drain()
            self.last_progress = self._clock.time()
            self._check_shutdown()
            self._note_expired_timers()
            stuck = self._stuck_worker(attempt)
            if stuck is not None:
                return self._fail([], stuck=stuck)
            self._check_hang(attempt)
            if self._pace.due():
                self._pace.sample(self._progress.snapshot(), attempt.procs.running())
            exits = attempt.procs.exits
            failed = sorted(
                (e for e in exits.values() if e.exitcode != 0), key=lambda e: e.observed_at
            )
            if failed:
                if self._no_progress_since_restarts():
                    return self._fail(failed)
                what = self._describe_failure(attempt, failed[0])
                # The job-wide budget lives in the store: a signal must not wait for it.
                decision = self._interruptible(
                    functools.partial(self._policy.on_failure, failed, self._budget, what),
                    "restart budget",
                )
                if decision is Decision.RESTART_ALL:
                    self._restart_after_failure(failed)
                    continue
                return self._fail(failed)
            if not attempt.procs.running():
                result = self._succeed(attempt)
                if result is None:
                    continue  # the round failed elsewhere: this node re-formed and restarted
                return result
            self._check_stuck_at_exit(attempt)
            if self._handler.num_nodes_waiting() > 0:
                why = self._rdzv.change_reason or "nodes are waiting to join"
                log.info("%s: re-forming the group (no restart counted here)", why)
                self._events.record("agent.membership_change", {"reason": why})
                self._metrics.put("agent.membership_changes", 1)
                self._finish_attempt(signal.SIGTERM)
                self._transition(WorkerState.STOPPED)
                self._start_round()

    def _note_expired_timers(self) -> None:
        if self._file_timer is not None:
            for pid, scope in self._file_timer.expired_pids().items():
                self._reasons[pid] = f"its expiration timer expired (scope {scope})"

    def _stuck_worker(self, attempt: _Attempt) -> int | None:
        """A local rank stuck in uninterruptible sleep past the limit, if any."""
        if self._stuck is None:
            return None
        pids = {lr: attempt.procs.processes[lr].pid for lr in attempt.procs.running()}
        lr = self._stuck.check(pids)
        if lr is not None:
            self._reasons[pids[lr]] = self._stuck.reason(lr, pids[lr])
            log.error(
                "%s; stopping the workers (no restart: it cannot be killed)",
                self._reasons[pids[lr]],
            )
        return lr

    def _check_shutdown(self) -> None:
        signum = self._shutdown.signum
        if signum is None:
            return
        name = signal.Signals(signum).name
        if self._attempt is not None:
            log.warning("received %s: stopping workers (grace %.0fs)", name, self._shutdown_timeout)
            self._finish_attempt(signum)
        self._events.record("agent.signal", {"signal": name})
        raise ShutdownRequested(signum)

    def _interruptible(self, call: Callable[[], T], what: str) -> T:
        """``call()``, ended by a signal: a handler that observes cancel scopes runs it
        in the shutdown request's scope (a signal cancels every store wait inside it);
        any other runs in a helper thread (see ``agent.interrupt``)."""

        def on_signal() -> None:
            log.info("stopped while waiting for the %s", what)
            self._check_shutdown()

        if not self._rdzv.observes_cancel_scope:
            return call_interruptibly(call, self._shutdown, on_signal, what)
        try:
            with self._shutdown.scope.active():
                return call()
        except Cancelled:
            on_signal()  # raises ShutdownRequested
            raise

    def _start_round(self) -> None:
        self._close_bootstrap_store()  # the previous round is over for every node
        self._phases.move(AgentPhase.RENDEZVOUS)
        t0 = self._clock.monotonic()
        info = self._interruptible(self._handler.next_rendezvous, "rendezvous")
        rdzv_ms = (self._clock.monotonic() - t0) * 1000
        plan = self._plan(info)
        self._pace.start_round(
            info.store, self._handler.get_run_id(), info.round, info.rank, info.world_size
        )
        self._host_bootstrap_store(plan)
        self._metrics.put("agent.rendezvous.duration_ms", rdzv_ms)
        self._metrics.put("agent.group_rank", info.rank)
        self._metrics.put("agent.group_world_size", info.world_size)
        self._events.record(
            "agent.rendezvous",
            {
                "round": info.round,
                "group_rank": info.rank,
                "group_world_size": info.world_size,
                "duration_ms": round(rdzv_ms, 3),
            },
        )
        self._start_workers(plan)

    def _plan(self, info: RendezvousInfo) -> LaunchPlan:
        spec = self._spec
        group = self._group
        group.group_rank = info.rank
        group.group_world_size = info.world_size
        group.store = info.store
        group.master_addr = spec.master_addr or info.bootstrap_store_info.master_addr
        group.master_port = spec.master_port or info.bootstrap_store_info.master_port
        facts = RoundFacts(
            run_id=self._handler.get_run_id(),
            round=info.round,
            group_rank=info.rank,
            group_world_size=info.world_size,
            master_addr=group.master_addr,
            master_port=group.master_port,
            restart_count=self._budget.used,
            max_restarts=self._budget.limit,
            use_agent_store=self._handler.use_agent_store or self._agent_store(info.rank),
        )
        nodes = [NodeSlot(r, lws) for r, lws, count in info.shape for _ in range(count)]
        if not nodes:
            nodes = [NodeSlot(m.role, m.local_world_size) for m in info.members] or [
                NodeSlot(spec.role, spec.local_world_size)
            ] * info.world_size
        assert spec.entrypoint is not None
        return build_plan(
            facts,
            role=spec.role,
            local_world_size=spec.local_world_size,
            nodes=nodes,
            entrypoint=spec.entrypoint,
            args=spec.args,
            base_env=self._environ,
            python=self._python,
            virtual_local_rank=spec.virtual_local_rank,
        )

    # -- the workers' bootstrap store ----------------------------------------------

    def _agent_store(self, group_rank: int) -> bool:
        """Whether the workers bootstrap from a store the agents host (elastrun's own
        handlers): the agent of group rank 0 serves it, so it outlives any worker."""
        del group_rank  # every node's workers use it; only rank 0's agent serves it
        return self._handler.agent_hosts_bootstrap_store

    def _host_bootstrap_store(self, plan: LaunchPlan) -> None:
        facts = plan.facts
        if facts.group_rank != 0 or not self._agent_store(facts.group_rank):
            return
        addr = facts.master_addr
        server = LazyTorchWireServer(_listen_host(addr), facts.master_port)
        try:
            server.start()
        except StoreError as exc:
            raise RendezvousError(
                f"cannot serve the workers' store at {addr}:{facts.master_port}: {exc}"
            ) from exc
        self._bootstrap_store = server
        log.debug("serving the workers' store for round %d: %r", facts.round, server)

    def _close_bootstrap_store(self) -> None:
        server, self._bootstrap_store = self._bootstrap_store, None
        if server is not None:
            server.close()

    # -- starting ------------------------------------------------------------------

    def _starter_for(self, plan: LaunchPlan) -> ProcessStarter:
        if self._starter is not None:
            return self._starter
        if plan.function is not None and self._start_method == "fork":
            return ForkStarter()
        return SubprocessStarter(self._python)

    def _worker_envs(self, plan: LaunchPlan) -> dict[int, dict[str, str]]:
        """Each worker's environment: the agent's, the plan's, the file timer's and the
        progress board's variables."""
        extra: dict[str, str] = {}
        if self._file_timer is not None:
            self._file_timer.start(plan.facts.run_id)
            extra.update(self._file_timer.worker_env())
        envs = {w.local_rank: {**self._environ, **extra, **w.env} for w in plan.workers}
        self._progress.add_worker_env(envs)
        return envs

    def _start_workers(self, plan: LaunchPlan) -> None:
        t0 = self._clock.monotonic()
        number = self._attempts
        self._attempts += 1
        envs = self._worker_envs(plan)
        cpus = {
            w.local_rank: binding_cpus(self._numa, w.local_rank, self._spec.local_world_size)
            for w in plan.workers
        }
        # A log directory that fails now (full disk, removed) must not end the agent.
        dest = reify_or_console(self._logs, envs)
        for env in envs.values():
            error_file = env.get("TORCHELASTIC_ERROR_FILE", "")
            if error_file and error_file != os.devnull:
                env["ELASTRUN_STACKS_FILE"] = os.path.join(
                    os.path.dirname(error_file), "stacks.txt"
                )
        relay = OutputRelay(
            filtered_stdout=dest.filtered_stdout,
            filtered_stderr=dest.filtered_stderr,
            stdout_filters=self._spec.duplicate_stdout_filters or (),
            stderr_filters=self._spec.duplicate_stderr_filters or (),
        )
        starter = self._starter_for(plan)
        shown = self._logs.local_ranks_filter
        procs: list[WorkerProcess] = []
        try:
            for w in plan.workers:
                lr = w.local_rank
                prefix = format_line_prefix(
                    self._prefix_template, plan.role, w.ranks.global_rank, lr
                )
                stdio = relay.wire(lr, dest, prefix, show_on_console=shown is None or lr in shown)
                try:
                    spec = self._process_spec(plan, lr, envs[lr], stdio, cpus[lr])
                    proc = starter.start(spec)
                finally:
                    stdio.close_in_parent()
                self._guard.watch(proc.pid)
                procs.append(proc)
                self._group.workers[lr].id = proc.pid
        except BaseException:
            partial = ProcessSet(procs, clock=self._clock)
            partial.stop(signal.SIGKILL, 0)
            partial.close()
            relay.close()
            raise
        self._attempt = _Attempt(
            number=number,
            plan=plan,
            dest=dest,
            procs=ProcessSet(procs, wake_fd=self._shutdown.waker.fileno(), clock=self._clock),
            relay=relay,
            started_at=self._clock.time(),
            stderr_files={lr: p for lr, p in dest.stderrs.items() if p},
            stacks_files={
                lr: env["ELASTRUN_STACKS_FILE"]
                for lr, env in envs.items()
                if "ELASTRUN_STACKS_FILE" in env
            },
        )
        self._update_ranks(plan)
        self._pace.start_attempt(number, {w.local_rank: w.ranks.global_rank for w in plan.workers})
        _write_workers_file(envs, procs)
        self._transition(WorkerState.HEALTHY)
        self._phases.move(AgentPhase.RUNNING)
        took = (self._clock.monotonic() - t0) * 1000
        log.info(
            "started %d worker(s) (attempt %d, restart %d of %d) in %.0f ms; %s",
            len(procs),
            number,
            self._budget.used,
            self._budget.limit,
            took,
            ", ".join(
                f"rank {w.ranks.global_rank}: pid {p.pid}"
                for w, p in zip(plan.workers, procs, strict=True)
            ),
        )
        self._metrics.put("agent.workers_start.duration_ms", took)
        self._metrics.put("agent.world_size", plan.workers[0].ranks.world_size)
        self._metrics.put("agent.remaining_restarts", self._budget.limit - self._budget.used)
        self._events.record(
            "agent.workers_started",
            {
                "attempt": number,
                "restart_count": self._budget.used,
                "duration_ms": round(took, 3),
                "pids": ",".join(str(p.pid) for p in procs),
            },
        )

    def _process_spec(
        self,
        plan: LaunchPlan,
        local_rank: int,
        env: dict[str, str],
        stdio: object,
        cpus: frozenset[int] | None = None,
    ) -> ProcessSpec:
        worker = plan.workers[local_rank]
        stdout_fd = getattr(stdio, "stdout_fd", None)
        stderr_fd = getattr(stdio, "stderr_fd", None)
        if plan.function is None:
            return ProcessSpec(
                local_rank,
                env,
                argv=worker.argv,
                stdout_fd=stdout_fd,
                stderr_fd=stderr_fd,
                cpus=cpus,
            )
        if self._return_dir is None:
            self._return_dir = tempfile.mkdtemp(prefix="elastrun-ret-")
        ret = os.path.join(self._return_dir, f"a{self._attempts - 1}_r{local_rank}.pkl")
        call = FunctionCall(plan.function, worker.args, ret)
        return ProcessSpec(
            local_rank, env, call=call, stdout_fd=stdout_fd, stderr_fd=stderr_fd, cpus=cpus
        )

    def _update_ranks(self, plan: LaunchPlan) -> None:
        for w in plan.workers:
            worker = self._group.workers[w.local_rank]
            worker.global_rank = w.ranks.global_rank
            worker.role_rank = w.ranks.role_rank
            worker.world_size = w.ranks.world_size
            worker.role_world_size = w.ranks.role_world_size

    # -- stopping, restarting, finishing -----------------------------------------------

    def _finish_attempt(self, sig: int) -> None:
        """Stop whatever still runs of the current attempt and drain its output."""
        attempt = self._attempt
        if attempt is None:
            return
        t0 = self._clock.monotonic()
        running = attempt.procs.running()
        report = attempt.procs.stop(
            sig, self._shutdown_timeout, abort_wait=lambda: self._shutdown.count > 1
        )
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

    def _restart_after_failure(self, failed: list[Exit]) -> None:
        self._phases.move(AgentPhase.RESTARTING)
        t0 = self._clock.monotonic()
        attempt = self._attempt
        assert attempt is not None
        first = failed[0]
        rank = attempt.plan.workers[first.local_rank].ranks.global_rank
        what = _describe_exit(first.exitcode)
        self._note_expired_timers()
        if first.pid in self._reasons:
            what = f"{what} ({self._reasons[first.pid]})"
        line = (
            f"attempt {attempt.number}: rank {rank} "
            f"(local {first.local_rank}, pid {first.pid}) {what}"
        )
        self.history.append(line)
        log.warning(
            "worker rank %d (local rank %d, pid %d) %s; restarting all workers (restart %d of %d)",
            rank,
            first.local_rank,
            first.pid,
            what,
            self._budget.used,
            self._budget.limit,
        )
        self._metrics.put("agent.restarts", 1)
        self._metrics.put("agent.worker_failures", len(failed))
        self._record_failures(attempt, failed, restart=True)
        self._events.record(
            "agent.restart",
            {
                "attempt": attempt.number,
                "rank": rank,
                "exitcode": first.exitcode,
                "restart_count": self._budget.used,
            },
        )
        self._finish_attempt(signal.SIGTERM)
        self._transition(WorkerState.STOPPED)
        self._check_shutdown()
        self._start_round()
        self._metrics.put("agent.restart.duration_ms", (self._clock.monotonic() - t0) * 1000)

    def _fail(self, failed: list[Exit], stuck: int | None = None) -> RunResult:
        """Stop everything and report: the restart budget ran out, or a worker is stuck
        in uninterruptible sleep (``stuck``: its local rank; restarting cannot help)."""
        attempt = self._attempt
        assert attempt is not None
        self._finish_attempt(signal.SIGTERM)
        self._note_expired_timers()
        failures: dict[int, ProcessFailure] = {}
        exits = sorted(attempt.procs.exits.values(), key=lambda e: (e.observed_at, e.local_rank))
        for ex in exits:
            if ex.exitcode == 0:
                continue
            worker = attempt.plan.workers[ex.local_rank]
            failures[worker.ranks.global_rank] = ProcessFailure(
                local_rank=ex.local_rank,
                pid=ex.pid,
                exitcode=ex.exitcode,
                error_file=attempt.dest.error_files.get(ex.local_rank, ""),
                global_rank=worker.ranks.global_rank,
                host=self._host,
                observed_at=ex.observed_at,
                terminated_by_agent=ex.by_agent and ex.local_rank != stuck,
                stderr_file=attempt.stderr_files.get(ex.local_rank),
                reason=self._reasons.get(ex.pid),
                log_problem=attempt.relay.log_problem(ex.local_rank),
            )
        self._record_failures(
            attempt, [ex for ex in exits if ex.exitcode != 0], restart=False, stuck=stuck
        )
        self.budget_note = self._failure_note(stuck)
        self._transition(WorkerState.FAILED)
        self._events.record(
            "agent.failed", {"failures": len(failures), "restarts": self._budget.used}
        )
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _failure_note(self, stuck: int | None) -> str:
        limit = self._budget.limit
        refusal = getattr(self._budget, "refusal", None)
        if stuck is not None:
            note = f"not restarted: local rank {stuck} was stuck in uninterruptible sleep"
        elif self.stalled:
            note = f"not restarted: the restarts made no progress: {self.stalled}"
        elif refusal:
            note = f"not restarted: {refusal}"
        else:
            note = (
                f"restart budget exhausted: {self._budget.used} of {limit} restart(s) used "
                f"(--max-restarts {limit})"
            )
        if self.history:
            note += "\nearlier failures:\n" + "\n".join(f"  {line}" for line in self.history)
        return note

    def _record_failures(
        self, attempt: _Attempt, failed: list[Exit], *, restart: bool, stuck: int | None = None
    ) -> None:
        """One ``agent.worker_failed`` event per failed exit, whether the job restarts
        or not (emitted before the restart event, so a log reader sees the cause first)."""
        for ex in failed:
            worker = attempt.plan.workers[ex.local_rank]
            self._events.record(
                "agent.worker_failed",
                {
                    "attempt": attempt.number,
                    "rank": worker.ranks.global_rank,
                    "local_rank": ex.local_rank,
                    "exitcode": ex.exitcode,
                    "pid": ex.pid,
                    "by_agent": ex.by_agent and ex.local_rank != stuck,
                    "restart": restart,
                },
            )

    def _describe_failure(self, attempt: _Attempt, first: Exit) -> str:
        """``rank R (local L) exited with code C``: what the other nodes are told."""
        rank = attempt.plan.workers[first.local_rank].ranks.global_rank
        return f"rank {rank} (local {first.local_rank}) {_describe_exit(first.exitcode)}"

    def _succeed(self, attempt: _Attempt) -> RunResult | None:
        """Every local worker finished: wait for the round's outcome on every node.

        Returns the result, or None when a failure elsewhere restarted the round (this
        node re-formed with the others and its workers run again).
        """
        values: dict[int, object] = {}
        for lr, proc in attempt.procs.processes.items():
            values[attempt.plan.workers[lr].ranks.global_rank] = proc.return_value()
        self._finish_attempt(signal.SIGTERM)
        self._phases.move(AgentPhase.EXIT_BARRIER)
        if self._rdzv.has_exit_barrier and (self._group.group_world_size or 1) > 1:
            log.info("workers finished; waiting for the other nodes (exit barrier)")
            outcome = self._interruptible(
                lambda: self._rdzv.exit_barrier(self._exit_barrier_timeout), "exit barrier"
            )
            result = self._after_barrier(outcome)
            if not isinstance(result, bool):
                return result
        self._transition(WorkerState.SUCCEEDED)
        self._events.record("agent.succeeded", {"restarts": self._budget.used})
        log.info("all %d worker(s) finished successfully", len(values))
        return RunResult(state=WorkerState.SUCCEEDED, return_values=values)

    def _after_barrier(self, outcome: BarrierResult) -> RunResult | bool | None:
        """Act on the round's outcome: True to finish successfully, None after
        re-forming (restart), or the failed result."""
        if outcome.outcome is RoundOutcome.SUCCEEDED:
            return True
        if outcome.outcome is RoundOutcome.TIMED_OUT:
            log.warning(
                "exit barrier timed out (%s); this node leaves, the others go on",
                outcome.reason,
            )
            return True
        if outcome.outcome is RoundOutcome.RESTART:
            log.warning(
                "this node's workers finished, but the round failed elsewhere (%s); "
                "re-forming and starting the workers again",
                outcome.reason,
            )
            self._events.record("agent.membership_change", {"reason": outcome.reason})
            self._metrics.put("agent.membership_changes", 1)
            self._transition(WorkerState.STOPPED)
            self._start_round()
            return None
        self.budget_note = f"the job failed on another node: {outcome.reason}"
        self._transition(WorkerState.FAILED)
        self._events.record("agent.failed", {"failures": 0, "restarts": self._budget.used})
        return RunResult(state=WorkerState.FAILED, failures={})

    # -- progress and hangs --------------------------------------------------------

    def _no_progress_since_restarts(self) -> bool:
        """Whether the last restarts made no progress (then: stop, with ``stalled`` set).

        Judged from the attempt that just failed, before its records are reset."""
        self.stalled = self._progress.stalled()
        if self.stalled is None:
            return False
        log.error("not restarting: %s", self.stalled)
        self._events.record("agent.no_progress", {"detail": self.stalled})
        return True

    def _check_hang(self, attempt: _Attempt) -> None:
        """Workers that made no progress for the hang timeout: keep the evidence (every
        local worker's stacks), then kill the hung ones -- their exits are failures the
        restart policy handles, with the hang as the reason in the report."""
        if attempt.hang_handled:
            return
        running = attempt.procs.running()
        verdict = self._progress.hang(running)
        if verdict is None:
            return
        attempt.hang_handled = True
        pids = attempt.procs.pids()
        dumps = request_stacks(attempt.stack_requests(running))
        ranks = {w.local_rank: w.ranks.global_rank for w in attempt.plan.workers}
        first = ", ".join(f"rank {ranks[lr]}" for lr in verdict.stopped_first)
        self._events.record(
            "agent.hang",
            {"attempt": attempt.number, "stopped_first": first, "verdict": verdict.describe()},
        )
        self._reasons.update(hang_reasons(verdict, ranks, pids, dumps))
        for lr in verdict.hung:
            try:
                os.killpg(pids[lr], signal.SIGKILL)  # our unreaped child leads its group
            except OSError:
                pass  # it exited meanwhile; its exit is seen as usual

    def _check_stuck_at_exit(self, attempt: _Attempt) -> None:
        """Warn (once, with stacks) about workers still running long after every other
        local worker exited successfully: a teardown deadlock looks like this, and
        neither it nor torchrun would ever say so. The worker is not stopped."""
        limit = self._stuck_exit_timeout
        exits = attempt.procs.exits
        if limit is None or not exits or any(e.exitcode != 0 for e in exits.values()):
            attempt.lonely_since = None
            return
        now = self._clock.monotonic()
        if attempt.lonely_since is None:
            attempt.lonely_since = now
        if attempt.lonely_reported or now - attempt.lonely_since < limit:
            return
        attempt.lonely_reported = True
        running = attempt.procs.running()
        pids = attempt.procs.pids()
        dumps = request_stacks(attempt.stack_requests(running))
        for lr in running:
            rank = attempt.plan.workers[lr].ranks.global_rank
            dump = dumps.get(lr)
            where = (
                f"its stacks are in {dump.path}"
                if dump is not None and dump.text
                else "it did not answer a stack request"
            )
            log.warning(
                "rank %d (local rank %d, pid %d) is still running %.0fs after every other "
                "local rank exited successfully; %s (it is not stopped)",
                rank, lr, pids[lr], now - attempt.lonely_since, where,
            )  # fmt: skip
            self._events.record(
                "agent.worker_stuck_at_exit",
                {"attempt": attempt.number, "rank": rank, "local_rank": lr, "pid": pids[lr],
                 "stacks": dump.path if dump is not None and dump.text else ""},
            )  # fmt: skip

    def _on_phase(self, old: AgentPhase, new: AgentPhase) -> None:
        log.debug("agent phase %s -> %s", old.value, new.value)
        self._events.record("agent.phase", {"from": old.value, "to": new.value})

    def _transition(self, new: WorkerState) -> None:
        old = self._group.state
        if new not in _TRANSITIONS[old]:
            raise RuntimeError(f"illegal worker-group transition {old.value} -> {new.value}")
        self._group.state = new
        self._metrics.put(f"agent.state.{new.value}", 1)  # the one-hot state gauge
        meta: dict[str, EventValue] = {"from": old.value, "to": new.value}
        self._events.record("agent.state", meta)

    def __repr__(self) -> str:
        return (
            f"LocalElasticAgent(role={self._spec.role!r}, state={self._group.state.value}, "
            f"attempts={self._attempts}, budget={self._budget!r})"
        )


def _write_workers_file(envs: dict[int, dict[str, str]], procs: list[WorkerProcess]) -> None:
    """``<attempt>/workers.json``: each local rank's pid, for ``elastrun stacks``."""
    files = [envs[p.local_rank].get("ELASTRUN_STACKS_FILE") for p in procs]
    if not procs or not files[0]:
        return
    attempt_dir = os.path.dirname(os.path.dirname(str(files[0])))
    data = {
        str(p.local_rank): {"pid": p.pid, "stacks": f, "start_time": process_start_time(p.pid)}
        for p, f in zip(procs, files, strict=True)
    }
    try:
        with open(os.path.join(attempt_dir, "workers.json"), "w", encoding="utf-8") as fh:
            json.dump({"version": 1, "workers": data}, fh)
    except OSError as exc:
        log.debug("could not write workers.json: %s", exc)


def _default_budget(rdzv: ElasticRendezvous, spec: WorkerSpec) -> RestartBudget:
    """Job-wide when the rendezvous keeps a budget in its store, else this agent's own."""
    if rdzv.keeps_job_budget:
        return JobRestartBudget(rdzv, spec.max_restarts)
    return LocalRestartBudget(spec.max_restarts)


def _listen_host(addr: str) -> str:
    """Where the workers' store listens: only on loopback when the workers reach it
    there (a single node), else on every interface, as torch's own store does."""
    if addr == "localhost":
        return addr
    try:
        return addr if ipaddress.ip_address(addr).is_loopback else ""
    except ValueError:
        return ""  # a host name: the other nodes resolve it to one of our interfaces


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
