"""Finding listeners and cutting connections through /proc, on real loopback sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from elastrun.core.tcp_sockets import (
    Endpoints,
    _shut_down,
    listening_endpoints,
    shut_down_own,
    tcp_table,
)
from elastrun.inprocess.worker.cut import cut_connections

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="Linux /proc")


def _proc_form(addr: tuple[str, int]) -> str:
    """An IPv4 endpoint as /proc/net/tcp writes it."""
    host = socket.inet_aton(addr[0])[::-1].hex().upper()
    return f"{host}:{addr[1]:04X}"


def test_endpoints_match_exactly_or_by_port_for_a_wildcard_address() -> None:
    ends = Endpoints(["0100007F:1F90", "00000000:0050", "00000000000000000000000000000000:01BB"])
    assert "0100007F:1F90" in ends and "0200007F:1F90" not in ends
    assert "0A000001:0050" in ends and "0A000001:01BB" in ends  # any address on the port
    assert "0100007F:1F91" not in ends
    assert not Endpoints([]) and Endpoints(["0100007F:1F90"])


def test_another_process_listeners_are_found() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
         "print(s.getsockname()[1], flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        assert listening_endpoints([child.pid]) == [_proc_form(("127.0.0.1", port))]
    finally:
        child.communicate("")


def test_connections_to_and_from_listed_listeners_are_cut_and_others_kept() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    other = socket.create_server(("127.0.0.1", 0))
    out = socket.create_connection(listener.getsockname())
    inc, _ = listener.accept()
    kept = socket.create_connection(other.getsockname())
    kept_peer, _ = other.accept()
    try:
        assert _proc_form(listener.getsockname()) in {e.local for e in tcp_table().values()}
        cut = cut_connections([_proc_form(listener.getsockname())])
        assert cut == 2  # this end of the outgoing one, and the accepted one
        assert out.recv(1) == b"" and inc.recv(1) == b""  # both see the end at once
        kept.sendall(b"x")
        assert kept_peer.recv(1) == b"x"  # a connection to any other listener stays
        assert shut_down_own(lambda s: False) == 0
        assert cut_connections([]) == 0
    finally:
        for s in (listener, other, out, inc, kept, kept_peer):
            s.close()


def test_a_descriptor_whose_number_now_names_another_socket_is_left_alone() -> None:
    # The table was read for one socket; the number may since name a new one (another
    # thread closed the first and opened the second): only the socket read is cut.
    server = socket.create_server(("127.0.0.1", 0))
    conn = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        inode = str(os.fstat(conn.fileno()).st_ino)
        assert _shut_down(conn.fileno(), str(int(inode) + 1)) == 0  # not the one read
        conn.sendall(b"x")
        assert peer.recv(1) == b"x"
        assert _shut_down(conn.fileno(), inode) == 1
        assert peer.recv(1) == b""
    finally:
        for s in (server, conn, peer):
            s.close()
