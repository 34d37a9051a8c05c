"""The node check's own process: a compute part and a link part, run by the agent.

The agent never imports torch (DESIGN.md section 8), so what touches the accelerators
runs here, with the workers' interpreter, and the agent reads one JSON line per result
from this process' stdout. Three commands:

``compute``
    A fixed matrix product on each local accelerator (``torch.cuda`` when available,
    else the CPU), after one warm-up product; the time of the timed products (the
    slowest device's) and each device's. A non-finite result fails. CUDA is first
    touched here, never in the agent.
``serve HOST``
    Listen on an ephemeral port of ``HOST`` and say which (``{"port": P}``), then answer
    one partner's exchange and report its time.
``connect HOST PORT``
    The partner's side: ``ROUNDS`` exchanges of ``PAYLOAD`` bytes, each sent and
    received back whole and compared; the time of all of them.
``script -- ARGV...``
    Run the user's check script, and exit with its status once it and every process it
    started have ended (``run_script``).

Why a TCP exchange rather than a gloo all-reduce of two: a gloo pair needs a store that
both check processes reach and a process group set up per pair, which costs more than
the check itself, and this process would need the rendezvous store's client (the
worker side never imports the agent's store). The exchange moves the same bytes both
ways over the same network path that the workers' first collectives use; what it does
not test (NCCL's own transport) the job's first collective does.

Fault injection, for tests only: ``ELASTRUN_TEST_NODE_CHECK=fail`` makes every command
fail at once; ``slow:SECONDS`` adds ``SECONDS`` inside each timed part. Never set it in
a real job.

This module imports nothing of the agent side; it dies with its agent (the parent
death signal), and ends by itself at its ``--deadline`` (``script`` at the agent's
SIGTERM: the agent times the user's script).

Why the user's script runs under ``script``, not as the agent's own child: a script may
leave processes behind, in the background or in a session of their own (``setsid``),
out of reach of the kill of the check's session. ``script`` makes itself a child
subreaper, so that every orphaned descendant of the script becomes its child, and once
the script has ended (or on SIGTERM: the agent stopping the check, or the agent's
death) it kills its children one generation after another until it has none. It kills
only processes it was handed as its own children, by pid. The rejected alternatives:
a scan of the process table from the agent (a process that left the tree is not
found), and making the agent itself the subreaper (it would adopt every orphan of its
workers as well, and its reaping is the supervisor's). Where the kernel has no
subreapers (before 3.4), the script's direct children are still ended.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from elastrun.core.linux import die_with_parent, set_child_subreaper
from elastrun.core.procinfo import children
from elastrun.wire.env import NODE_CHECK_FAULT_ENV

__all__ = ["PAYLOAD", "ROUNDS", "main", "run_script"]

#: Bytes sent each way per exchange, and how many exchanges the link part times.
PAYLOAD = 1 << 20
ROUNDS = 4
#: The version of the result lines.
VERSION = 1
#: The exit status when the user's script could not be started (as a shell's).
NOT_RUN = 127
#: The signals that stop ``script`` (the agent's SIGTERM, or its death's).
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class CheckFailed(Exception):
    """The check found this node unhealthy (the message says why)."""


def _fault() -> tuple[bool, float]:
    """(fail, extra seconds) from the test-only variable."""
    raw = os.environ.get(NODE_CHECK_FAULT_ENV, "")
    if raw == "fail":
        return True, 0.0
    if raw.startswith("slow:"):
        return False, float(raw[len("slow:") :])
    return False, 0.0


def _say(**fields: Any) -> None:
    print(json.dumps({"v": VERSION, **fields}, sort_keys=True), flush=True)


def compute(extra: float) -> dict[str, Any]:
    """Time a fixed matrix product on each local accelerator (or the CPU)."""
    import torch

    if torch.cuda.is_available():
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        size, reps, dtype = 8192, 20, torch.bfloat16
    else:
        devices = [torch.device("cpu")]
        size, reps, dtype = 512, 5, torch.float32
    times: dict[str, float] = {}
    for device in devices:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
        b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
        c = a @ b  # warm-up: kernels chosen, memory allocated
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            c = a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        time.sleep(extra)
        times[str(device)] = time.perf_counter() - t0
        if not bool(torch.isfinite(c).all()):
            raise CheckFailed(f"the matrix product on {device} is not finite")
    return {"seconds": max(times.values()), "devices": times, "size": size, "reps": reps}


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise CheckFailed("the partner closed the connection")
        buf += chunk
    return bytes(buf)


def serve(host: str, deadline: float, extra: float) -> dict[str, Any]:
    """Answer one partner's exchanges; the time from the first byte to the last."""
    with socket.create_server((host, 0)) as listener:
        _say(port=listener.getsockname()[1])
        listener.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            raise CheckFailed("no partner connected before the deadline") from None
    with conn:
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        t0 = None
        for _ in range(ROUNDS):
            data = _recv_exact(conn, PAYLOAD)
            t0 = time.perf_counter() if t0 is None else t0
            conn.sendall(data)
        time.sleep(extra)
        conn.sendall(b"k")  # the end: the partner's time includes this side's delay
        assert t0 is not None
        return {"seconds": time.perf_counter() - t0}


def connect(host: str, port: int, deadline: float, extra: float) -> dict[str, Any]:
    """Exchange ``ROUNDS`` payloads with the partner; the time of all of them."""
    payload = bytes(range(256)) * (PAYLOAD // 256)
    try:
        conn = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
    except OSError as exc:
        raise CheckFailed(f"cannot reach the partner at {host}:{port}: {exc}") from None
    with conn:
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        t0 = time.perf_counter()
        for _ in range(ROUNDS):
            conn.sendall(payload)
            if _recv_exact(conn, PAYLOAD) != payload:
                raise CheckFailed("the bytes the partner sent back differ from those sent")
        time.sleep(extra)
        _recv_exact(conn, 1)
        return {"seconds": time.perf_counter() - t0}


class _Stopped(Exception):
    """``script`` was asked to stop."""


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise _Stopped(signum)


def _end_descendants() -> None:
    """Kill every child of this process and reap it, again and again, until none is
    left: as a subreaper, a killed child's own children become this process's."""
    while True:
        for pid in children(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _exit_as(status: int) -> int:
    """Exit as the script did: with its status, or killed by its signal (no core)."""
    if status >= 0:
        return status
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    if -status != signal.SIGKILL:  # (SIGKILL's action cannot be set, nor changed)
        signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
    return 128 - status  # (a signal that does not end a process: as a shell says it)


def run_script(argv: Sequence[str]) -> int:
    """Run ``argv`` (its output is this process's), then end every process it left;
    its exit status (``NOT_RUN`` when it could not be started, saying why).

    A SIGTERM, SIGINT or SIGHUP ends the script and its descendants at once.
    """
    with contextlib.suppress(OSError):  # an old kernel: only its direct children are ended
        set_child_subreaper(True)
    for sig in STOPS:
        signal.signal(sig, _stop)
    try:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL).wait()
    except OSError as exc:
        print(f"could not be run: {exc.strerror or exc}", flush=True)
        return NOT_RUN
    except _Stopped as stop:
        return 128 + int(stop.args[0])
    finally:
        for sig in STOPS:  # (the end is decided: no stop may interrupt the rest)
            signal.signal(sig, signal.SIG_IGN)
        _end_descendants()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; print its result as the last line of stdout; 0 when healthy."""
    parser = argparse.ArgumentParser(prog="python -m elastrun.nodecheck.worker.runner")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds from now")
    parser.add_argument("--parent", type=int, default=None, help="die with this process")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("compute")
    sub.add_parser("serve").add_argument("host")
    connect_cmd = sub.add_parser("connect")
    connect_cmd.add_argument("host")
    connect_cmd.add_argument("port", type=int)
    sub.add_parser("script").add_argument("argv", nargs="+")
    args = parser.parse_args(argv)
    if args.parent is not None:
        # A script gets SIGTERM at the agent's death, not SIGKILL: its descendants end too.
        die_with_parent(signal.SIGTERM if args.command == "script" else signal.SIGKILL, args.parent)
    if args.command == "script":
        # (Some argparse versions keep the "--" that ends the options.)
        script = args.argv[1:] if args.argv[0] == "--" else args.argv
        return _exit_as(run_script(script))
    deadline = time.monotonic() + args.deadline
    fail, extra = _fault()
    try:
        if fail:
            raise CheckFailed(f"failure injected by {NODE_CHECK_FAULT_ENV} (tests only)")
        if args.command == "compute":
            result = compute(extra)
        elif args.command == "serve":
            result = serve(args.host, deadline, extra)
        else:
            result = connect(args.host, args.port, deadline, extra)
    except (CheckFailed, OSError, RuntimeError) as exc:
        _say(ok=False, error=str(exc) or type(exc).__name__)
        return 1
    _say(ok=True, **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
