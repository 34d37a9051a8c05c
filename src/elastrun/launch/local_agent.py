"""``LocalElasticAgent``: the torch-compatible face of the elastic loop of one node.

torch's callers build the agent with its arguments and call ``run``. Here those
arguments become one frozen ``AgentOptions`` (agent.options) and one ``World`` of
injected collaborators (agent.parts), from which ``assemble`` (launch.assemble) builds
the agent's parts and ``ElasticLoop`` (agent.loop) runs them; this class only holds the
loop and answers for it. It sits in the launch layer with the composition it calls.
"""

from __future__ import annotations

import dataclasses
import os

from elastrun.agent.loop import ElasticLoop
from elastrun.agent.options import AgentOptions
from elastrun.agent.parts import World
from elastrun.agent.phases import AgentPhase
from elastrun.agent.spec import RunResult, WorkerGroup, WorkerSpec
from elastrun.agent.watches import STUCK_EXIT_TIMEOUT, FileTimer
from elastrun.agent.workers import Guard
from elastrun.core.errors import ConfigError
from elastrun.launch.assemble import assemble
from elastrun.rendezvous.api import RendezvousHandler
from elastrun.supervise.processes.logs import LogsSpecs

__all__ = ["STUCK_EXIT_TIMEOUT", "FileTimer", "Guard", "LocalElasticAgent"]


class LocalElasticAgent:
    """Runs, watches and restarts the workers of one node.

    Args:
        spec: what to run. ``spec.rdzv_handler`` None means a single standalone node.
        logs_specs: where worker output and error files go (default: a temporary dir).
        start_method, exit_barrier_timeout, log_line_prefix_template, shutdown_timeout:
            torch's settings (see ``AgentOptions``), read with the rest of the options
            from this process's environment when ``options`` is None (torch's callers
            build the agent in the process whose environment the workers inherit: for
            them this class is the edge where the environment is read).
        health_check_server: accepted for torch's callers, unused.
        options: every setting, as one value built by the caller (``AgentOptions``);
            torch's settings above are then not to be given as well.
        world: the injected collaborators (``World``: clock, process starter, sinks...;
            production defaults where None); ``logs_specs`` is its ``logs``.

    Raises:
        ConfigError: a setting with a bad value, named; or ``options`` given together
            with settings it holds (they would be ignored), or ``world.logs`` together
            with ``logs_specs``, named.
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
        options: AgentOptions | None = None,
        world: World | None = None,
    ) -> None:
        torch_settings = {
            "start_method": (start_method, "spawn"),
            "exit_barrier_timeout": (exit_barrier_timeout, 300),
            "log_line_prefix_template": (log_line_prefix_template, None),
            "shutdown_timeout": (shutdown_timeout, 30),
        }
        given = sorted(k for k, (value, default) in torch_settings.items() if value != default)
        if options is not None and given:
            raise ConfigError(
                "options",
                ", ".join(given),
                "given together with settings that options holds (they would be "
                "ignored): set them in options",
            )
        if options is None:
            options = AgentOptions.from_environ(
                os.environ,
                start_method=start_method,
                exit_barrier_timeout=exit_barrier_timeout,
                log_line_prefix_template=log_line_prefix_template,
                shutdown_timeout=shutdown_timeout,
            )
        world = world or World()
        if logs_specs is not None:
            if world.logs is not None:
                raise ConfigError("logs_specs", logs_specs, "given together with world.logs")
            world = dataclasses.replace(world, logs=logs_specs)
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
