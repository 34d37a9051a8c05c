"""The worker template ("zygote"): one pre-imported interpreter that workers fork from.

The agent starts it once as::

    python [OPTS] -m elastrun.template.worker.serve N

with the interpreter options (``OPTS``) and the environment its workers will have, minus
the per-worker variables, plus ``TITLE_ROOM`` first (see ``retitle`` in
:mod:`elastrun.template.worker.child`). The first message on the control socket (fd
``N``) names the modules to preload: it imports them (the optional ones are skipped
quietly when they are not installed), checks that forking is still safe (no thread
started, CUDA not initialised), says hello and then serves spawn requests until the
agent closes the socket. Its command line is kept that short (the module list travels
on the socket) so that every worker's command line is longer than it.

Why two forks per worker: the worker must be the *agent's* child, so that the agent can
reap it, read its real exit status and give it the parent-death signal it gives every
worker (how: :mod:`elastrun.template.worker.fork`).

The worker then becomes what ``python [OPTS] -m elastrun.worker.bootstrap ARGS`` would
have been (:mod:`elastrun.template.worker.child`) and runs
:func:`elastrun.worker.bootstrap.main`, whose exceptions reach the interpreter's top
level exactly as from a fresh start.

What cannot be made identical, and is documented as such:

* ``/proc/PID/cmdline`` holds the command line as one string, its arguments separated
  by spaces rather than NULs: ps, ``pgrep -f`` and top show the same text, psutil splits
  it on spaces (an argument that contains a space, or is empty, reads differently), and
  a tool that takes the first NUL-separated item as the program reads the whole line.
  For the few milliseconds before ``retitle`` it is the template's command line
  (for good where setproctitle is not installed).
* ``/proc/PID/environ`` shows the template's initial environment (the live one,
  ``os.environ`` and ``getenv``, is the worker's), its first variable
  (``TITLE_ROOM``) overwritten by the end of the command line and NUL bytes, at
  which psutil stops reading it: its ``environ()`` is empty.
* All workers share the template's string-hash seed, drawn once when the interpreter
  starts: ``str`` and ``bytes`` hashes, and so the iteration order of sets of strings,
  are the same in every worker (unless ``PYTHONHASHSEED`` makes them so anyway).
* The objects the template's imports left alive are frozen (:func:`gc.freeze`): the
  worker's garbage collector leaves them alone, and :func:`gc.get_objects` does not
  list them (:func:`gc.get_freeze_count` counts them). They are modules' own objects,
  alive until exit in a fresh interpreter too.
* A module preloaded with ``--preload`` that draws a seed of its own from the OS at
  import time shares it with every worker: only the generators named above are
  reseeded (another module may have seeded its generator with a constant, which must
  stay).
* Modules already imported saw the template's environment at import time -- which is
  why the agent keys templates by the environment.

The messages on the control socket are :mod:`elastrun.wire.template`'s.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import TracebackType

from elastrun.template.worker.child import Stdio, become_worker, import_titles
from elastrun.template.worker.fork import Job, close_quietly, open_fds, spawn_many, thread_count
from elastrun.wire.template import (
    BATCH_MAX,
    STDIO_FDS,
    TEMPLATE_MODULE,
    VERSION,
    recv_message,
    send_message,
    split_batch,
    version_problem,
)
from elastrun.worker import bootstrap, threadpools


def _parse_args(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        raise SystemExit(f"usage: python -m {TEMPLATE_MODULE} FD")
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
    problem = version_problem(setup)
    if problem is not None:
        raise SystemExit(f"{TEMPLATE_MODULE}: the agent speaks {problem}")
    return _str_list(setup, "preload"), _str_list(setup, "optional")


def _str_list(message: dict[str, object], key: str) -> list[str]:
    value = message.get(key)
    return [str(v) for v in value] if isinstance(value, list) else []


def _fork_hazard(module: str) -> str | None:
    """Why forking after importing ``module`` would be unsafe, or None."""
    threads = thread_count()
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


def main(argv: list[str] | None = None) -> None:
    """Run the template: preload, say hello, serve spawn requests.

    Returns only in a newly forked worker, after the worker's script has run (the
    interpreter then exits as it would after ``python -m elastrun.worker.bootstrap``).
    """
    fd = _parse_args(sys.argv[1:] if argv is None else argv)
    # The template lives in its own session; a stray interrupt must not end it. The
    # agent stops it by closing the channel (or SIGKILL, or its parent-death signal).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdio = Stdio.of_interpreter()
    sock = socket.socket(fileno=fd)
    required, optional = _recv_setup(sock)
    t0 = time.monotonic()
    titles = import_titles()
    # Libraries whose thread pools start at load time start none while the template
    # imports; each worker gets the pools a fresh start would have (threadpools).
    previous = threadpools.quiet_for_import(os.environ)
    try:
        loaded, problem = _preload(required, optional)
    finally:
        threadpools.restore(os.environ, previous)
    threadpools.remember_libraries()
    # What the imports left alive lives as long as a worker does: frozen, the collector
    # of a forked worker never walks it, so neither its collections nor its exit write
    # to (and so copy) the template's pages: a torch worker's exit costs half as much.
    gc.collect()
    gc.freeze()
    hello: dict[str, object] = {
        "version": VERSION,
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
    keep = open_fds() - {fd}
    send_message(sock, hello)
    job = _serve(sock)
    # Only a new worker gets here.
    sock.close()
    become_worker(job, stdio, keep, titles)
    _run_bootstrap()


def _serve(sock: socket.socket) -> Job:
    """Serve requests until the channel closes; returns only in a new worker."""
    while True:
        try:
            got = recv_message(sock, maxfds=STDIO_FDS * BATCH_MAX + 1)  # + the ledger
        except (ConnectionError, OSError, ValueError):
            raise SystemExit(1) from None
        if got is None:
            raise SystemExit(0)  # the agent closed the channel: a clean stop
        message, fds = got
        try:
            batch = split_batch(message, fds)
            if isinstance(batch, str):
                close_quietly(*fds)
                send_message(sock, {"error": f"bad request: {batch}"})
                continue
            job = spawn_many(sock, *batch)
        except OSError:
            raise SystemExit(1) from None  # the agent is gone (no one to reply to)
        if job is not None:
            return job


# --- the worker's code runs from here -------------------------------------------------

_Excepthook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


def _hiding_template_frames(hook: _Excepthook) -> _Excepthook:
    """``hook`` (``sys.excepthook``) given a traceback that starts at the worker's own
    code: the worker's exception travels up through the template's frames (this
    module's ``main`` and :func:`_run_bootstrap`), which a fresh start does not have;
    the bootstrap trims only its own and runpy's."""

    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        trimmed = tb
        while trimmed is not None and _is_template_frame(trimmed.tb_frame.f_code.co_filename):
            trimmed = trimmed.tb_next
        if exc.__traceback__ is tb:
            exc.__traceback__ = trimmed
        hook(exc_type, exc, trimmed)

    return excepthook


def _is_template_frame(filename: str) -> bool:
    frames = (__file__, bootstrap.__file__, "<frozen runpy>")
    return filename in frames or os.path.basename(filename) == "runpy.py"


def _run_bootstrap() -> None:
    try:
        bootstrap.main()
    except SystemExit:
        raise
    except BaseException:
        # Installed on the way out only, like the bootstrap's own hook, which it wraps.
        sys.excepthook = _hiding_template_frames(sys.excepthook)
        raise


if __name__ == "__main__":
    main()
