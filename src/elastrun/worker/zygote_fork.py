"""How the worker template forks a worker: two forks, so that the worker is the agent's.

The template forks an intermediate process, which forks the worker and exits at once;
the agent is a child subreaper while it waits for the reply, so the kernel hands the
orphaned worker to it. The intermediate reports the worker's pid (``P<pid>``) or why it
could not start it (``E<error>``) on a pipe; the template passes that on to the agent
and only then sends the worker its go-ahead (``g``) on another pipe, so no worker runs
that the agent does not know of. Both forks happen with every signal blocked (see
:func:`spawn`). What the worker does next is :mod:`elastrun.worker.zygote_worker`'s.
"""

from __future__ import annotations

import os
import signal
import socket

from elastrun.worker.zygote_wire import int_list, send_message


class Job:
    """A spawn request, as held by the freshly forked worker."""

    # A plain class, not a dataclass: importing dataclasses (inspect, ast, dis, re...)
    # would add milliseconds to every template's start, on the launch's critical path.
    __slots__ = ("fds", "go_fd", "intermediate", "request")

    def __init__(
        self, request: dict[str, object], fds: list[int], go_fd: int, intermediate: int
    ) -> None:
        self.request = request
        self.fds = fds  # stdin, stdout, stderr (-1: closed)
        self.go_fd = go_fd
        self.intermediate = intermediate

    def __repr__(self) -> str:
        return f"Job(fds={self.fds}, go_fd={self.go_fd}, intermediate={self.intermediate})"


def thread_count() -> int:
    """The threads of this process, native ones included."""
    # Native threads (OpenMP pools, CUDA, gRPC) do not show in threading; the kernel's
    # task list shows them all.
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def open_fds() -> set[int]:
    """The descriptors this process holds."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            os.fstat(fd)
        except OSError:
            continue  # the descriptor listdir itself used, closed by now
        found.add(fd)
    return found


def close_quietly(*fds: int) -> None:
    """Close each descriptor, ignoring those already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks)


def spawn(sock: socket.socket, request: dict[str, object], fds: list[int]) -> Job | None:
    """Fork a worker for ``request``; in the template, reply and return None."""
    threads = thread_count()
    if threads > 1:
        # Checked at startup too; this catches a thread started by an at-fork hook or
        # a finaliser since. A fork now could hand the worker a lock held forever.
        close_quietly(*fds)
        send_message(sock, {"unsafe": f"the template now runs {threads - 1} extra thread(s)"})
        return None
    stdio_fds = _stdio_fds(request, fds)
    pid_r, pid_w = os.pipe()  # intermediate -> template: "P<pid>" or "E<error>"
    go_r, go_w = os.pipe()  # template -> worker: "g" once the agent knows the pid
    # The new processes start with every signal blocked, and the worker keeps them
    # blocked until it has its own dispositions (zygote_worker.reset_signals). Without
    # this, the worker would inherit the template's ignored SIGINT, and a SIGINT the agent
    # forwards as soon as it knows the pid would be discarded: the agent then waits
    # its whole shutdown grace and kills. A blocked signal is held pending instead,
    # even an ignored one, and acts once the worker unblocks it.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        intermediate = os.fork()
    except OSError as exc:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        close_quietly(pid_r, pid_w, go_r, go_w, *fds)
        send_message(sock, {"error": f"fork failed: {exc}"})
        return None
    if intermediate == 0:
        return _intermediate(request, stdio_fds, pid_w, go_r, (pid_r, go_w))
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    close_quietly(pid_w, go_r, *fds)
    try:
        os.waitpid(intermediate, 0)
        answer = _read_all(pid_r)
        if answer.startswith(b"P"):
            send_message(sock, {"pid": int(answer[1:])})
            # Only now may the worker run: the agent has been told of it.
            os.write(go_w, b"g")
        else:
            reason = answer[1:].decode(errors="replace") or "the intermediate process died"
            send_message(sock, {"error": reason})
    finally:
        close_quietly(pid_r, go_w)
    return None


def _stdio_fds(request: dict[str, object], fds: list[int]) -> list[int]:
    present = request["stdio"]
    assert isinstance(present, list)
    it = iter(fds)
    return [next(it) if flag else -1 for flag in present]


def _intermediate(
    request: dict[str, object],
    fds: list[int],
    pid_w: int,
    go_r: int,
    inherited: tuple[int, ...],
) -> Job | None:
    """Fork the worker and exit; returns only in the worker."""
    try:
        close_quietly(*inherited)
        cwd = request["cwd"]
        umask = request["umask"]
        assert isinstance(cwd, str) and isinstance(umask, int)
        # Done here rather than in the worker so that a bad directory is reported to
        # the agent as a refused start, like Popen's error for a fresh process.
        os.chdir(cwd)
        os.umask(umask)
        # The affinity the worker would have inherited, or its NUMA binding; set
        # before the fork so that the worker never runs outside it.
        os.sched_setaffinity(0, int_list(request, "cpus"))
        me = os.getpid()
        ready_r, ready_w = os.pipe()
        worker = os.fork()
        if worker == 0:
            close_quietly(ready_r, pid_w)
            os.setsid()
            os.close(ready_w)  # end of file: the worker leads its own process group
            return Job(request, fds, go_r, me)
        os.close(ready_w)
        # Wait for setsid, so that the agent's first killpg cannot miss the group.
        os.read(ready_r, 1)
        os.write(pid_w, b"P%d" % worker)
    except BaseException as exc:
        try:
            os.write(pid_w, f"E{type(exc).__name__}: {exc}".encode(errors="replace"))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)
