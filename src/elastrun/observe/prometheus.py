"""The agent's metrics as a Prometheus endpoint (``--metrics-port``).

prometheus-client is an optional dependency (``pip install 'elastrun[metrics]'``): it
is imported only when a :class:`PrometheusMetricSink` is built, never when this module
is imported. Each sink has its own ``CollectorRegistry``, so two agents (or tests) in one
process never share or collide on metrics, and nothing leaks into the client's global
registry.

The agent speaks to the sink through :class:`~elastrun.observe.sinks.MetricSink`
(``put(name, value)``). The names it uses, and what each becomes, are in
:data:`AGENT_METRICS`; ``agent.state.<STATE>`` (value 1) sets the one-hot gauge
``elastrun_worker_group_state{state="<STATE>"}``; any other name is exported as
``elastrun_metric{name="<name>"}`` holding the last value put. A name with labels
(``worker.steps{rank=3,local_rank=1}``, see :func:`~elastrun.observe.sinks.labelled`)
whose base name is in :data:`AGENT_METRICS` sets that metric's labelled child.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from elastrun.core.errors import ConfigError
from elastrun.core.serving import Endpoint, NurseryRequests, Served
from elastrun.observe.sinks import split_labels

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger(__name__)

MetricKind = Literal["counter", "gauge", "histogram"]
#: The method that records a value put, by kind.
_UPDATE: dict[MetricKind, str] = {"counter": "inc", "gauge": "set", "histogram": "observe"}


@dataclass(frozen=True)
class MetricDef:
    """How one agent metric name maps onto a Prometheus metric.

    ``scale`` multiplies the value put: the agent measures durations in milliseconds,
    Prometheus wants base units (seconds). A counter's value is the increment.
    ``labels``: the label names a put must carry (the metric of one worker or node).
    """

    kind: MetricKind
    prom_name: str
    help: str
    scale: float = 1.0
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


_MS = 0.001
_RANK_LABELS = ("rank", "local_rank")
#: Step times range from a millisecond to minutes.
STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 300.0, math.inf,
)  # fmt: skip


def _worker_histogram(prom_name: str, help: str) -> MetricDef:
    """A duration of each worker, put in milliseconds (step-time buckets)."""
    return MetricDef("histogram", prom_name, help, _MS, _RANK_LABELS, STEP_BUCKETS)


#: The metric names the agent puts, and their Prometheus form.
AGENT_METRICS: dict[str, MetricDef] = {
    "agent.restarts": MetricDef(
        "counter", "elastrun_restarts", "Worker-group restarts after a failure (--max-restarts)"
    ),
    "agent.membership_changes": MetricDef(
        "counter",
        "elastrun_membership_changes",
        "Worker-group re-formations because nodes joined or left (not counted as restarts)",
    ),
    "agent.worker_failures": MetricDef(
        "counter", "elastrun_worker_failures", "Worker processes that exited with an error"
    ),
    "agent.rendezvous.duration_ms": MetricDef(
        "histogram",
        "elastrun_rendezvous_duration_seconds",
        "Time from entering a rendezvous round to its completion",
        _MS,
    ),
    "agent.workers_start.duration_ms": MetricDef(
        "histogram",
        "elastrun_workers_start_duration_seconds",
        "Time to start the local worker processes",
        _MS,
    ),
    "agent.workers_stop.duration_ms": MetricDef(
        "histogram",
        "elastrun_workers_stop_duration_seconds",
        "Time to stop the local worker processes",
        _MS,
    ),
    "agent.restart.duration_ms": MetricDef(
        "histogram",
        "elastrun_restart_duration_seconds",
        "Time from noticing a failure to running workers again (stop, rendezvous, start)",
        _MS,
    ),
    "agent.group_rank": MetricDef("gauge", "elastrun_group_rank", "This node's group rank"),
    "agent.group_world_size": MetricDef(
        "gauge", "elastrun_group_world_size", "Number of nodes in the current round"
    ),
    "agent.world_size": MetricDef(
        "gauge", "elastrun_world_size", "Number of workers in the whole job (WORLD_SIZE)"
    ),
    "agent.remaining_restarts": MetricDef(
        "gauge", "elastrun_remaining_restarts", "Restarts left before the job fails"
    ),
    "agent.stragglers": MetricDef(
        "counter",
        "elastrun_straggler_reports",
        "Stragglers reported: local ranks, and (by group rank 0's agent) nodes",
    ),
    "agent.excluded": MetricDef(
        "gauge",
        "elastrun_excluded",
        "1 while this node sits out a cool-down (--exclude-after), else 0",
    ),
    "agent.excluded_nodes": MetricDef(
        "gauge",
        "elastrun_excluded_nodes",
        "Nodes of the job sitting out a cool-down, as this node last read them",
    ),
    "agent.node_check_failed": MetricDef(
        "gauge",
        "elastrun_node_check_failed",
        "1 when this node failed its last node check (--node-check), else 0",
    ),
    "agent.node_check.duration_ms": MetricDef(
        "gauge", "elastrun_node_check_seconds", "How long this node's last node check took", _MS
    ),
    "worker.steps": MetricDef(
        "counter",
        "elastrun_worker_steps",
        "Progress reports (optimizer steps or elastrun.progress() calls) of each worker",
        labels=_RANK_LABELS,
    ),
    "worker.step": MetricDef(
        "gauge", "elastrun_worker_step", "The last step each worker reported", labels=_RANK_LABELS
    ),
    "worker.step.duration_ms": _worker_histogram(
        "elastrun_worker_step_seconds",
        "Time per step of each worker (the mean over each second in which it reported)",
    ),
    "worker.straggler": MetricDef(
        "gauge",
        "elastrun_worker_straggler",
        "1 while the worker is reported as a straggler (--straggler-factor), else 0",
        labels=_RANK_LABELS,
    ),
    "checkpoint.saves": MetricDef(
        "counter",
        "elastrun_checkpoint_saves",
        "Memory checkpoint saves each worker finished (kept, dropped or skipped)",
        labels=_RANK_LABELS,
    ),
    "checkpoint.blocked.duration_ms": _worker_histogram(
        "elastrun_checkpoint_blocked_seconds",
        "Time a memory checkpoint save blocked the training thread (the mean over each "
        "second's saves)",
    ),
    "checkpoint.save.duration_ms": _worker_histogram(
        "elastrun_checkpoint_save_seconds",
        "Time from a save's call until the worker's step is written (the mean over each "
        "second's saves)",
    ),
    "checkpoint.lag.duration_ms": _worker_histogram(
        "elastrun_checkpoint_lag_seconds",
        "Copy lag: time from a save's call until its step is complete on every rank "
        "(the mean over each second's saves)",
    ),
    "checkpoint.step": MetricDef(
        "gauge",
        "elastrun_checkpoint_step",
        "The newest memory checkpoint step complete on every rank, as each worker reported",
        labels=_RANK_LABELS,
    ),
    "checkpoint.restored_step": MetricDef(
        "gauge",
        "elastrun_checkpoint_restored_step",
        "The step each worker last restored from memory",
        labels=_RANK_LABELS,
    ),
    "checkpoint.restore.duration_ms": _worker_histogram(
        "elastrun_checkpoint_restore_seconds",
        "Time each worker took to load its memory checkpoint after a restart",
    ),
    "node.straggler": MetricDef(
        "gauge",
        "elastrun_node_straggler",
        "1 while the node (group rank) is reported as a straggler, else 0 "
        "(exported by group rank 0's agent)",
        labels=("group_rank",),
    ),
}

STATE_PREFIX = "agent.state."
STATE_METRIC = "elastrun_worker_group_state"
GENERIC_METRIC = "elastrun_metric"
#: Worker-group states exported from the start (as 0), so that dashboards see them all.
WORKER_STATES = ("UNKNOWN", "INIT", "HEALTHY", "UNHEALTHY", "STOPPED", "SUCCEEDED", "FAILED")
#: Durations range from milliseconds (a local start) to many minutes (a rendezvous
#: waiting for nodes), so the buckets span both.
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0, 1800.0, math.inf,
)  # fmt: skip

_MISSING = "needs the prometheus-client package: pip install 'elastrun[metrics]'"


class PrometheusMetricSink:
    """A :class:`~elastrun.observe.sinks.MetricSink` that keeps Prometheus metrics.

    ``put`` never raises: a value Prometheus refuses (a negative counter increment) is
    logged once per name and dropped, so metrics can never break the agent.

    Args:
        field: the option named when prometheus-client is missing.

    Raises:
        ConfigError: when prometheus-client is not installed.
    """

    def __init__(self, *, field: str = "--metrics-port") -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ConfigError(field, "prometheus", _MISSING) from exc
        self.registry: CollectorRegistry = prom.CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}
        for name, d in AGENT_METRICS.items():
            args, reg = (d.prom_name, d.help, d.labels), self.registry
            if d.kind == "histogram":
                buckets = d.buckets or DURATION_BUCKETS
                self._metrics[name] = prom.Histogram(*args, buckets=buckets, registry=reg)
            else:
                kind = prom.Counter if d.kind == "counter" else prom.Gauge
                self._metrics[name] = kind(*args, registry=reg)
        self._state = prom.Gauge(
            STATE_METRIC,
            "1 for the worker group's current state, 0 for the others",
            ["state"],
            registry=self.registry,
        )
        self._states: list[str] = list(WORKER_STATES)
        for state in self._states:
            self._state.labels(state=state).set(0)
        self._generic = prom.Gauge(
            GENERIC_METRIC, "Last value of any other metric put", ["name"], registry=self.registry
        )
        self._refused: set[str] = set()
        self._lock = threading.Lock()
        self.puts = 0

    def put(self, name: str, value: float) -> None:
        """Record ``value`` under the agent metric ``name`` (see :data:`AGENT_METRICS`)."""
        try:
            self._put(name, float(value))
        except (ValueError, TypeError) as exc:
            if name not in self._refused:
                self._refused.add(name)
                log.warning("metric %s=%r was refused: %s", name, value, exc)
            return
        self.puts += 1

    def _put(self, name: str, value: float) -> None:
        base, labels = split_labels(name)
        d = AGENT_METRICS.get(base)
        if d is not None and set(labels) == set(d.labels):
            metric = self._metrics[base]
            child = metric.labels(**labels) if labels else metric
            getattr(child, _UPDATE[d.kind])(value * d.scale)
        elif name.startswith(STATE_PREFIX) and len(name) > len(STATE_PREFIX):
            self._set_state(name[len(STATE_PREFIX) :], value)
        else:
            self._generic.labels(name=name).set(value)

    def _set_state(self, state: str, value: float) -> None:
        # The lock keeps the one-hot invariant when two threads report states at once.
        with self._lock:
            if state not in self._states:
                self._states.append(state)
            if not value:
                self._state.labels(state=state).set(0)
                return
            for other in self._states:
                self._state.labels(state=other).set(1 if other == state else 0)

    def exposition(self) -> bytes:
        """The metrics in Prometheus text format, as a scrape would return them."""
        import prometheus_client as prom

        return prom.generate_latest(self.registry)

    def __repr__(self) -> str:
        return f"PrometheusMetricSink(puts={self.puts})"


class _QuietHandler(WSGIRequestHandler):
    """Does not print a line to stderr for every scrape."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(NurseryRequests, WSGIServer):
    request_thread = "elastrun-metrics-request"


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer(Endpoint):
    """Serves a :class:`PrometheusMetricSink` at ``http://HOST:PORT/metrics``.

    The constructor only checks its arguments and builds the sink (it binds nothing);
    :meth:`start` binds and serves from a daemon thread; :meth:`stop` closes the port.
    Also a context manager.

    Args:
        port: TCP port; 0 lets the system choose (read :attr:`port` after ``start``).
        host: address to bind; loopback by default, ``0.0.0.0`` or ``::`` to be scraped
            from other machines.
        field: the option named in errors.

    Raises:
        ConfigError: for a port outside 0..65535, or when prometheus-client is missing.
    """

    def __init__(self, port: int, host: str = "127.0.0.1", *, field: str = "--metrics-port"):
        if not 0 <= port <= 65535:
            raise ConfigError(field, port, "a TCP port must be between 0 and 65535")
        self._field = field
        self._requested_port = port
        self.host = host
        self.sink = PrometheusMetricSink(field=field)

    @property
    def url(self) -> str:
        """The address to scrape."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> int:
        """Bind and start serving; returns the bound port. Idempotent.

        Raises:
            ConfigError: naming the option when the address cannot be bound.
        """
        if self._served is not None:
            return self.port
        import prometheus_client as prom

        app = prom.make_wsgi_app(self.sink.registry)
        server_class = _Server6 if ":" in self.host else _Server
        try:
            httpd = server_class((self.host, self._requested_port), _QuietHandler)
        except OSError as exc:
            raise ConfigError(
                self._field,
                self._requested_port,
                f"cannot serve metrics on {self.host}:{self._requested_port}: "
                f"{exc.strerror or exc}",
            ) from exc
        httpd.set_app(app)
        self._served = Served(httpd, "elastrun-metrics")
        log.info("serving metrics at %s", self.url)
        return self.port

    def __repr__(self) -> str:
        state = "serving" if self._served is not None else "stopped"
        return f"MetricsServer(host={self.host!r}, port={self.port}, {state}, sink={self.sink!r})"
