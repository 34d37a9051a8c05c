"""The health endpoint's HTTP plumbing: the server and the ``GET /health`` handler.

Loaded by :meth:`elastrun.observe.health.HealthCheckServer.start` only, so that reading
``TORCHELASTIC_HEALTH_CHECK_PORT`` never imports ``http.server``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import TYPE_CHECKING

from elastrun.core.serving import NurseryRequests

if TYPE_CHECKING:
    from elastrun.observe.health import HealthCheckServer

__all__ = ["HealthHTTPServer", "HealthHandler"]

log = logging.getLogger("elastrun.observe.health")  # the endpoint's one logger


class HealthHTTPServer(NurseryRequests, HTTPServer):
    request_thread = "elastrun-health-request"
    health: HealthCheckServer


class HealthHandler(BaseHTTPRequestHandler):
    server: HealthHTTPServer
    server_version = "elastrun-health"
    # A client that connects and sends nothing must not hold a thread forever.
    timeout = 10.0

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/", "/health", "/health/"):
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such path: {path}"})
            return
        try:
            document = self.server.health.snapshot()
        except Exception as exc:
            # A callback bug must show up as an unhealthy answer, not a dropped connection.
            log.exception("health check callback failed")
            self._send(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                {"healthy": False, "error": f"{type(exc).__name__}: {exc}"},
            )
            return
        ok = document.get("healthy") is True
        self._send(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, document)

    def _send(self, status: HTTPStatus, document: Mapping[str, object]) -> None:
        body = json.dumps(document, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        # Probes arrive every few seconds: keep them out of the job's stderr.
        log.debug("%s %s", self.address_string(), format % args)
