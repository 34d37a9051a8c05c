"""``core.serving``: a socket server answering on the threads of its nursery, and what
closing it leaves (nothing: no thread, no socket), also with a client that keeps its
connection open and with two closes at once."""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from elastrun.core.serving import NurseryRequests, Served


class _Server(NurseryRequests, HTTPServer):
    request_thread = "test-request"


class _Hello(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # (connections are kept alive between requests)

    def do_GET(self) -> None:
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _serve() -> tuple[Served, int]:
    server = _Server(("127.0.0.1", 0), _Hello)
    return Served(server, "test-serve"), server.socket.getsockname()[1]


def _threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_requests_are_answered_on_the_nurserys_threads() -> None:
    served, port = _serve()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        for _ in range(3):  # (one kept-alive connection: one thread answers them all)
            conn.request("GET", "/")
            assert conn.getresponse().read() == b"hello"
        assert [t.name for t in _threads_named("test-request")] == ["test-request"]
        assert "test-request" in served.nursery.running()
    finally:
        conn.close()
        served.close()


def test_close_ends_a_kept_alive_connection_at_once_and_leaves_no_thread() -> None:
    served, port = _serve()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/")
    assert conn.getresponse().read() == b"hello"
    # The client keeps its connection open: the request's thread waits for the next.
    t0 = time.monotonic()
    served.close()
    assert time.monotonic() - t0 < 2.0
    assert _threads_named("test-request") == [] and _threads_named("test-serve") == []
    assert served.server.socket.fileno() == -1  # the listening socket is closed
    conn.request("GET", "/")  # the server shut the connection down
    try:
        conn.getresponse()
    except (ConnectionError, http.client.HTTPException):
        pass
    else:
        raise AssertionError("answered after close")
    conn.close()


def test_a_second_close_at_once_returns_only_once_everything_is_closed() -> None:
    served, port = _serve()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/")
    assert conn.getresponse().read() == b"hello"
    closers = [threading.Thread(target=served.close) for _ in range(2)]
    for c in closers:
        c.start()
    served.close()  # (a third, here)
    assert _threads_named("test-request") == [] and served.server.socket.fileno() == -1
    for c in closers:
        c.join(5)
    conn.close()


def test_a_request_after_close_is_not_answered() -> None:
    served, port = _serve()
    served.close()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/")
        conn.getresponse()
    except (ConnectionError, http.client.HTTPException):
        pass
    else:
        raise AssertionError("answered after close")
    finally:
        conn.close()
