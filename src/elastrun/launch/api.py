"""``elastic_launch`` and ``launch_agent``: the Python API of the launcher."""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

from elastrun.agent.spec import Entrypoint, RunResult
from elastrun.core.cancel import Cancelled
from elastrun.core.errors import ConfigError, ShutdownRequested, WorkerFailure
from elastrun.core.shutdown import ShutdownRequest
from elastrun.launch.config import LaunchConfig, parse_signals
from elastrun.launch.signals import install_signal_handlers
from elastrun.observe.sinks import MetricSink
from elastrun.rendezvous.registry import rendezvous_handler_registry
from elastrun.supervise.failures.report import ChildFailedError, NoProgressError
from elastrun.supervise.processes.logs import DefaultLogsSpecs
from elastrun.wire.env import HEALTH_CHECK_PORT_ENV, SIGNALS_TO_HANDLE_ENV

if TYPE_CHECKING:
    # Imported when the agent is built, after the worker template was started: loading
    # the agent then overlaps the template's own start-up (see _Launch._prepare_template).
    from elastrun.launch.local_agent import LocalElasticAgent
    from elastrun.supervise.processes.relay import Console
    from elastrun.template.agent.starter import TemplateStarter

log = logging.getLogger("elastrun.launch")


class elastic_launch:
    """Launch ``entrypoint`` on this node's workers: ``elastic_launch(config, fn)(*args)``.

    Returns ``{global_rank: return_value}`` for this node's workers (None for
    executables). Raises ``ChildFailedError`` when workers failed and the restart
    budget ran out.
    """

    def __init__(self, config: LaunchConfig, entrypoint: Entrypoint | None) -> None:
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: object) -> dict[int, object]:
        return launch_agent(self._config, self._entrypoint, list(args))


def entrypoint_name(entrypoint: Entrypoint | None, args: Sequence[object]) -> str:
    """The name shown in reports: a callable's name, or the script a Python runs."""
    if entrypoint is None:
        return ""
    if callable(entrypoint):
        return getattr(entrypoint, "__name__", repr(entrypoint))
    if entrypoint == sys.executable:
        return next((a for a in args if isinstance(a, str) and not a.startswith("-")), "")
    return entrypoint


class _Extras(ExitStack):
    """The observability pieces of one launch: event sink, metrics, health check, and the
    worker template; closing stops those started, the last one first."""

    def __init__(
        self,
        config: LaunchConfig,
        run_id: str,
        entrypoint: Entrypoint,
        shutdown: ShutdownRequest | None = None,
    ) -> None:
        super().__init__()
        import socket

        from elastrun.metrics import FanoutMetricSink, MetricsApiSink
        from elastrun.observe.eventlog import make_event_sink

        context: dict[str, str | int | float | bool | None] = {
            "run_id": run_id,
            "hostname": socket.getfqdn(),
            "agent_pid": os.getpid(),
        }
        self.events = make_event_sink(config.event_log_handler, context=context)
        probe = getattr(self.events, "probe", None)
        if probe is not None:
            probe()
        self.metrics: MetricSink = MetricsApiSink()
        if config.metrics_port is not None:
            from elastrun.observe.prometheus import MetricsServer

            server = MetricsServer(config.metrics_port)
            server.start()
            self.callback(server.stop)
            self.metrics = FanoutMetricSink(server.sink, MetricsApiSink())
        self.starter: TemplateStarter | None = None
        if config.use_template and isinstance(entrypoint, str):
            from elastrun.template.agent.starter import TemplateStarter

            # One template per agent, kept across restarts: that is where the speed is.
            self.starter = TemplateStarter(entrypoint, preload=config.preload, shutdown=shutdown)
            self.callback(self.starter.close)

    def start_health(self, agent: LocalElasticAgent, environ: Mapping[str, str]) -> None:
        from elastrun.observe.health import HealthCheckServer, port_from_env

        port = port_from_env(dict(environ))
        if port is None:
            return
        server = HealthCheckServer(agent.alive, port, state_callback=agent.status)
        try:
            server.start()
        except OSError as exc:
            why = f"cannot serve: {exc.strerror or exc}"
            raise ConfigError(HEALTH_CHECK_PORT_ENV, port, why) from exc
        self.callback(server.stop)


def launch_agent(
    config: LaunchConfig,
    entrypoint: Entrypoint | None,
    args: Sequence[object],
    *,
    shutdown: ShutdownRequest | None = None,
    environ: Mapping[str, str] | None = None,
    on_agent: Callable[[LocalElasticAgent], None] | None = None,
    console: Console | None = None,
) -> dict[int, object]:
    """Run the workers of this node to completion.

    Installs the signal handlers of ``config.signals_to_handle`` for the duration of
    the run unless a ``shutdown`` request is passed in (then the caller owns signals).
    Tee'd worker lines go to ``console``: by default ``sys.stdout``/``sys.stderr`` as
    they are at each start of the workers, as with torch (the ``elastrun`` CLI passes
    ``FD_CONSOLE``: its descriptors 1 and 2).

    Raises:
        ChildFailedError: workers failed and the restart budget ran out.
        ShutdownRequested: a handled signal stopped the run.
        ConfigError: invalid configuration found while wiring.
    """
    if entrypoint is None:
        raise ConfigError("entrypoint", None, "nothing to launch")
    env = os.environ if environ is None else environ
    config.check_before_start(env)
    run_id = config.run_id or str(uuid.uuid4().int)
    os.environ[SIGNALS_TO_HANDLE_ENV] = config.signals_to_handle
    with ExitStack() as owned:  # the request and handlers made here, undone at the end
        if shutdown is None:
            shutdown = ShutdownRequest()
            owned.callback(shutdown.close)
            signals = parse_signals(config.signals_to_handle)
            owned.callback(install_signal_handlers(signals, shutdown))
        launch = _Launch(
            config, entrypoint, args, run_id=run_id, shutdown=shutdown, console=console
        )
        try:
            return launch.run(env, on_agent)
        except ShutdownRequested:
            launch.signalled = True
            raise
        finally:
            if launch.extras is not None:  # the observability servers and the template
                launch.extras.close()
            # A signal ends the wait of a node that serves the store for the others.
            with shutdown.scope.active():
                launch.leave()


@dataclass(eq=False)
class _Launch:
    """One run of ``launch_agent``: it wires and runs the agent, and keeps what it built
    and how it ended for the cleanup."""

    config: LaunchConfig
    entrypoint: Entrypoint
    args: Sequence[object]
    _: KW_ONLY
    run_id: str
    shutdown: ShutdownRequest
    console: Console | None
    agent: LocalElasticAgent | None = None
    extras: _Extras | None = None
    signalled: bool = False
    succeeded: bool = False

    def run(
        self,
        environ: Mapping[str, str],
        on_agent: Callable[[LocalElasticAgent], None] | None,
    ) -> dict[int, object]:
        """Wire the agent, run it, and raise what a failed run ends with."""
        self.extras = extras = _Extras(self.config, self.run_id, self.entrypoint, self.shutdown)
        self._prepare_template(extras.starter, environ)
        try:
            # The c10d handler reaches its store now: a signal ends that wait too.
            with self.shutdown.scope.active():
                self.agent = agent = self._build_agent(environ, extras)
        except Cancelled:
            raise ShutdownRequested(self.shutdown.signum or signal.SIGTERM) from None
        extras.start_health(agent, environ)
        if on_agent is not None:
            on_agent(agent)
        result = agent.run()
        self.succeeded = not result.is_failed()
        if result.is_failed():
            raise self._failure(agent, result)
        return result.return_values

    def _prepare_template(
        self, starter: TemplateStarter | None, environ: Mapping[str, str]
    ) -> None:
        """Start the worker template now, without waiting for it: its interpreter and
        imports then overlap loading and wiring the agent and the rendezvous instead of
        following them (on one node, about the template's whole start-up).

        The template serves the workers whose shared environment it was started with
        (``TemplateKey``); what a round decides (ranks, ports, run id) and the agent's
        own paths are per-worker variables, so local rank 0's worker as a provisional
        plan makes it (the dry run's plan, the same pure function the agent plans with).
        Should the first round's workers differ after all, the first start replaces the
        template, as for any change of the shared environment.
        """
        config, entrypoint = self.config, self.entrypoint
        if starter is None or not isinstance(entrypoint, str):
            return
        from elastrun.agent.plan import NodeSlot, RoundFacts, round_plan
        from elastrun.supervise.processes.spawn import ProcessSpec

        base = dict(environ)
        facts = RoundFacts(
            run_id="", round=0, group_rank=0, group_world_size=1, master_addr="",
            master_port=0, restart_count=0, max_restarts=config.max_restarts,
        )  # fmt: skip
        nodes = [NodeSlot(config.role, config.nproc_per_node)]
        try:
            spec = config.worker_spec(None, entrypoint, self.args)
            plan = round_plan(facts, spec, nodes, base_env=base, python=sys.executable)
        except ConfigError:
            return  # the real plan reports it, with the round's facts
        worker = plan.workers[0]
        if worker.argv is not None:
            starter.prepare(ProcessSpec(0, {**base, **worker.env}, argv=worker.argv))

    def _build_agent(self, env: Mapping[str, str], extras: _Extras) -> LocalElasticAgent:
        """Wire the agent (no process is started)."""
        from elastrun.agent.loop import ElasticLoop
        from elastrun.agent.parts import World
        from elastrun.launch.assemble import assemble
        from elastrun.launch.local_agent import LocalElasticAgent
        from elastrun.supervise.processes.dstate import UninterruptibleWatch, timeout_from_env
        from elastrun.supervise.processes.relay import PYTHON_CONSOLE
        from elastrun.supervise.timers.agent_timer import AgentFileTimer

        # The edge: the agent's settings are read from the environment here, once.
        config = self.config
        handler = rendezvous_handler_registry.create_handler(
            config.rendezvous_parameters(self.run_id)
        )
        spec = config.worker_spec(handler, self.entrypoint, self.args)
        stuck_after = timeout_from_env(env)
        options = config.agent_options(env)
        world = World(
            logs=config.logs_specs if config.logs_specs is not None else DefaultLogsSpecs(),
            shutdown=self.shutdown,
            events=extras.events,
            metrics=extras.metrics,
            file_timer=AgentFileTimer.from_env(env),
            stuck_watch=UninterruptibleWatch(stuck_after) if stuck_after else None,
            starter=extras.starter,
            console=PYTHON_CONSOLE if self.console is None else self.console,
        )
        # The composition root of the command line: the agent's parts, assembled here.
        return LocalElasticAgent.running(ElasticLoop(assemble(spec, options, world)))

    def _failure(self, agent: LocalElasticAgent, result: RunResult) -> Exception:
        """The error a failed run ends with."""
        if not result.failures:
            # The round failed on another node; this one has no failure of its own.
            return WorkerFailure(agent.budget_note or "the job failed on another node")
        name = entrypoint_name(self.entrypoint, self.args)
        if agent.stalled or agent.crash_loop:
            return NoProgressError(name, result.failures, budget_note=agent.budget_note)
        return ChildFailedError(name, result.failures, budget_note=agent.budget_note)

    def leave(self) -> None:
        """End this node's part in the rendezvous. Only a known outcome closes the run id
        (torch's ``shutdown``): success (every node finished), or a failure with no
        restart left (the failing node closed it with the reason). A node that stops on a
        signal or an error of its own (its store connection, a rendezvous timeout) only
        leaves: the other nodes decide for themselves."""
        if self.agent is None or self.signalled:
            return
        from elastrun.rendezvous.dynamic import DynamicRendezvousHandler

        handler = self.agent.rdzv_handler
        if isinstance(handler, DynamicRendezvousHandler):
            handler.shutdown(close=self.succeeded)
        else:
            handler.shutdown()
