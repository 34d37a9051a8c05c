"""Turning a fresh fork of the worker template into the worker a spawn request describes.

The worker becomes what ``python [OPTS] -m elastrun.worker.bootstrap ARGS`` would have
been: its own session (made by the intermediate, see :mod:`elastrun.template.worker.fork`),
the given stdin/stdout/stderr (new ``sys.std*`` objects built as the interpreter builds
them, ``-u`` included), default signal dispositions (plus the agent's ignored signals
and mask, as ``exec`` would pass them on), no inherited descriptors, the given working
directory, umask, CPU affinity, environment, ``sys.argv`` and ``sys.orig_argv``, that
command line and the interpreter's name in ps, ``pgrep -f``, top and psutil
(:func:`retitle`, before any of the worker's own code runs), and its own random seeds
(every generator that a fresh interpreter seeds from the OS when importing what the
template imported: :func:`reseed`). What cannot be made identical is listed in
:mod:`elastrun.template.worker.serve`.

First it waits to be adopted by the agent (:func:`await_adoption`): it arms its
parent-death signal only once the agent is its parent, and runs only after the
template's go-ahead.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import signal
import sys
import time
from types import ModuleType

from elastrun.core.linux import die_with_parent
from elastrun.core.procinfo import is_open
from elastrun.template.worker.fork import Job, close_quietly, open_fds
from elastrun.wire.template import STDIO_FDS, TITLE_ROOM, int_list
from elastrun.worker import bootstrap, threadpools

# Longest a new worker waits to be handed to the agent. The intermediate exits right
# after forking, so this is only reached when the system is wedged.
_ADOPTION_TIMEOUT = 30.0


class Stdio:
    """How the interpreter built sys.std* at startup (from -u, PYTHONIOENCODING, locale)."""

    # Not a dataclass, for the template's start-up (see fork.Job).
    __slots__ = ("buffered", "encodings", "errors")

    def __init__(
        self, buffered: bool, encodings: tuple[str, str, str], errors: tuple[str, str, str]
    ) -> None:
        self.buffered = buffered
        self.encodings = encodings
        self.errors = errors

    def __repr__(self) -> str:
        return f"Stdio(buffered={self.buffered}, {self.encodings}, {self.errors})"

    @staticmethod
    def of_interpreter() -> Stdio:
        streams = (sys.__stdin__, sys.__stdout__, sys.__stderr__)
        out = sys.__stdout__
        buffered = not (out is not None and out.write_through)
        default = ("utf-8", "strict")
        enc = tuple(s.encoding if s is not None else default[0] for s in streams)
        err = tuple((s.errors or default[1]) if s is not None else default[1] for s in streams)
        return Stdio(buffered, (enc[0], enc[1], enc[2]), (err[0], err[1], err[2]))


def await_adoption(job: Job) -> None:
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
    die_with_parent(death, agent)  # exits if the agent died before the signal was armed
    go = os.read(job.go_fd, 1)
    os.close(job.go_fd)
    if go != b"g":
        os._exit(1)  # the template died before the agent learnt of this worker


def _take_stdio(fds: list[int], keep: set[int]) -> None:
    for target, fd in enumerate(fds):
        if fd >= 0:
            os.dup2(fd, target)
        else:
            close_quietly(target)
    for fd in open_fds():
        if fd > 2 and fd not in keep:
            close_quietly(fd)


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
    if not is_open(fd):
        return None  # python sets sys.std* to None too
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
    stream.mode = "w" if write else "r"  # type: ignore[misc]  # read-only in the stubs; open() sets it
    return stream


def _reset_stdio(stdio: Stdio) -> None:
    names = ("<stdin>", "<stdout>", "<stderr>")
    streams = [
        _open_stdio(fd, fd > 0, names[fd], stdio.encodings[fd], stdio.errors[fd], stdio.buffered)
        for fd in range(STDIO_FDS)
    ]
    # sys.__std*__ are final in the stubs; the interpreter sets them at startup as here.
    sys.stdin = sys.__stdin__ = streams[0]  # type: ignore[misc]  # see above
    sys.stdout = sys.__stdout__ = streams[1]  # type: ignore[misc]  # see above
    sys.stderr = sys.__stderr__ = streams[2]  # type: ignore[misc]  # see above


def reset_signals(request: dict[str, object]) -> None:
    """Dispositions and mask as a freshly exec'd interpreter has them before it installs
    its SIGINT handler (the bootstrap installs python's, once it is set up:
    ``elastrun.worker.bootstrap``).

    Runs with every signal blocked since the fork (see
    :func:`elastrun.template.worker.fork.spawn_many`). A signal sent meanwhile is pending; the
    new mask delivers it with a default disposition, so it acts as on a fresh process
    that has not yet set up its handlers: SIGINT and SIGTERM end the worker at once
    (setting SIG_IGN, or SIG_DFL for a signal whose default is to be ignored, discards a
    pending one, as it would have been on a fresh process).
    """
    ignored = set(int_list(request, "ignored_signals"))
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        # Raises for those the C library reserves (the first real-time signals).
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    # What the interpreter itself sets at startup.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, int_list(request, "blocked_signals"))


def reseed() -> None:
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


def import_titles() -> ModuleType | None:
    """setproctitle, imported once in the template (None when it is not installed)."""
    try:
        import setproctitle
    except ImportError:
        return None
    return setproctitle


def retitle(request: dict[str, object], titles: ModuleType | None) -> None:
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


def _take_environment(request: dict[str, object]) -> None:
    """The worker's environment, ``sys.path[0]``, ``sys.orig_argv`` and ``sys.argv``."""
    env = request["env"]
    argv = request["argv"]
    assert isinstance(env, dict) and isinstance(argv, list)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    time.tzset()
    if not sys.flags.safe_path and sys.path:
        sys.path[0] = os.getcwd()  # what ``-m`` puts there, for this cwd
    sys.orig_argv = [str(a) for a in argv]
    bootstrap_args = request["bootstrap_args"]
    assert isinstance(bootstrap_args, list)
    sys.argv = [bootstrap.__file__, *(str(a) for a in bootstrap_args)]


def become_worker(job: Job, stdio: Stdio, keep: set[int], titles: ModuleType | None) -> None:
    """Turn this fresh fork into the worker the request describes.

    Never raises: a failure is reported on the worker's stderr and ends it (status 1).
    """
    try:
        await_adoption(job)
        retitle(job.request, titles)  # before the environment is replaced
        _take_stdio(job.fds, keep)
        _reset_stdio(stdio)
        reset_signals(job.request)
        _take_environment(job.request)
        threadpools.resize_for_worker(os.environ)
        importlib.invalidate_caches()
        reseed()
        import faulthandler

        if faulthandler.is_enabled():
            faulthandler.enable(file=sys.stderr, all_threads=True)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(
                2, f"elastrun: cannot set up the worker: {type(exc).__name__}: {exc}\n".encode()
            )
        os._exit(1)
