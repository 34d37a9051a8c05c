"""Telling a worker blocked for good in a gloo collective from one that computes or
waits for a live peer (``inprocess.agent.stuck.blocked_for_good``), on real processes:
a thread named as torch's gloo work threads, waiting with or without a timeout, with or
without a connection to a listener of the round."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time

import pytest

from elastrun.core.tcp_sockets import Endpoints
from elastrun.inprocess.agent.stuck import blocked_for_good

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/net/tcp") or platform.machine() not in ("x86_64", "aarch64"),
    reason="Linux /proc, a machine whose futex number the probe knows",
)

# A worker stand-in: one thread named as gloo's (or not), waiting on an event (with a
# timeout or without), and the main thread connected to the round's listener (or not).
CHILD = """
import ctypes, socket, sys, threading
name, wait, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
conn = socket.create_connection(("127.0.0.1", port)) if port else None
event = threading.Event()
def run():
    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
    print("waiting", flush=True)
    event.wait(600 if wait == "timed" else None)
threading.Thread(target=run, daemon=True).start()
sys.stdin.read()
"""


def _proc_form(addr: tuple[str, int]) -> str:
    return f"{socket.inet_aton(addr[0])[::-1].hex().upper()}:{addr[1]:04X}"


def _probe(name: str, wait: str, connect: bool) -> bool:
    """Start the stand-in and return what the probe finds once its thread waits."""
    listener = socket.create_server(("127.0.0.1", 0))
    peers = Endpoints([_proc_form(listener.getsockname())])
    port = str(listener.getsockname()[1] if connect else 0)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, name, wait, port],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "waiting\n"
        found = False
        for _ in range(20):  # until the thread is in its wait (it printed just before)
            time.sleep(0.05)
            found = blocked_for_good(child.pid, peers)
            if found:
                break
        return found
    finally:
        child.communicate("")
        listener.close()


def test_a_gloo_thread_waiting_with_a_timeout_and_no_connection_left_is_blocked_for_good() -> None:
    assert _probe("pt_gloo_runloop", "timed", connect=False)


def test_a_connection_to_a_listener_of_the_round_means_the_wait_may_still_end() -> None:
    assert not _probe("pt_gloo_runloop", "timed", connect=True)


def test_a_gloo_thread_waiting_without_a_timeout_is_idle_not_blocked() -> None:
    # ProcessGroupGloo's idle work threads wait for work without a timeout.
    assert not _probe("pt_gloo_runloop", "untimed", connect=False)


def test_another_thread_waiting_with_a_timeout_is_not_taken_for_gloo() -> None:
    assert not _probe("data-loader", "timed", connect=False)


def test_without_listeners_or_a_process_nothing_is_found() -> None:
    assert not blocked_for_good(os.getpid(), Endpoints([]))
    assert not blocked_for_good(2**22 + 12345, Endpoints(["0100007F:1F90"]))  # no such pid
