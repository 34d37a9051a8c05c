"""The agent's health-check HTTP endpoint, queried over 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time

import pytest

from elastrun.core.errors import ConfigError
from elastrun.observe.health import (
    HealthCheckServer,
    create_healthcheck_server,
    port_from_env,
)
from elastrun.wire.env import HEALTH_CHECK_PORT_ENV

NOW = 1_700_000_000.0


def get(port: int, path: str = "/") -> tuple[int, dict[str, object]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = json.loads(response.read())
    finally:
        connection.close()
    return response.status, body


def test_recent_progress_answers_200_with_state_and_last_progress() -> None:
    server = HealthCheckServer(
        alive_callback=lambda: NOW - 5,
        port=0,
        timeout=60,
        state_callback=lambda: {"state": "HEALTHY", "restart_count": 1},
        clock=lambda: NOW,
    )
    with server:
        assert server.port != 0
        status, body = get(server.port)
    assert status == 200
    assert body["state"] == "HEALTHY"
    assert body["restart_count"] == 1
    assert body["last_progress"] == NOW - 5
    assert body["healthy"] is True


def test_no_progress_for_longer_than_the_timeout_answers_503() -> None:
    server = HealthCheckServer(lambda: NOW - 61, 0, timeout=60, clock=lambda: NOW)
    with server:
        status, body = get(server.port, "/health")
    assert status == 503
    assert body["healthy"] is False
    assert body["state"] is None


def test_health_follows_the_callback_between_requests() -> None:
    progress = [NOW - 100]
    with HealthCheckServer(lambda: progress[0], 0, timeout=10, clock=lambda: NOW) as server:
        assert get(server.port)[0] == 503
        progress[0] = NOW
        assert get(server.port)[0] == 200


def test_unknown_path_answers_404() -> None:
    with HealthCheckServer(lambda: NOW, 0, clock=lambda: NOW) as server:
        status, body = get(server.port, "/metrics")
    assert status == 404
    assert "/metrics" in str(body["error"])


def test_failing_callback_answers_500_instead_of_dropping_the_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> float:
        raise RuntimeError("watchdog gone")

    with caplog.at_level(logging.CRITICAL), HealthCheckServer(broken, 0) as server:
        status, body = get(server.port)
    assert status == 500
    assert body["healthy"] is False
    assert "watchdog gone" in str(body["error"])


def test_stop_frees_the_port_promptly() -> None:
    server = create_healthcheck_server(time.time, 0, 60)
    server.start()
    port = server.port
    assert get(port)[0] == 200
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 1.0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    # The port can be bound again at once.
    again = HealthCheckServer(time.time, port)
    again.start()
    try:
        assert get(port)[0] == 200
    finally:
        again.stop()
    server.stop()  # idempotent


def test_a_port_in_use_fails_at_start_not_in_the_constructor() -> None:
    with HealthCheckServer(time.time, 0) as first:
        second = HealthCheckServer(time.time, first.port)
        assert "running=False" in repr(second)
        with pytest.raises(OSError):
            second.start()
        second.stop()


def test_silent_client_does_not_block_other_requests_or_stop() -> None:
    with HealthCheckServer(time.time, 0) as server:
        idle = socket.create_connection(("127.0.0.1", server.port))
        try:
            assert get(server.port)[0] == 200
        finally:
            idle.close()


def test_torch_alive_callback_property_is_kept() -> None:
    def callback() -> float:
        return NOW

    assert create_healthcheck_server(callback, 0, 60).alive_callback is callback


@pytest.mark.parametrize(
    ("raw", "expected"), [(None, None), ("", None), ("8080", 8080), ("0", 0), (" 9000 ", 9000)]
)
def test_port_from_env_reads_the_torch_variable(raw: str | None, expected: int | None) -> None:
    environ = {} if raw is None else {HEALTH_CHECK_PORT_ENV: raw}
    assert port_from_env(environ) == expected


@pytest.mark.parametrize("raw", ["http", "70000", "-1", "8080.5"])
def test_port_from_env_refuses_what_is_not_a_port(raw: str) -> None:
    with pytest.raises(ConfigError, match=HEALTH_CHECK_PORT_ENV) as info:
        port_from_env({HEALTH_CHECK_PORT_ENV: raw})
    assert info.value.value == raw
