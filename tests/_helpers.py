"""Running the launcher as a user would, without ever leaving processes behind."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# faulthandler in the launcher only (workers start without -X): a launcher a test gives
# up on is sent SIGABRT first, so its threads' stacks land in the failure message.
ELASTRUN = [sys.executable, "-X", "faulthandler", "-m", "elastrun"]


def write_script(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def start(
    args: Sequence[str],
    *,
    cwd: Path | str,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[str]:
    """Start ``elastrun ARGS`` in its own session (so a test can signal it alone)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.Popen(
        [*ELASTRUN, *args],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        dump_stacks_and_kill(proc)
        out, err = proc.communicate()
        raise AssertionError(
            f"elastrun did not finish in {timeout}s\nstdout:\n{out}\nstderr:\n{err}"
        ) from exc
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def dump_stacks_and_kill(proc: subprocess.Popen[str]) -> None:
    """End a launcher a test gave up on, and its session: SIGABRT first, which
    faulthandler answers with every thread's stack on stderr, then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGABRT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run(
    args: Sequence[str],
    *,
    cwd: Path | str,
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    return finish(start(args, cwd=cwd, env=env), timeout)


def wait_for(predicate: object, timeout: float = 20, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]  # a callable, typed object
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_json_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def children() -> set[int]:
    """This process's child processes, zombies included (a reaped child is gone)."""
    kids = set()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or it ended meanwhile
        if int(fields[1]) == os.getpid():
            kids.add(int(name))
    return kids


def freeze(pid: int, timeout: float = 10) -> None:
    """Stop ``pid`` with SIGSTOP and return once every one of its threads has stopped.

    ``kill`` returns before the stop takes hold: one thread takes the signal and stops
    the others only when it next runs, and until then the rest go on serving (on a
    loaded machine, long enough for an etcd member to answer a request).
    """
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return True  # it ended: nothing of it runs
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/stat", "rb") as fh:
                    state = fh.read().rsplit(b")", 1)[1].split()[0]
            except OSError:
                continue  # that thread ended
            if state not in (b"T", b"Z", b"X"):
                return False
        return True

    wait_for(stopped, timeout, f"every thread of {pid} to stop")


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z"


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


#: Ports handed out by ``free_ports`` in this process, and where the next search starts.
_GIVEN: set[int] = set()
_NEXT: list[int] = []


def free_ports(count: int = 1) -> list[int]:
    """``count`` loopback ports, free now, for servers a test starts and binds itself.

    Not port 0's pick: that is an ephemeral port, which any outgoing connection on the
    machine may take as its source port between the probe and the server's bind (with
    the parallel suite's many connections, a store or a Slurm daemon then failed with
    "Address already in use"). These come from below the kernel's ephemeral range, which
    only explicit binds use, and each xdist worker searches its own slice of it, so two
    workers never hand out the same port. A port that cannot be bound (in use, or in
    TIME_WAIT) is skipped.
    """
    low, high = 10000, _ephemeral_low()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = max((high - low) // 16, 64)
    first = low + (index % 16) * width
    if not _NEXT:
        _NEXT.append(first + os.getpid() % width)
    found: list[int] = []
    for _ in range(width):
        port = first + (_NEXT[0] - first) % width
        _NEXT[0] = port + 1
        if port in _GIVEN:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"no {count} free loopback ports in {first}-{first + width - 1}")


def free_port() -> int:
    """One port of :func:`free_ports`."""
    return free_ports(1)[0]


@contextlib.contextmanager
def elastrun_store(directory: Path) -> Iterator[tuple[str, Path]]:
    """A standalone ``elastrun store`` on a free loopback port, stopped on exit.

    Yields its endpoint (``127.0.0.1:PORT``) and the token file agents pass as
    ``--rdzv-conf is_host=false,token_file=...``.
    """
    port = free_port()
    token = directory / "token"
    token.write_text("s3cret\n")
    proc = subprocess.Popen(
        [*ELASTRUN, "store", "--host", "127.0.0.1", "--port", str(port),
         "--token-file", str(token)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving on" in line, line
        yield f"127.0.0.1:{port}", token
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)


def start_nodes(
    count: int,
    nnodes: str,
    endpoint: str,
    run_id: str,
    args: Sequence[str],
    *,
    cwd: Path,
    backend: str = "c10d",
) -> list[subprocess.Popen[str]]:
    """``count`` agents of one job on loopback, one worker each, started 0.3 s apart
    (with c10d the first serves the rendezvous store and joins first). ``args``: the
    rest of each command line (options, then the script and its arguments)."""
    common = ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", backend,
              "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
              "--local-addr", "127.0.0.1"]  # fmt: skip
    procs = []
    for _ in range(count):
        procs.append(start([*common, *args], cwd=cwd))
        time.sleep(0.3)
    return procs


def once_per_run(shared: Path, name: str, make: Callable[[], str]) -> str:
    """``make()``'s text, made by the first pytest worker that asks and read by the others.

    ``shared``: a folder every worker of this pytest run sees and no other run does (the
    parent of ``tmp_path_factory.getbasetemp()`` under xdist). The first caller holds a
    lock while it makes the value; a failed ``make`` records nothing, so the next caller
    tries again (and fails the same way, in its own test).
    """
    done = shared / f"{name}.value"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return done.read_text()
        value = make()
        done.write_text(value)
        return value
