"""An HTTP health-check endpoint for the agent (``TORCHELASTIC_HEALTH_CHECK_PORT``).

``GET /`` (or ``/health``) answers with a small JSON document::

    {"state": "HEALTHY", "last_progress": 1700000000.5, "healthy": true, ...}

``last_progress`` is the wall-clock time (epoch seconds) of the job's last sign of
progress, as returned by the agent's ``alive_callback``; the answer is HTTP 200 while
``now - last_progress <= timeout`` and 503 once the job has made no progress for longer,
so a load balancer or a Kubernetes liveness probe can act on the status code alone.
Extra fields (the worker group's state, restart count, run id...) come from an optional
``state_callback``.

torchrun's open-source ``HealthCheckServer`` is a stub that serves nothing; this one
keeps its name, constructor and ``create_healthcheck_server`` factory so code written
against torch's API keeps working.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from elastrun.core.serving import Endpoint, Served
from elastrun.core.values import parse_port
from elastrun.wire.env import HEALTH_CHECK_PORT_ENV

__all__ = [
    "HealthCheckServer",
    "create_healthcheck_server",
    "port_from_env",
]

log = logging.getLogger(__name__)

AliveCallback = Callable[[], float]
StateCallback = Callable[[], Mapping[str, object]]


def port_from_env(environ: Mapping[str, str]) -> int | None:
    """The port from ``TORCHELASTIC_HEALTH_CHECK_PORT``, or None for no server.

    Unset or empty: no server. torchrun logs a value that is not a port and goes on
    without the endpoint; here it is a configuration error, because a probe watching a
    port nobody serves would later kill a healthy job.

    Raises:
        ConfigError: naming the variable, for anything but a port number 0..65535.
    """
    raw = environ.get(HEALTH_CHECK_PORT_ENV, "").strip()
    return parse_port(raw, HEALTH_CHECK_PORT_ENV) if raw else None


class HealthCheckServer(Endpoint):
    """Serves the agent's health over HTTP from a daemon thread.

    Args:
        alive_callback: returns the epoch time of the last progress.
        port: TCP port to listen on (0 picks a free one; see :attr:`port`).
        timeout: seconds without progress after which the job is reported unhealthy.
        host: address to bind; loopback by default. Use ``"0.0.0.0"`` for probes that
            come from another machine (e.g. a Kubernetes kubelet).
        state_callback: returns extra fields for the answer, e.g. ``{"state": ...}``.
        clock: the wall clock ``last_progress`` is compared with.

    The constructor does no I/O; :meth:`start` binds the port.
    """

    def __init__(
        self,
        alive_callback: AliveCallback,
        port: int,
        timeout: float = 60,
        host: str = "127.0.0.1",
        state_callback: StateCallback | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._alive_callback = alive_callback
        self._requested_port = port
        self.timeout = timeout
        self.host = host
        self._state_callback = state_callback
        self._clock = clock

    @property
    def alive_callback(self) -> AliveCallback:
        """The callback returning the time of the last progress (torch's name)."""
        return self._alive_callback

    def snapshot(self) -> dict[str, object]:
        """The document served: state fields, ``last_progress`` and ``healthy``."""
        last_progress = float(self._alive_callback())
        document: dict[str, object] = {"state": None}
        if self._state_callback is not None:
            document.update(self._state_callback())
        document["last_progress"] = last_progress
        document["timeout"] = self.timeout
        document["healthy"] = self._clock() - last_progress <= self.timeout
        return document

    def start(self) -> None:
        """Bind the port and serve from a daemon thread (no-op if already started).

        Raises:
            OSError: the port cannot be bound (in use, no permission).
        """
        if self._served is not None:
            return
        # http.server (with http.client, email and ssl) is loaded only for a server that
        # is started: every launch reads TORCHELASTIC_HEALTH_CHECK_PORT, few serve it.
        from elastrun.observe.health_http import HealthHandler, HealthHTTPServer

        server = HealthHTTPServer((self.host, self._requested_port), HealthHandler)
        server.health = self
        self._served = Served(server, "elastrun-health")
        log.info("health check server listening on %s:%d", self.host, self.port)

    def __repr__(self) -> str:
        return (
            f"HealthCheckServer(host={self.host!r}, port={self.port}, "
            f"timeout={self.timeout}, running={self._served is not None})"
        )


def create_healthcheck_server(
    alive_callback: AliveCallback, port: int, timeout: float
) -> HealthCheckServer:
    """A new, not yet started :class:`HealthCheckServer` (torch's factory name)."""
    return HealthCheckServer(alive_callback, port, timeout)
