"""``LocalElasticAgent``: the torch-compatible face of the elastic loop of one node.

torch's callers build the agent with its arguments and call ``run``. Here those
arguments become one frozen ``AgentOptions`` (agent.options) and one ``World`` of
injected collaborators (agent.parts), from which ``assemble`` (launch.assemble) builds
the agent's parts and ``ElasticLoop`` (agent.loop) runs them; this class only holds the
loop and answers for it. It sits in the launch layer with the composition it calls.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from elastrun.agent.loop import ElasticLoop
from elastrun.agent.options import AgentOptions
from elastrun.agent.parts import World
from elastrun.agent.phases import AgentPhase
from elastrun.agent.policy import RestartBudget, RestartPolicy
from elastrun.agent.spec import RunResult, WorkerGroup, WorkerSpec
from elastrun.agent.watches import STUCK_EXIT_TIMEOUT, FileTimer
from elastrun.agent.workers import Guard
from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.errors import ConfigError
from elastrun.core.shutdown import ShutdownRequest
from elastrun.launch.assemble import assemble
from elastrun.observe.sinks import EventSink, MetricSink
from elastrun.pace import AutoTimeout, StragglerSettings
from elastrun.rendezvous.api import RendezvousHandler
from elastrun.supervise.processes.dstate import UninterruptibleWatch
from elastrun.supervise.processes.logs import LogsSpecs
from elastrun.supervise.processes.relay import PYTHON_CONSOLE, Console
from elastrun.supervise.processes.spawn import ProcessStarter

__all__ = ["STUCK_EXIT_TIMEOUT", "FileTimer", "Guard", "LocalElasticAgent"]


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
        crash_loop_stop: stop restarting (``crash_loop`` is then set) when a rank
            fails twice in a row with the same error at the same step
            (``elastrun.supervise.failures.crashloop``); False: spend the whole budget.
        stragglers: how ranks (and nodes) slower than their peers are found and
            reported (never stopped); None: off (step metrics are still put).
        stuck_exit_timeout: seconds a worker may keep running after every other local
            worker exited successfully before its stacks are dumped and a warning
            names it (it is not stopped); None turns the check off.
        console: where tee'd lines are shown: ``sys.stdout``/``sys.stderr`` as they are
            at each start of the workers (torch's behaviour, so ``redirect_stdout`` or a
            notebook cell sees them) by default; the CLI passes ``FD_CONSOLE``.
        starter, policy, budget, clock, python, events, guard: injected
            collaborators (production defaults when None).
        environ: the agent's environment, which the workers inherit and the settings
            (``ELASTRUN_INPROCESS*``, ``TORCHELASTIC_SIGNALS_TO_HANDLE``) are read from;
            None: this process's (torch's callers build the agent in the process whose
            environment the workers inherit: for them this class is the edge where the
            environment is read).
        options: everything above that is not a collaborator, as one value built by
            the caller; the settings above are then not to be given as well.

    Raises:
        ConfigError: a setting with a bad value, named; or ``options`` given together
            with settings it holds (they would be ignored), named.
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
        crash_loop_stop: bool = True,
        stragglers: StragglerSettings | None = StragglerSettings(),  # noqa: B008 (frozen)
        console: Console = PYTHON_CONSOLE,
        options: AgentOptions | None = None,
    ) -> None:
        settings = {
            "start_method": (start_method, "spawn"),
            "exit_barrier_timeout": (exit_barrier_timeout, 300),
            "log_line_prefix_template": (log_line_prefix_template, None),
            "shutdown_timeout": (shutdown_timeout, 30),
            "run_id": (run_id, None),
            "environ": (environ, None),
            "python": (python, sys.executable),
            "hostname": (hostname, None),
            "stuck_exit_timeout": (stuck_exit_timeout, STUCK_EXIT_TIMEOUT),
            "hang_timeout": (hang_timeout, None),
            "stalled_restarts": (stalled_restarts, 3),
            "crash_loop_stop": (crash_loop_stop, True),
            "stragglers": (stragglers, StragglerSettings()),
        }
        given = sorted(name for name, (value, default) in settings.items() if value != default)
        if options is not None and given:
            raise ConfigError(
                "options",
                ", ".join(given),
                "given together with settings that options holds (they would be "
                "ignored): set them in options",
            )
        options = options or AgentOptions.from_environ(
            os.environ if environ is None else environ,
            start_method=start_method,
            exit_barrier_timeout=exit_barrier_timeout,
            log_line_prefix_template=log_line_prefix_template,
            shutdown_timeout=shutdown_timeout,
            run_id=run_id,
            python=python,
            hostname=hostname,
            stuck_exit_timeout=stuck_exit_timeout,
            hang_timeout=hang_timeout,
            stalled_restarts=stalled_restarts,
            crash_loop_stop=crash_loop_stop,
            stragglers=stragglers,
        )
        world = World(
            logs=logs_specs,
            shutdown=shutdown,
            starter=starter,
            policy=policy,
            budget=budget,
            clock=clock,
            events=events,
            metrics=metrics,
            guard=guard,
            file_timer=file_timer,
            stuck_watch=stuck_watch,
            console=console,
        )
        self._loop = ElasticLoop(assemble(spec, options, world))

    @classmethod
    def running(cls, loop: ElasticLoop) -> LocalElasticAgent:
        """The face of ``loop``, an agent already assembled (by the launcher, the
        composition root of the command line)."""
        agent = cls.__new__(cls)
        agent._loop = loop
        return agent

    def run(self, role: str = "default") -> RunResult:
        """Run the workers to completion, restarting them on failure.

        Returns the result (``FAILED`` with the failures when the restart budget ran
        out). Raises ``ShutdownRequested`` after stopping the workers on a signal.
        """
        return self._loop.run()

    # -- what the launcher, the health check and torch's callers read --------------------

    @property
    def rdzv_handler(self) -> RendezvousHandler:
        return self._loop.parts.handler

    @property
    def logs_specs(self) -> LogsSpecs:
        return self._loop.parts.logs

    def get_worker_group(self, role: str = "default") -> WorkerGroup:
        return self._loop.parts.group

    @property
    def phase(self) -> AgentPhase:
        """What the agent is doing now (rendezvous, running, exit barrier...)."""
        return self._loop.parts.lifecycle.phase

    @property
    def history(self) -> list[str]:
        """One line per failure that caused a restart."""
        return self._loop.history

    @property
    def budget_note(self) -> str | None:
        """Why the run failed as it did (the restart budget, a stuck worker...), or None."""
        return self._loop.budget_note

    @property
    def stalled(self) -> str | None:
        """Why restarting stopped because the restarts made no progress (else None)."""
        return self._loop.stalled

    @property
    def crash_loop(self) -> str | None:
        """Why restarting stopped because a rank failed the same way at the same step
        twice in a row (else None)."""
        return self._loop.crash_loop

    @property
    def last_progress(self) -> float:
        """Wall-clock time of the loop's last pass."""
        return self._loop.last_progress

    def alive(self) -> float:
        """The last sign of progress (for the health check): the file timer's, if any."""
        file_timer = self._loop.parts.file_timer
        if file_timer is not None:
            return max(self.last_progress, file_timer.get_last_progress_time())
        return self.last_progress

    def status(self) -> dict[str, object]:
        """A snapshot for the health check and status views."""
        p = self._loop.parts
        g = p.group
        return {
            "state": g.state.value,
            "phase": p.lifecycle.phase.value,
            "run_id": p.handler.get_run_id(),
            "attempt": self._loop.attempts - 1,
            "restart_count": p.budget.used(),
            "max_restarts": p.budget.limit,
            "group_rank": g.group_rank,
            "group_world_size": g.group_world_size,
            "workers": [w.id for w in g.workers],
            "progress": p.progress.status(),
            "excluded_nodes": p.cooldown.status(),
        }

    def __repr__(self) -> str:
        p = self._loop.parts
        return (
            f"LocalElasticAgent(role={p.spec.role!r}, state={p.group.state.value}, "
            f"attempts={self._loop.attempts}, budget={p.budget!r})"
        )
