"""How the worker template forks workers: two forks each, so that a worker is the agent's.

The template forks an intermediate process, which forks the worker and exits at once;
the agent is a child subreaper while it waits for the reply, so the kernel hands the
orphaned worker to it. The intermediate reports the worker's pid (``P<pid>``) or why it
could not start it (``E<error>``) on a pipe; the template passes that on to the agent
and only then sends the worker its go-ahead (``g``) on another pipe, so no worker runs
that the agent does not know of. Each new process notes its pid on the batch's ledger
first (see :mod:`elastrun.wire.template`), so that an agent that gives up on the
batch can reap whatever it was handed. Both forks happen with every signal blocked (see
``_fork_intermediates``): a signal the agent sends once it knows the pid (a Ctrl-C during
a start) must neither vanish nor interrupt the worker's set-up half-way. What the worker
does next (it waits to see the agent as its parent, arms its parent-death signal, waits
for the go-ahead) is :mod:`elastrun.template.worker.child`'s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket

from elastrun.core.procinfo import is_open
from elastrun.wire.template import check_request, int_list, note_pid, send_message


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
    """The descriptors this process holds (not the one listdir used, closed by now)."""
    return {fd for fd in map(int, os.listdir("/proc/self/fd")) if is_open(fd)}


def close_quietly(*fds: int) -> None:
    """Close each descriptor, ignoring those already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _read_all(fd: int) -> bytes:
    return b"".join(iter(lambda: os.read(fd, 4096), b""))


def spawn_many(
    sock: socket.socket, requests: list[dict[str, object]], fds: list[list[int]], ledger: int
) -> Job | None:
    """Fork a worker for each request (``fds[i]``: request ``i``'s stdio descriptors;
    ``ledger``: the batch's ledger); in the template, reply once for all and return None.

    The intermediates of every request are forked back to back and then awaited, so the
    workers' start-ups overlap; the reply lists each request's pid or error in order,
    and only then does each started worker get its go-ahead.
    """
    threads = thread_count()
    if threads > 1:
        # Checked at startup too; this catches a thread started by an at-fork hook or
        # a finaliser since. A fork now could hand the worker a lock held forever.
        close_quietly(ledger, *(fd for own in fds for fd in own))
        send_message(sock, {"unsafe": f"the template now runs {threads - 1} extra thread(s)"})
        return None
    results: list[dict[str, object]] = [{} for _ in requests]
    forked = _fork_intermediates(requests, fds, ledger, results)
    if isinstance(forked, Job):
        return forked  # in a new worker
    close_quietly(ledger, *(fd for own in fds for fd in own))
    for i, intermediate, pid_r, _ in forked:
        os.waitpid(intermediate, 0)
        answer = _read_all(pid_r)
        if answer.startswith(b"P"):
            results[i] = {"pid": int(answer[1:])}
        else:
            reason = answer[1:].decode(errors="replace") or "the intermediate process died"
            results[i] = {"error": reason}
    try:
        send_message(sock, {"results": results})
        # Only now may the workers run: the agent has been told of them.
        for i, _, _, go_w in forked:
            if "pid" in results[i]:
                os.write(go_w, b"g")
    finally:
        close_quietly(*(fd for _, _, r, w in forked for fd in (r, w)))
    return None


def _fork_intermediates(
    requests: list[dict[str, object]],
    fds: list[list[int]],
    ledger: int,
    results: list[dict[str, object]],
) -> list[tuple[int, int, int, int]] | Job:
    """Fork one intermediate per valid request (an invalid one or a failed fork is
    noted in ``results``); returns (request, intermediate, pid_r, go_w) of each, or the
    Job in a new worker."""
    started: list[tuple[int, int, int, int]] = []
    # The new processes start with every signal blocked, and the worker keeps them
    # blocked until it has its own dispositions (child.reset_signals). Without
    # this, the worker would inherit the template's ignored SIGINT, and a SIGINT the agent
    # forwards as soon as it knows the pid would be discarded: the agent then waits
    # its whole shutdown grace and kills. A blocked signal is held pending instead,
    # even an ignored one, and acts once the worker unblocks it.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    for i, request in enumerate(requests):
        problem = check_request(request, len(fds[i]))
        if problem is not None:
            results[i] = {"error": f"bad request: {problem}"}
            continue
        pid_r, pid_w = os.pipe()  # intermediate -> template: "P<pid>" or "E<error>"
        go_r, go_w = os.pipe()  # template -> worker: "g" once the agent knows the pid
        try:
            intermediate = os.fork()
        except OSError as exc:
            close_quietly(pid_r, pid_w, go_r, go_w)
            results[i] = {"error": f"fork failed: {exc}"}
            continue
        if intermediate == 0:
            # Everything of the other requests, and the template's ends of the pipes.
            others = [fd for j, own in enumerate(fds) if j != i for fd in own]
            others += [fd for _, _, r, w in started for fd in (r, w)]
            note_pid(ledger, b"I")
            stdio = _stdio_fds(request, fds[i])
            return _intermediate(request, stdio, ledger, pid_w, go_r, (pid_r, go_w, *others))
        close_quietly(pid_w, go_r)
        started.append((i, intermediate, pid_r, go_w))
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return started


def _stdio_fds(request: dict[str, object], fds: list[int]) -> list[int]:
    present = request["stdio"]
    assert isinstance(present, list)
    it = iter(fds)
    return [next(it) if flag else -1 for flag in present]


def _intermediate(
    request: dict[str, object],
    fds: list[int],
    ledger: int,
    pid_w: int,
    go_r: int,
    inherited: tuple[int, ...],
) -> Job:
    """Fork the worker and exit; returns only in the worker (which holds the ledger
    until it is handed over: :func:`child.become_worker` closes it)."""
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
            note_pid(ledger, b"W")
            close_quietly(ready_r, pid_w)
            os.setsid()
            os.close(ready_w)  # end of file: the worker leads its own process group
            return Job(request, fds, go_r, me)
        os.close(ready_w)
        # Wait for setsid, so that the agent's first killpg cannot miss the group.
        os.read(ready_r, 1)
        os.write(pid_w, b"P%d" % worker)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(pid_w, f"E{type(exc).__name__}: {exc}".encode(errors="replace"))
        os._exit(1)
    os._exit(0)
