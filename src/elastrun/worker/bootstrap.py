"""Run a Python worker so that an uncaught exception always reaches the agent.

The agent starts Python workers as::

    python -u -m elastrun.worker.bootstrap SCRIPT [ARGS...]
    python -u -m elastrun.worker.bootstrap -m MODULE [ARGS...]

To the script this is the same as ``python -u SCRIPT ARGS`` (or ``python -u -m MODULE
ARGS``): the same ``sys.argv``, ``__name__``, ``__file__``, ``sys.path[0]`` and
``sys.modules["__main__"]`` (so pickling classes defined in the script and
``multiprocessing`` spawn work), the same exit codes and the same traceback on stderr.

The difference: when the script dies of an uncaught exception and
``TORCHELASTIC_ERROR_FILE`` names a file that does not exist yet, the exception and its
traceback are written there first (in torch's ``record`` format), so the agent's failure
report shows them even if the script never used ``record``. A file that already exists
was written by the script's own ``record`` and is left alone. ``SystemExit`` and
``KeyboardInterrupt`` are not recorded. :mod:`faulthandler` is enabled so that a native
crash leaves the Python stacks on stderr.

Startup cost matters (every worker of every restart pays it), so at startup this module
imports only what ``python -m`` has already imported; the error-file code is imported
only when there is an error to write.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # C module: `signal` loads enum (25 ms)
import faulthandler
import os
import sys
from collections.abc import Callable
from types import ModuleType, TracebackType

from elastrun.wire import bootstrap as _wire
from elastrun.wire.env import ERROR_FILE_ENV, PROGRESS_FILE_ENV, STACKS_FILE_ENV

_USAGE = "usage: python -m elastrun.worker.bootstrap (SCRIPT | -m MODULE) [ARGS...]\n"

_Excepthook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


_stacks_file: object = None  # kept open for the life of the process


def _arm_stack_dumps() -> None:
    """Dump every thread's stack to ``$ELASTRUN_STACKS_FILE`` on SIGUSR1.

    faulthandler writes from C, so this works even when the worker is stuck in native
    code holding the GIL, where no Python-level server could answer.
    """
    global _stacks_file
    path = os.environ.get(STACKS_FILE_ENV)
    if not path:
        return
    try:
        import signal

        fh = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives forever
        faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError, AttributeError):
        return  # no dumps for this worker; it runs all the same
    _stacks_file = fh


def _hold_interrupts() -> bool:
    """Let a SIGINT that comes while the bootstrap sets itself up end the worker at once;
    returns whether python's handler is to be installed before the worker's code runs.

    Python's handler only raises ``KeyboardInterrupt`` where the interpreter happens to
    be, and the setup imports modules: raised inside the import system's cleanup
    callbacks, the exception is printed as "ignored" and lost, and the worker goes on
    (its agent then waited out the whole shutdown grace and killed it). With the default
    disposition meanwhile, the worker dies of the signal, as a process does before it
    installs handlers. A SIGINT the parent left ignored stays ignored, as in python.
    """
    held = os.environ.pop(_wire.SIGINT_HELD_ENV, None) == str(_wire.VERSION)
    ignored = _signal.getsignal(_signal.SIGINT) == _signal.SIG_IGN
    if not ignored:
        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    if held:  # a SIGINT that came meanwhile ends the worker here
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [_signal.SIGINT])
    return not ignored


def main(argv: list[str] | None = None) -> None:
    """Run the worker named by ``argv`` (default ``sys.argv[1:]``) as ``__main__``.

    Returns when the worker returns; exceptions (including ``SystemExit``) propagate
    to the interpreter exactly as they would from the worker run directly. Bad usage
    exits with status 2.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help") or args == ["-m"]:
        sys.stderr.write(_USAGE)
        raise SystemExit(2)
    held = _hold_interrupts()
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(all_threads=True)
        except (RuntimeError, ValueError, OSError, AttributeError):
            # No usable stderr file descriptor: python itself would run the script
            # anyway, so do we; there is just nowhere to dump a native crash.
            pass
    _arm_stack_dumps()
    if PROGRESS_FILE_ENV in os.environ:  # the agent asked for progress reports
        from elastrun.pace.worker import report as progress

        progress.install()
    _rewrite_orig_argv(args)
    if held:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    try:
        if args[0] == "-m":
            _run_module(args[1], args[2:])
        else:
            _run_script(args[0], args[1:])
    except SystemExit:
        raise
    except KeyboardInterrupt:
        # Not a failure report: python prints it and dies of SIGINT, and so do we.
        _trim_printed_traceback()
        raise
    except BaseException as exc:
        exc.__traceback__ = _trim(exc.__traceback__)
        _write_error_file(exc)
        _trim_printed_traceback()
        # A bare raise keeps the traceback; python prints it (through the trimming
        # hook) and exits with status 1 after the usual shutdown (atexit handlers).
        raise


def _run_script(path: str, args: list[str]) -> None:
    """Run a file (or a directory / zip file with ``__main__.py``) as ``python`` does."""
    sys.argv[:] = [path, *args]
    abspath = os.path.abspath(path)
    if _is_importable_location(path):
        # ``python DIR`` / ``python ZIP``: the interpreter puts the location first on
        # sys.path and runs its __main__ module through runpy, and so do we.
        _set_path0(abspath)
        _install_fresh_main()
        _run_module_as_main("__main__", alter_argv=False)
        return
    try:
        with open(abspath, "rb") as f:
            data = f.read()
    except OSError as exc:
        # The interpreter's own message and status for an unopenable script.
        sys.stderr.write(
            f"{sys.executable}: can't open file {abspath!r}: [Errno {exc.errno}] {exc.strerror}\n"
        )
        raise SystemExit(2) from None
    # As python does: sys.path[0] is the script's directory with symlinks resolved,
    # while __file__ keeps the path as given (made absolute).
    _set_path0(os.path.dirname(os.path.realpath(path)))
    from importlib.machinery import SourceFileLoader, SourcelessFileLoader
    from importlib.util import MAGIC_NUMBER

    loader: SourceFileLoader | SourcelessFileLoader
    if path.endswith(".pyc") or data[:4] == MAGIC_NUMBER:
        # A compiled script, which python also runs directly.
        import marshal

        if data[:4] != MAGIC_NUMBER:
            raise RuntimeError("Bad magic number in .pyc file")
        code = marshal.loads(data[16:])  # after the 16-byte header (PEP 552)
        loader = SourcelessFileLoader("__main__", abspath)
    else:
        # dont_inherit: the script must not inherit this module's __future__ imports.
        code = compile(data, abspath, "exec", dont_inherit=True)
        loader = SourceFileLoader("__main__", abspath)
    main_module = _install_fresh_main()
    main_module.__dict__.update(__file__=abspath, __cached__=None, __loader__=loader)
    exec(code, main_module.__dict__)


def _run_module(name: str, args: list[str]) -> None:
    """Run module ``name`` as ``python -m name`` does (sys.path[0] is already the cwd)."""
    # python -m shows "-m" as argv[0] while it looks the module up; runpy then sets it
    # to the module's file.
    sys.argv[:] = ["-m", *args]
    _install_fresh_main()
    _run_module_as_main(name, alter_argv=True)


def _run_module_as_main(name: str, *, alter_argv: bool) -> None:
    # runpy._run_module_as_main is what the interpreter itself calls for ``-m`` (and for
    # directories and zip files). Unlike the public run_module/run_path it runs the code
    # in the real sys.modules["__main__"] and leaves it there afterwards, so classes
    # defined by the script stay picklable in atexit handlers and at shutdown.
    # The public API is the fallback should a future Python rename it.
    import runpy

    private = getattr(runpy, "_run_module_as_main", None)
    if private is not None:
        private(name, alter_argv)
    else:  # pragma: no cover - depends on the Python version
        runpy.run_module(name, run_name="__main__", alter_sys=True)


def _install_fresh_main() -> ModuleType:
    """Make a new, empty ``__main__`` module current, as the interpreter creates one.

    The bootstrap itself runs as ``__main__``; the worker must not see its globals.
    """
    import builtins

    module = type(sys)("__main__")
    module.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = module
    return module


def _set_path0(directory: str) -> None:
    """Replace the bootstrap's sys.path[0] (the cwd, from ``-m``) with ``directory``."""
    # With -P / PYTHONSAFEPATH python adds no such entry, for the bootstrap or the script.
    if not sys.flags.safe_path:
        sys.path[:1] = [directory]


def _is_importable_location(path: str) -> bool:
    """True for a directory or a zip file: a location python runs ``__main__`` from."""
    if os.path.isdir(path):
        return True
    import zipimport  # already imported by the interpreter at startup

    try:
        zipimport.zipimporter(path)
    except (zipimport.ZipImportError, OSError):
        return False
    return True


def _rewrite_orig_argv(args: list[str]) -> None:
    """Make ``sys.orig_argv`` the command line of the equivalent plain ``python`` run.

    Code that re-executes itself from ``sys.orig_argv`` then runs the script again
    rather than this bootstrap (what it would do under plain python).
    """
    orig = list(getattr(sys, "orig_argv", []))
    for i in range(len(orig) - 1):
        if orig[i] == "-m" and orig[i + 1] == _wire.BOOTSTRAP_MODULE and orig[i + 2 :] == args:
            sys.orig_argv = [*orig[:i], *args]
            return


# --- failure path -------------------------------------------------------------------


def _is_bootstrap_frame(filename: str) -> bool:
    if filename == __file__:
        return True
    # runpy is frozen in 3.11+ ("<frozen runpy>"); older or unfrozen builds use a path.
    return filename == "<frozen runpy>" or os.path.basename(filename) == "runpy.py"


def _trim(tb: TracebackType | None) -> TracebackType | None:
    """Drop the leading bootstrap and runpy frames, so the traceback starts at the worker.

    When every frame is ours -- a SyntaxError from compiling the script -- nothing is
    left, and python prints just the error, as it does for ``python SCRIPT``.
    """
    while tb is not None and _is_bootstrap_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


class _TrimmingExcepthook:
    """Wraps ``sys.excepthook`` so the uncaught traceback printed omits our frames."""

    def __init__(self, hook: _Excepthook) -> None:
        self._hook = hook

    def __call__(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        trimmed = _trim(tb)
        # The default hook prints exc.__traceback__ and ignores its tb argument when
        # the exception has one, so the exception itself must carry the trimmed one.
        if exc.__traceback__ is tb:
            exc.__traceback__ = trimmed
        self._hook(exc_type, exc, trimmed)

    def __repr__(self) -> str:
        return f"_TrimmingExcepthook({self._hook!r})"


def _trim_printed_traceback() -> None:
    # Installed only now, on the way out, so that a hook the worker set is the one
    # wrapped, and the worker never sees ours while it runs.
    if not isinstance(sys.excepthook, _TrimmingExcepthook):
        sys.excepthook = _TrimmingExcepthook(sys.excepthook)


def _write_error_file(exc: BaseException) -> None:
    """Write ``exc`` to the error file unless there is none or it already exists."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or os.path.exists(path):
        # Unset: nowhere to report. Existing: the worker's own record wrote it first
        # and knows better (e.g. a forwarded child error with its errorCode).
        return
    try:
        from elastrun.core.errorfile import exception_payload, write_error_file

        write_error_file(path, exception_payload(exc))
    except Exception as write_exc:
        # Never let reporting hide the worker's own exception, which follows.
        sys.stderr.write(
            f"elastrun bootstrap: could not write error file {path}: "
            f"{type(write_exc).__name__}: {write_exc}\n"
        )


if __name__ == "__main__":
    main()
