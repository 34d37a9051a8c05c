"""The workers' store under a low descriptor limit, as a real process, on each engine.

Clients that validate and then idle are not capped by the handshake limit; what stops
them is the descriptor reserve: the store stops accepting while no more than a reserve
is free, so the process hosting it (the agent) can still open files, pipes and sockets
for its own work -- a worker's failure report, the next attempt's logs. The connections
it does not take wait in the listen backlog and are served once others leave. Those
that never validate make room there, the oldest first: idle strangers cannot keep a
worker out, however few descriptors the host has left.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from _helpers import wait_for
from elastrun.store.tcp.limits import fd_reserve
from elastrun.store.torchwire import codec as c
from elastrun.store.torchwire.codec import Op, Request
from elastrun.store.torchwire.engine import compiled_engine_available

LIMIT = 256

HOST = textwrap.dedent(
    """
    import os, sys
    from elastrun.store.torchwire import TorchWireServer

    server = TorchWireServer("127.0.0.1", 0, engine=sys.argv[1])
    print(server.start(), flush=True)
    for line in sys.stdin:
        word, *rest = line.split()
        if word == "open":  # open N files at once, as the agent does for an attempt
            files = []
            try:
                for _ in range(int(rest[0])):
                    files.append(open(os.devnull, "rb"))
                print("opened", len(files), flush=True)
            except OSError as exc:
                print("failed after", len(files), exc, flush=True)
            for f in files:
                f.close()
        elif word == "hold":  # keep N more files open (the host's own work grew)
            held = [open(os.devnull, "rb") for _ in range(int(rest[0]))]
            print("holding", len(held), flush=True)
        elif word == "count":
            print(server.num_connections, flush=True)
    server.close()
    """
)


class Host:
    """A process serving the workers' store under ``LIMIT`` descriptors, told what to do
    through its stdin."""

    def __init__(self, tmp: Path, engine: str) -> None:
        script = tmp / "host.py"
        script.write_text(HOST)

        def low_limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))

        self.proc = subprocess.Popen(
            [sys.executable, str(script), engine],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            # Only setrlimit runs between fork and exec: safe with this test's threads.
            preexec_fn=low_limit,  # noqa: PLW1509
        )
        self.port = int(self._line())

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture(
    params=[
        "python",
        pytest.param(
            "compiled",
            marks=pytest.mark.skipif(
                not compiled_engine_available(), reason="the compiled engine was not built"
            ),
        ),
    ]
)
def host(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Host]:
    made = Host(tmp_path, request.param)
    yield made
    made.close()


def _validated(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(c.encode_request(Request(Op.VALIDATE, number=c.MAGIC)))
    return sock


def _ping(sock: socket.socket, number: int) -> bytes:
    sock.sendall(c.encode_request(Request(Op.PING, number=number)))
    data = b""
    while len(data) < 4:
        chunk = sock.recv(4 - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_a_flood_of_validated_idle_clients_leaves_the_reserve_to_the_process(host: Host) -> None:
    reserve = fd_reserve(LIMIT)
    flood: list[socket.socket] = []
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(_validated(host.port))
        assert _ping(first, 1) == struct.pack("<I", 1)
        for _ in range(2 * LIMIT):  # twice the descriptors the host may have
            flood.append(stack.enter_context(_validated(host.port)))
        taken: list[int] = []

        def settled() -> bool:
            taken.append(int(host.ask("count")))
            return len(taken) > 3 and taken[-1] == taken[-4]

        wait_for(settled, 10, "the host to stop taking connections")
        assert taken[-1] < LIMIT - reserve, taken
        # The reserve is there for the process's own work (less what the count's
        # granularity may have taken: a few connections).
        assert host.ask(f"open {reserve - 16}") == f"opened {reserve - 16}"
        assert _ping(first, 2) == struct.pack("<I", 2)  # validated peers are served on
        for sock in flood[:-1]:  # they leave: the last one, in the backlog, comes in
            sock.close()
        assert _ping(flood[-1], 3) == struct.pack("<I", 3)


def test_idle_connections_that_never_validate_make_room_at_the_reserve(host: Host) -> None:
    # Connections that never validate fill what the host may give; then the host's own
    # work takes more descriptors, so that it is below its reserve. A worker coming now
    # is still served: the oldest idle connections are closed to make room for it.
    idle: list[socket.socket] = []
    try:
        for _ in range(2 * LIMIT):
            idle.append(socket.create_connection(("127.0.0.1", host.port), timeout=5))
        taken: list[int] = []

        def settled() -> bool:
            taken.append(int(host.ask("count")))
            return len(taken) > 3 and taken[-1] == taken[-4]

        wait_for(settled, 10, "the host to stop taking connections")
        assert host.ask("hold 20") == "holding 20"
        with _validated(host.port) as late:
            assert _ping(late, 7) == struct.pack("<I", 7)
        assert idle[0].recv(1) == b""  # the oldest made room
    finally:
        for sock in idle:
            sock.close()
