"""``record``: report a worker's exception to its agent through the error file.

Decorate a worker's entry point with :func:`record` and an uncaught exception is written
to the file named by ``TORCHELASTIC_ERROR_FILE`` (in torch's format) before it
propagates, so the agent's failure report shows the traceback. It is a drop-in for
``torch.distributed.elastic.multiprocessing.errors.record``: a file written here is read
by torchrun, and a file written by torch's ``record`` is read by elastrun.

Workers started by elastrun through its bootstrap report uncaught exceptions even without
``record``; the decorator remains useful under torchrun, and for agents nested under
another elastic launcher (it forwards a child's root-cause error file upwards).
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
from collections.abc import Callable
from typing import ParamSpec, TypeVar, overload

from elastrun.core.errorfile import (
    ErrorFileProblem,
    copy_with_error_code,
    exception_payload,
    read_error_file,
    write_error_file,
)
from elastrun.wire.env import ERROR_FILE_ENV

__all__ = ["ErrorHandler", "get_error_handler", "record"]

_log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")

# torch's ProcessFailure uses this marker for "no error file".
_NOT_AVAILABLE = "<N/A>"


class ErrorHandler:
    """Writes exceptions to the error file named by ``TORCHELASTIC_ERROR_FILE``.

    Subclass it to change where or how errors are recorded, and pass an instance to
    :func:`record`. ``_get_error_file_path`` is the override point for the path (the
    same name as in torch, so existing subclasses keep working).

    When the variable is unset or empty, nothing is written: the exception still
    propagates and Python prints it to stderr as usual.
    """

    def _get_error_file_path(self) -> str | None:
        """The error file path, or None when this process has none."""
        return os.environ.get(ERROR_FILE_ENV) or None

    def initialize(self) -> None:
        """Prepare to capture failures: dump all threads' stacks on a native crash.

        Enables :mod:`faulthandler` for all threads unless it is already enabled (so a
        handler installed by the user, e.g. to another file, is left alone). Failure to
        enable it is logged, not raised.
        """
        if faulthandler.is_enabled():
            return
        try:
            faulthandler.enable(all_threads=True)
        except (RuntimeError, ValueError, OSError, AttributeError) as exc:
            # No usable stderr (e.g. sys.stderr is None or has no file descriptor).
            _log.warning("could not enable faulthandler: %s: %s", type(exc).__name__, exc)

    def record_exception(self, e: BaseException) -> None:
        """Write ``e`` and its traceback to the error file, if this process has one.

        A failure to write is logged, never raised: it must not hide ``e`` itself.
        """
        path = self._get_error_file_path()
        if not path:
            return
        try:
            write_error_file(path, exception_payload(e))
        except (OSError, TypeError, ValueError) as exc:
            _log.warning("could not write error file %s: %s", path, exc)

    def dump_error_file(self, rootcause_error_file: str, error_code: int = 0) -> None:
        """Copy a child's error file to this process's own, adding ``errorCode``.

        Used when this process launched the failed child (an agent under another agent).
        ``error_code`` (the child's exit code) is stored as ``message.errorCode`` when
        non-zero and the file has the nested layout. An unreadable child file or a
        failure to write is logged, never raised.
        """
        contents = read_error_file(rootcause_error_file)
        if isinstance(contents, ErrorFileProblem):
            _log.warning("cannot forward child error file %s: %s", contents.path, contents.reason)
            return
        path = self._get_error_file_path()
        if not path:
            _log.info(
                "%s is not set; child error file %s not forwarded",
                ERROR_FILE_ENV,
                rootcause_error_file,
            )
            return
        try:
            copy_with_error_code(contents, path, error_code)
        except OSError as exc:
            _log.warning("could not write error file %s: %s", path, exc)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(error_file={self._get_error_file_path()!r})"


def get_error_handler() -> ErrorHandler:
    """A new default :class:`ErrorHandler`."""
    return ErrorHandler()


@overload
def record(
    fn: Callable[_P, _R], error_handler: ErrorHandler | None = None
) -> Callable[_P, _R | None]: ...


@overload
def record(
    fn: None = None, error_handler: ErrorHandler | None = None
) -> Callable[[Callable[_P, _R]], Callable[_P, _R | None]]: ...


def record(
    fn: Callable[_P, _R] | None = None, error_handler: ErrorHandler | None = None
) -> Callable[_P, _R | None] | Callable[[Callable[_P, _R]], Callable[_P, _R | None]]:
    """Record an exception escaping ``fn`` in the error file, then re-raise it.

    Usable as ``@record``, ``@record()`` or ``@record(error_handler=h)``. Behaviour (the
    same as torch's ``record``):

    * ``SystemExit`` with code 0 makes the wrapper return None; any other
      ``SystemExit`` propagates and nothing is written (an exit code is not an error
      report).
    * An exception with a ``get_first_failure()`` method (elastrun's or torch's
      ``ChildFailedError``): the root-cause child's error file is copied to this
      process's error file with ``errorCode`` set to the child's exit code. If the child
      left no error file, the ``ChildFailedError`` itself (whose text is the failure
      report) is recorded instead.
    * Any other ``Exception`` is recorded with its traceback.
    * ``KeyboardInterrupt`` and other non-``Exception`` errors are not recorded.

    In every case the exception propagates. Nothing is written when
    ``TORCHELASTIC_ERROR_FILE`` is unset.

    Args:
        fn: the function to wrap (normally ``main``).
        error_handler: the handler to use; a new :class:`ErrorHandler` by default.
    """
    handler = error_handler if error_handler is not None else get_error_handler()

    def decorate(f: Callable[_P, _R]) -> Callable[_P, _R | None]:
        @functools.wraps(f)
        def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
            handler.initialize()
            try:
                return f(*args, **kwargs)
            except SystemExit as exc:
                if exc.code == 0:
                    return None
                raise
            except Exception as exc:
                if not forward_child_failure(handler, exc):
                    handler.record_exception(exc)
                raise

        return wrapper

    return decorate if fn is None else decorate(fn)


def forward_child_failure(handler: ErrorHandler, exc: Exception) -> bool:
    """Forward the root cause of a ChildFailedError-like ``exc``; False if not one.

    Used by :func:`record` and by ``elastrun.control_plane``'s ``worker_main``: when a
    launcher inside a worker fails because one of its own children failed, the child's
    error file (when it wrote one) becomes this process's error file as it is, so the
    report names the real root cause. Returns False (nothing written) when ``exc`` is
    not such a failure or its error file is missing or unreadable.

    Duck-typed so that torch's ChildFailedError works too without importing torch.
    """
    get_first_failure = getattr(exc, "get_first_failure", None)
    if not callable(get_first_failure):
        return False
    try:
        rank, failure = get_first_failure()
    except Exception as lookup_exc:
        _log.warning("cannot find the root cause of %r: %s", exc, lookup_exc)
        return False
    error_file = getattr(failure, "error_file", "")
    exitcode = getattr(failure, "exitcode", 0)
    if not isinstance(error_file, str) or error_file in ("", _NOT_AVAILABLE):
        _log.info("rank %s failed without an error file; recording the report instead", rank)
        return False
    problem = read_error_file(error_file)
    if isinstance(problem, ErrorFileProblem):
        _log.info("rank %s: %s; recording the report instead", rank, problem.reason)
        return False
    handler.dump_error_file(error_file, exitcode if isinstance(exitcode, int) else 0)
    return True
