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
death signal), and ends by itself at its ``--deadline``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from elastrun.core.linux import die_with_parent

__all__ = ["FAULT_ENV", "PAYLOAD", "ROUNDS", "main"]

#: The test-only fault injection: ``fail`` or ``slow:SECONDS``.
FAULT_ENV = "ELASTRUN_TEST_NODE_CHECK"
#: Bytes sent each way per exchange, and how many exchanges the link part times.
PAYLOAD = 1 << 20
ROUNDS = 4
#: The version of the result lines.
VERSION = 1


class CheckFailed(Exception):
    """The check found this node unhealthy (the message says why)."""


def _fault() -> tuple[bool, float]:
    """(fail, extra seconds) from the test-only variable."""
    raw = os.environ.get(FAULT_ENV, "")
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; print its result as the last line of stdout; 0 when healthy."""
    parser = argparse.ArgumentParser(prog="python -m elastrun.nodecheck.runner")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds from now")
    parser.add_argument("--parent", type=int, default=None, help="die with this process")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("compute")
    serve_cmd = sub.add_parser("serve")
    serve_cmd.add_argument("host")
    connect_cmd = sub.add_parser("connect")
    connect_cmd.add_argument("host")
    connect_cmd.add_argument("port", type=int)
    args = parser.parse_args(argv)
    if args.parent is not None:
        die_with_parent(signal.SIGKILL, args.parent)
    deadline = time.monotonic() + args.deadline
    fail, extra = _fault()
    try:
        if fail:
            raise CheckFailed(f"failure injected by {FAULT_ENV} (tests only)")
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
