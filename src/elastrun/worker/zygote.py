"""The worker template ("zygote"): one pre-imported interpreter that workers fork from.

The agent starts it once as::

    python [OPTS] -m elastrun.worker.zygote N

with the interpreter options (``OPTS``) and the environment its workers will have, minus
the per-worker variables, plus :data:`TITLE_ROOM` first (see :func:`_retitle`). The
first message on the control socket (fd ``N``) names the modules to preload: it imports
them (the optional ones are skipped quietly when they are not installed), checks that
forking is still safe (no thread started, CUDA not initialised), says hello and then
serves spawn requests until the agent closes the socket. Its command line is kept that
short (the module list travels on the socket) so that every worker's command line is
longer than it: see :func:`_retitle`.

Why two forks per worker: the worker must be the *agent's* child, so that the agent can
reap it, read its real exit status and give it the parent-death signal it gives every
worker. The template forks an intermediate process, which forks the worker and exits at
once; the agent is a child subreaper while it waits for the reply, so the kernel hands
the orphaned worker to it. The worker waits until it sees the agent as its parent, arms
its parent-death signal, and waits for the template's go-ahead -- sent only after the
agent was told the worker's pid, so no worker runs that the agent does not know of.
Both forks happen with every signal blocked, and the worker unblocks them only once its
dispositions are reset: from the moment the agent knows the pid it may signal the
worker (a Ctrl-C during a start or a restart), and such a signal must neither vanish into
the template's ignored SIGINT nor interrupt the set-up half-way; held pending, it acts
when unblocked, as on a fresh process.

The worker then becomes what ``python [OPTS] -m elastrun.worker.bootstrap ARGS`` would
have been: its own session, the given stdin/stdout/stderr (new ``sys.std*`` objects built
as the interpreter builds them, ``-u`` included), default signal dispositions (plus the
agent's ignored signals and mask, as ``exec`` would pass them on), no inherited
descriptors, the given working directory, umask, CPU affinity, environment, ``sys.argv``
and ``sys.orig_argv``, that command line and the interpreter's name in ps, ``pgrep -f``,
top and psutil (:func:`_retitle`, before any of the worker's own code runs), its own
random seeds (every generator that a fresh interpreter seeds from the OS when importing
what the template imported: ``random``, torch's CPU generator, numpy's global
``RandomState``, sympy's, the ``multiprocessing`` auth key; see :func:`_reseed`) -- and
runs :func:`elastrun.worker.bootstrap.main`, whose exceptions reach the interpreter's top
level exactly as from a fresh start.

What cannot be made identical, and is documented as such:

* ``/proc/PID/cmdline`` holds the command line as one string, its arguments separated
  by spaces rather than NULs: ps, ``pgrep -f`` and top show the same text, psutil splits
  it on spaces (an argument that contains a space, or is empty, reads differently), and
  a tool that takes the first NUL-separated item as the program reads the whole line.
  For the few milliseconds before :func:`_retitle` it is the template's command line
  (for good where setproctitle is not installed).
* ``/proc/PID/environ`` shows the template's initial environment (the live one,
  ``os.environ`` and ``getenv``, is the worker's), its first variable
  (:data:`TITLE_ROOM`) overwritten by the end of the command line and NUL bytes, at
  which psutil stops reading it: its ``environ()`` is empty.
* All workers share the template's string-hash seed, drawn once when the interpreter
  starts: ``str`` and ``bytes`` hashes, and so the iteration order of sets of strings,
  are the same in every worker (unless ``PYTHONHASHSEED`` makes them so anyway).
* A module preloaded with ``--preload`` that draws a seed of its own from the OS at
  import time shares it with every worker: only the generators named above are
  reseeded (another module may have seeded its generator with a constant, which must
  stay).
* Modules already imported saw the template's environment at import time -- which is
  why the agent keys templates by the environment.

Protocol: each message is a 4-byte big-endian length and a UTF-8 JSON object; a spawn
request carries the worker's stdin, stdout and stderr descriptors (SCM_RIGHTS).
"""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType, TracebackType

from elastrun.worker import bootstrap

#: The module the agent runs (``python -m``) to start a template.
ZYGOTE_MODULE = "elastrun.worker.zygote"
#: Bumped on any incompatible change of the messages below.
PROTOCOL_VERSION = 2
#: The variable the agent puts first in the template's environment: room for the
#: workers' command lines past the end of the template's own (see _retitle).
TITLE_ROOM = "ELASTRUN_TITLE_ROOM"
# A spawn request's environment and argv are small; anything this big is a bug.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_STDIO_FDS = 3
_PR_SET_PDEATHSIG = 1
# Longest a new worker waits to be handed to the agent. The intermediate exits right
# after forking, so this is only reached when the system is wedged.
_ADOPTION_TIMEOUT = 30.0


# --- messages -------------------------------------------------------------------------


def send_message(sock: socket.socket, message: dict[str, object], fds: Sequence[int] = ()) -> None:
    """Send one JSON message, with ``fds`` attached to its first byte."""
    payload = json.dumps(message).encode()
    data = len(payload).to_bytes(4, "big") + payload
    sent = 0
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
    sock.sendall(data[sent:])


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("control channel closed in the middle of a message")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_message(
    sock: socket.socket, maxfds: int = 0
) -> tuple[dict[str, object], list[int]] | None:
    """Receive one message and the descriptors sent with it; None at end of stream.

    Raises:
        ConnectionError: the stream ended inside a message, or the message is malformed.
    """
    head, fds, flags, _ = socket.recv_fds(sock, 4, max(maxfds, 1))
    if not head:
        for fd in fds:
            os.close(fd)
        return None
    try:
        if flags & socket.MSG_CTRUNC:
            raise ConnectionError("descriptors were lost in transit (MSG_CTRUNC)")
        if len(head) < 4:
            head += _recv_exactly(sock, 4 - len(head))
        size = int.from_bytes(head, "big")
        if size > _MAX_MESSAGE_BYTES:
            raise ConnectionError(f"message of {size} bytes is too large")
        try:
            message = json.loads(_recv_exactly(sock, size))
        except ValueError as exc:  # not UTF-8, not JSON
            raise ConnectionError(f"malformed control message: {exc}") from exc
        if not isinstance(message, dict):
            raise ConnectionError("a control message must be a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


# --- the template ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Stdio:
    """How the interpreter built sys.std* at startup (from -u, PYTHONIOENCODING, locale)."""

    buffered: bool
    encodings: tuple[str, str, str]
    errors: tuple[str, str, str]

    @staticmethod
    def of_interpreter() -> _Stdio:
        streams = (sys.__stdin__, sys.__stdout__, sys.__stderr__)
        out = sys.__stdout__
        buffered = not (out is not None and out.write_through)
        default = ("utf-8", "strict")
        enc = tuple(s.encoding if s is not None else default[0] for s in streams)
        err = tuple((s.errors or default[1]) if s is not None else default[1] for s in streams)
        return _Stdio(buffered, (enc[0], enc[1], enc[2]), (err[0], err[1], err[2]))


@dataclass
class _Job:
    """A spawn request, as held by the freshly forked worker."""

    request: dict[str, object]
    fds: list[int]  # stdin, stdout, stderr (-1: closed)
    go_fd: int
    intermediate: int


def _parse_args(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        raise SystemExit(f"usage: python -m {ZYGOTE_MODULE} FD")
    return int(argv[0])


def _recv_setup(sock: socket.socket) -> tuple[list[str], list[str]]:
    """The agent's first message: the modules to preload, and those to skip if missing."""
    try:
        got = recv_message(sock)
    except (ConnectionError, OSError):
        got = None
    if got is None:
        raise SystemExit(1)  # the agent is gone
    setup, _ = got
    if setup.get("version") != PROTOCOL_VERSION:
        raise SystemExit(f"{ZYGOTE_MODULE}: protocol version {setup.get('version')!r}")
    return _str_list(setup, "preload"), _str_list(setup, "optional")


def _str_list(message: dict[str, object], key: str) -> list[str]:
    value = message.get(key)
    return [str(v) for v in value] if isinstance(value, list) else []


def _thread_count() -> int:
    # Native threads (OpenMP pools, CUDA, gRPC) do not show in threading; the kernel's
    # task list shows them all.
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _fork_hazard(module: str) -> str | None:
    """Why forking after importing ``module`` would be unsafe, or None."""
    threads = _thread_count()
    if threads > 1:
        return f"importing {module} started {threads - 1} thread(s)"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    if is_initialized is not None and is_initialized():
        return f"importing {module} initialised CUDA"
    return None


def _preload(required: list[str], optional: list[str]) -> tuple[list[str], str | None]:
    """Import the modules; returns what was imported and why the template is unusable."""
    done: list[str] = []
    for name in [*required, *(m for m in optional if m not in required)]:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if name in optional and exc.name is not None and name.startswith(exc.name):
                continue  # not installed: the workers do without it as well
            return done, f"cannot preload {name}: {type(exc).__name__}: {exc}"
        except BaseException as exc:
            return done, f"cannot preload {name}: {type(exc).__name__}: {exc}"
        done.append(name)
        hazard = _fork_hazard(name)
        if hazard is not None:
            return done, hazard
    return done, None


def _open_fds() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            os.fstat(fd)
        except OSError:
            continue  # the descriptor listdir itself used, closed by now
        found.add(fd)
    return found


def main(argv: list[str] | None = None) -> None:
    """Run the template: preload, say hello, serve spawn requests.

    Returns only in a newly forked worker, after the worker's script has run (the
    interpreter then exits as it would after ``python -m elastrun.worker.bootstrap``).
    """
    fd = _parse_args(sys.argv[1:] if argv is None else argv)
    # The template lives in its own session; a stray interrupt must not end it. The
    # agent stops it by closing the channel (or SIGKILL, or its parent-death signal).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdio = _Stdio.of_interpreter()
    sock = socket.socket(fileno=fd)
    required, optional = _recv_setup(sock)
    t0 = time.monotonic()
    titles = _import_titles()
    loaded, problem = _preload(required, optional)
    hello: dict[str, object] = {
        "version": PROTOCOL_VERSION,
        "pid": os.getpid(),
        "preloaded": loaded,
        "seconds": round(time.monotonic() - t0, 3),
    }
    if problem is not None:
        hello["unsafe"] = problem
        send_message(sock, hello)
        sock.close()
        return
    # Descriptors the template holds now (after imports) may belong to preloaded
    # modules; a worker keeps them, as a fresh interpreter importing them would hold
    # its own. Everything opened later (requests, pipes) is closed in the worker.
    keep = _open_fds() - {fd}
    send_message(sock, hello)
    job = _serve(sock)
    # Only a new worker gets here.
    sock.close()
    _become_worker(job, stdio, keep, titles)
    _run_bootstrap()


def _serve(sock: socket.socket) -> _Job:
    """Serve requests until the channel closes; returns only in a new worker."""
    while True:
        try:
            got = recv_message(sock, maxfds=_STDIO_FDS)
        except (ConnectionError, OSError, ValueError):
            raise SystemExit(1) from None
        if got is None:
            raise SystemExit(0)  # the agent closed the channel: a clean stop
        request, fds = got
        try:
            problem = _check_request(request, len(fds))
            if problem is not None:
                _close_quietly(*fds)
                send_message(sock, {"error": f"bad request: {problem}"})
                continue
            job = _spawn(sock, request, fds)
        except OSError:
            raise SystemExit(1) from None  # the agent is gone (no one to reply to)
        if job is not None:
            return job


_REQUEST_FIELDS: dict[str, type] = {
    "argv": list,
    "bootstrap_args": list,
    "env": dict,
    "cwd": str,
    "umask": int,
    "agent_pid": int,
    "death_signal": int,
    "ignored_signals": list,
    "blocked_signals": list,
    "stdio": list,
    "cpus": list,
}


def _check_request(request: dict[str, object], nfds: int) -> str | None:
    """What is wrong with a spawn request, or None."""
    if request.get("version") != PROTOCOL_VERSION:
        return f"protocol version {request.get('version')!r}, expected {PROTOCOL_VERSION}"
    for name, kind in _REQUEST_FIELDS.items():
        if not isinstance(request.get(name), kind):
            return f"{name} must be a {kind.__name__}"
    stdio = request["stdio"]
    assert isinstance(stdio, list)
    if len(stdio) != _STDIO_FDS or sum(bool(f) for f in stdio) != nfds:
        return f"stdio flags {stdio} do not match the {nfds} descriptor(s) sent"
    return None


def _close_quietly(*fds: int) -> None:
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


def _spawn(sock: socket.socket, request: dict[str, object], fds: list[int]) -> _Job | None:
    """Fork a worker for ``request``; in the template, reply and return None."""
    threads = _thread_count()
    if threads > 1:
        # Checked at startup too; this catches a thread started by an at-fork hook or
        # a finaliser since. A fork now could hand the worker a lock held forever.
        _close_quietly(*fds)
        send_message(sock, {"unsafe": f"the template now runs {threads - 1} extra thread(s)"})
        return None
    stdio_fds = _stdio_fds(request, fds)
    pid_r, pid_w = os.pipe()  # intermediate -> template: "P<pid>" or "E<error>"
    go_r, go_w = os.pipe()  # template -> worker: "g" once the agent knows the pid
    # The new processes start with every signal blocked, and the worker keeps them
    # blocked until it has its own dispositions (_reset_signals). Without this, the
    # worker would inherit the template's ignored SIGINT, and a SIGINT the agent
    # forwards as soon as it knows the pid would be discarded: the agent then waits
    # its whole shutdown grace and kills. A blocked signal is held pending instead,
    # even an ignored one, and acts once the worker unblocks it.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        intermediate = os.fork()
    except OSError as exc:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        _close_quietly(pid_r, pid_w, go_r, go_w, *fds)
        send_message(sock, {"error": f"fork failed: {exc}"})
        return None
    if intermediate == 0:
        return _intermediate(request, stdio_fds, pid_w, go_r, (pid_r, go_w))
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    _close_quietly(pid_w, go_r, *fds)
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
        _close_quietly(pid_r, go_w)
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
) -> _Job | None:
    """Fork the worker and exit; returns only in the worker."""
    try:
        _close_quietly(*inherited)
        cwd = request["cwd"]
        umask = request["umask"]
        assert isinstance(cwd, str) and isinstance(umask, int)
        # Done here rather than in the worker so that a bad directory is reported to
        # the agent as a refused start, like Popen's error for a fresh process.
        os.chdir(cwd)
        os.umask(umask)
        # The affinity the worker would have inherited, or its NUMA binding; set
        # before the fork so that the worker never runs outside it.
        os.sched_setaffinity(0, _int_list(request, "cpus"))
        me = os.getpid()
        ready_r, ready_w = os.pipe()
        worker = os.fork()
        if worker == 0:
            _close_quietly(ready_r, pid_w)
            os.setsid()
            os.close(ready_w)  # end of file: the worker leads its own process group
            return _Job(request, fds, go_r, me)
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


# --- the worker -----------------------------------------------------------------------


def _set_parent_death_signal(sig: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - every Linux libc has prctl
        return
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _await_adoption(job: _Job) -> None:
    """Wait to become the agent's child, then die with it; exit if it is gone."""
    agent = job.request["agent_pid"]
    death = job.request["death_signal"]
    assert isinstance(agent, int) and isinstance(death, int)
    deadline = time.monotonic() + _ADOPTION_TIMEOUT
    while os.getppid() == job.intermediate:
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.0001)
    if os.getppid() != agent:
        os._exit(1)  # adopted by someone else: the agent died meanwhile
    _set_parent_death_signal(death)
    if os.getppid() != agent:
        os._exit(1)  # the agent died before the signal was armed
    go = os.read(job.go_fd, 1)
    os.close(job.go_fd)
    if go != b"g":
        os._exit(1)  # the template died before the agent learnt of this worker


def _take_stdio(fds: list[int], keep: set[int]) -> None:
    for target, fd in enumerate(fds):
        if fd >= 0:
            os.dup2(fd, target)
        else:
            _close_quietly(target)
    for fd in _open_fds():
        if fd > 2 and fd not in keep:
            _close_quietly(fd)


def _buffer_size(fd: int) -> int:
    # io.open's choice: the file's block size when it reports one.
    try:
        size = os.fstat(fd).st_blksize
    except OSError:
        size = 0
    return size if size > 1 else io.DEFAULT_BUFFER_SIZE


def _open_stdio(
    fd: int, write: bool, name: str, encoding: str, errors: str, buffered: bool
) -> io.TextIOWrapper | None:
    """Build ``sys.std*`` for ``fd`` the way the interpreter does at startup."""
    try:
        os.fstat(fd)
    except OSError:
        return None  # no such descriptor: python sets sys.std* to None too
    # Like python: stdin stays buffered (TextIOWrapper needs read1); -u makes the
    # output streams unbuffered at the binary level and write-through at the text one.
    raw = io.FileIO(fd, "wb" if write else "rb", closefd=False)
    buf: io.FileIO | io.BufferedWriter | io.BufferedReader = raw
    if not write:
        buf = io.BufferedReader(raw, _buffer_size(fd))
    elif buffered:
        buf = io.BufferedWriter(raw, _buffer_size(fd))
    raw.name = name  # what python shows: "<stdout>", not the descriptor number
    stream = io.TextIOWrapper(
        buf,
        encoding=encoding,
        errors=errors,
        newline="\n",
        line_buffering=buffered and raw.isatty(),
        write_through=not buffered,
    )
    stream.mode = "w" if write else "r"  # type: ignore[misc]
    return stream


def _reset_stdio(stdio: _Stdio) -> None:
    names = ("<stdin>", "<stdout>", "<stderr>")
    streams = [
        _open_stdio(fd, fd > 0, names[fd], stdio.encodings[fd], stdio.errors[fd], stdio.buffered)
        for fd in range(_STDIO_FDS)
    ]
    sys.stdin = sys.__stdin__ = streams[0]  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = streams[1]  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = streams[2]  # type: ignore[misc]


def _int_list(request: dict[str, object], key: str) -> list[int]:
    value = request.get(key, [])
    assert isinstance(value, list)
    return [int(v) for v in value]


def _reset_signals(request: dict[str, object]) -> None:
    """Dispositions and mask as a freshly exec'd interpreter has them before it installs
    its SIGINT handler (:func:`_handle_interrupts` does that last).

    Runs with every signal blocked since the fork (see :func:`_spawn`). A signal sent
    meanwhile is pending; the new mask delivers it with a default disposition, so it
    acts as on a fresh process that has not yet set up its handlers: SIGINT and SIGTERM
    end the worker at once (setting SIG_IGN, or SIG_DFL for a signal whose default is
    to be ignored, discards a pending one, as it would have been on a fresh process).
    """
    ignored = set(_int_list(request, "ignored_signals"))
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # reserved by the C library (the first real-time signals)
    # What the interpreter itself sets at startup.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, _int_list(request, "blocked_signals"))


def _handle_interrupts(request: dict[str, object]) -> None:
    """Install python's SIGINT handler, as the interpreter does unless SIGINT is ignored.

    The last step before the worker's code runs: a KeyboardInterrupt raised any earlier
    would end in the setup's error path (exit status 1) instead of an interrupted
    worker's death by SIGINT.
    """
    if signal.SIGINT not in _int_list(request, "ignored_signals"):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _reseed() -> None:
    """Draw from the OS every seed a fresh interpreter draws when importing what the
    template has imported; modules not imported are left alone (never imported here).

    ``random`` reseeds itself after fork (``os.register_at_fork``). The others were
    seeded once, in the template, and every worker would draw the same numbers.
    """
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None:
        # The CPU generator, which torch seeds from the OS when it creates it. Not
        # torch.seed(): that also queues a seeding of every CUDA generator for CUDA's
        # lazy start, which a fresh interpreter does not (its CUDA generators start
        # from torch's fixed default seed until the script seeds them).
        generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    seed = getattr(numpy_random, "seed", None)
    if seed is not None:
        seed()  # the legacy global RandomState behind numpy.random.random() & co.
    # sympy (imported by torch._dynamo, preloaded for DDP scripts) makes two
    # random.Random instances at import; the at-fork hook of random reseeds only its own.
    sympy_random = sys.modules.get("sympy.core.random")
    random_class = getattr(sys.modules.get("random"), "Random", None)
    for name in ("rng", "_assumptions_rng"):
        rng = getattr(sympy_random, name, None)
        if random_class is not None and isinstance(rng, random_class):
            rng.seed()
    mp_process = sys.modules.get("multiprocessing.process")
    current = getattr(mp_process, "current_process", None)
    if current is not None:
        current().authkey = os.urandom(32)


def _import_titles() -> ModuleType | None:
    """setproctitle, imported once in the template (None when it is not installed)."""
    try:
        import setproctitle
    except ImportError:
        return None
    return setproctitle


def _retitle(request: dict[str, object], titles: ModuleType | None) -> None:
    """Show this worker in ps, ``pgrep -f``, top and psutil as its fresh start shows.

    The command line is the fresh start's (``python -u -m elastrun.worker.bootstrap
    train.py ARGS``, what ``--no-template`` shows), and the name (``/proc/PID/comm``,
    what top shows) the interpreter's, which ``exec`` takes from the file it runs.

    The kernel shows ``/proc/PID/cmdline`` from the memory that held the template's
    arguments. setproctitle writes the title there as one string; psutil and others
    split what they read on NUL bytes, so a title shorter than that memory, padded
    with NULs, would read as the command line followed by empty arguments. A title
    that runs past the end of the arguments makes the kernel show it as one string,
    which psutil splits on spaces into the same arguments. So the template's own
    command line is shorter than any worker's, and the title runs on into the first
    environment variable, :data:`TITLE_ROOM`, which the agent put there for it.
    (Rejected: keeping to the arguments' memory, setproctitle's ``SPT_NOENV``. It
    always leaves two NULs or more after the title, which psutil reads as the whole
    line and then an empty argument; and a worker's title would have to be cut to the
    length of the template's command line. The price of the choice: psutil stops
    reading ``/proc/PID/environ`` at those NULs, now in the environment's memory.)

    setproctitle finds the arguments by walking back from the first string listed in
    the C ``environ``, and takes as its room the strings listed after it that follow in
    memory. So this runs before the worker's environment replaces the template's, and
    removes every variable but :data:`TITLE_ROOM` first: the rest of
    ``/proc/PID/environ`` is left as it was.

    Without setproctitle, or when the room is gone (a preloaded module changed it), or
    for a command line that cannot be encoded, the worker keeps the template's command
    line; nothing fails.
    """
    argv = request["argv"]
    assert isinstance(argv, list)
    if titles is None or TITLE_ROOM not in os.environ or not argv:
        return
    try:
        for name in list(os.environ):
            if name != TITLE_ROOM:
                del os.environ[name]
        titles.setproctitle(" ".join(str(a) for a in argv))
        # setproctitle also names the process after the title's first 15 bytes.
        titles.setthreadtitle(os.path.basename(str(argv[0])))
        del os.environ[TITLE_ROOM]
    except (OSError, ValueError):  # an argument that is not UTF-8, a strange variable
        return


def _become_worker(job: _Job, stdio: _Stdio, keep: set[int], titles: ModuleType | None) -> None:
    """Turn this fresh fork into the worker the request describes."""
    try:
        _await_adoption(job)
        _retitle(job.request, titles)  # before the environment is replaced
        _take_stdio(job.fds, keep)
        _reset_stdio(stdio)
        _reset_signals(job.request)
        env = job.request["env"]
        argv = job.request["argv"]
        assert isinstance(env, dict) and isinstance(argv, list)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        time.tzset()
        if not sys.flags.safe_path and sys.path:
            sys.path[0] = os.getcwd()  # what ``-m`` puts there, for this cwd
        sys.orig_argv = [str(a) for a in argv]
        bootstrap_args = job.request["bootstrap_args"]
        assert isinstance(bootstrap_args, list)
        sys.argv = [bootstrap.__file__, *(str(a) for a in bootstrap_args)]
        importlib.invalidate_caches()
        _reseed()
        import faulthandler

        if faulthandler.is_enabled():
            faulthandler.enable(file=sys.stderr, all_threads=True)
        _handle_interrupts(job.request)
    except BaseException as exc:
        try:
            os.write(
                2, f"elastrun: cannot set up the worker: {type(exc).__name__}: {exc}\n".encode()
            )
        except OSError:
            pass
        os._exit(1)


_Excepthook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


class _HideTemplateFrames:
    """Wraps ``sys.excepthook`` so that a traceback starts at the worker's own code.

    The worker's exception travels up through the template's frames, which a fresh
    start does not have; the bootstrap trims only its own and runpy's.
    """

    def __init__(self, hook: _Excepthook) -> None:
        self._hook = hook

    def __call__(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        trimmed = tb
        while trimmed is not None and _is_template_frame(trimmed.tb_frame.f_code.co_filename):
            trimmed = trimmed.tb_next
        if exc.__traceback__ is tb:
            exc.__traceback__ = trimmed
        self._hook(exc_type, exc, trimmed)

    def __repr__(self) -> str:
        return f"_HideTemplateFrames({self._hook!r})"


def _is_template_frame(filename: str) -> bool:
    if filename in (__file__, bootstrap.__file__, "<frozen runpy>"):
        return True
    return os.path.basename(filename) == "runpy.py"


def _run_bootstrap() -> None:
    try:
        bootstrap.main()
    except SystemExit:
        raise
    except BaseException:
        # Installed on the way out only, like the bootstrap's own hook, which it wraps.
        sys.excepthook = _HideTemplateFrames(sys.excepthook)
        raise


if __name__ == "__main__":
    main()
