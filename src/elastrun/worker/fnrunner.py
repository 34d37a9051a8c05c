"""Run a pickled Python function as a worker (the child side of function workers).

Usage (internal): ``python -u -m elastrun.worker.fnrunner PAYLOAD``, where PAYLOAD was
written by the agent: a JSON header line, then the pickled ``(function, args,
return_file)``. The return value is pickled to ``return_file``; an exception is recorded
to ``TORCHELASTIC_ERROR_FILE`` by ``record`` and the process exits 1.

The process leaves through :func:`leave`, never through interpreter finalization; see
there for why.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import runpy
import sys
import threading
import traceback
from collections.abc import Callable


def run_call(function: Callable[..., object], args: tuple[object, ...], return_file: str) -> int:
    """Call ``function(*args)`` under ``record``; returns the exit code for the process."""
    from elastrun.worker.record import record

    try:
        result = record(function)(*args)
    except SystemExit as exc:
        code = exc.code
        return 0 if code is None else code if isinstance(code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    tmp = f"{return_file}.tmp.{os.getpid()}"
    with open(tmp, "wb") as fh:
        pickle.dump(result, fh)
    os.replace(tmp, return_file)
    return 0


def leave(code: int) -> None:
    """End the worker with ``code`` once the function is done: what a normal exit does
    that a user can rely on (non-daemon threads joined, ``atexit`` handlers run, standard
    streams flushed), then ``os._exit``.

    Why not a normal exit: a function that returns without ``destroy_process_group()``
    leaves gloo's worker threads alive. Such a thread drops its last reference to a
    finished collective just after the main thread has been woken by it, and that drop
    releases Python tensors, so it needs the GIL. If the main thread has meanwhile
    written the result and begun finalizing the interpreter, taking the GIL ends the
    thread (``pthread_exit``) inside a C++ destructor that may not unwind:
    ``std::terminate``, "terminate called without an active exception", SIGABRT, and a
    job whose every function returned fails. The window is the few milliseconds in
    which the main thread keeps the GIL, so it opens under load, with many workers.
    torch's function workers rarely meet it only because they wait, GIL released, until
    the agent has read every local return value; a wait (a barrier among the node's
    workers) narrows the window but leaves it open for the last one to arrive. Skipping
    finalization closes it: the process ends before any thread can be told to exit.
    What is given up is the teardown of modules (``__del__`` of objects still alive at
    exit, C++ static destructors), which the fork start method and multiprocessing's
    forked children skip as well.
    """
    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass  # closed or replaced by the user: nothing left to flush
        os._exit(code)


def _prepare_main(main_file: str | None) -> None:
    """Import the parent's main script as ``__mp_main__`` and alias it as ``__main__``."""
    if not main_file or not os.path.exists(main_file):
        return
    if os.path.basename(main_file) == "fnrunner.py":
        return
    namespace = runpy.run_path(main_file, run_name="__mp_main__")
    module = type(sys)("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__mp_main__"] = sys.modules["__main__"] = module


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m elastrun.worker.fnrunner PAYLOAD", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as fh:
        header = json.loads(fh.readline())
        body = fh.read()
    if header.get("version") != 1:
        print(f"fnrunner: unsupported payload version {header.get('version')!r}", file=sys.stderr)
        return 2
    sys.path[:] = header["sys_path"]
    _prepare_main(header.get("main_file"))
    # The payload is written by our own agent for this child only.
    function, args, return_file = pickle.loads(body)
    return run_call(function, tuple(args), return_file)


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
