"""The error file: how a failed worker tells its agent what went wrong.

A worker that dies of an uncaught exception writes a small JSON document to the path in
``TORCHELASTIC_ERROR_FILE``; the agent reads it to build its failure report. The layout
is the one torch's ``record`` writes, so files cross freely between torch and elastrun::

    {"message": {"message": "ValueError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

Readers also accept the flat layout ``{"message": "<text>", "timestamp": <int or str>}``.
An agent that copies a root cause into its own error file adds ``message["errorCode"]``.

This module is imported by the worker bootstrap, so it keeps its own import cost low:
``json`` and ``traceback`` are imported by the functions that need them.
"""

from __future__ import annotations

import math
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass

# A worker could write an arbitrarily large file (a huge exception message); the agent
# must not run out of memory reading it. Real error files are a few kilobytes.
MAX_ERROR_FILE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ErrorFileContents:
    """A successfully parsed error file.

    Attributes:
        message: the failure in one line, e.g. ``"ValueError: boom"``.
        traceback: the Python traceback the worker recorded, if any.
        timestamp: when the worker recorded the failure (epoch seconds), if known.
        error_code: the ``errorCode`` an agent added when copying a child's file, if any.
        raw: the whole JSON document as read.
    """

    message: str
    traceback: str | None
    timestamp: float | None
    error_code: int | None
    raw: Mapping[str, object]


@dataclass(frozen=True)
class ErrorFileProblem:
    """Why an error file could not be used.

    Attributes:
        path: the path that was read.
        reason: a sentence for the failure report, e.g. ``"error file is empty"``.
        missing: True when there simply is no file (the worker wrote none); callers
            usually treat that as "no error file" rather than as a problem.
    """

    path: str
    reason: str
    missing: bool = False


def exception_payload(exc: BaseException, *, now: float | None = None) -> dict[str, object]:
    """Build the error-file document for ``exc`` in torch's layout.

    The traceback is formatted from ``exc.__traceback__`` (inside an ``except`` block
    this is what ``traceback.format_exc()`` would give).

    Args:
        exc: the exception to describe.
        now: the timestamp to record (epoch seconds); defaults to ``time.time()``.
    """
    import traceback

    stamp = time.time() if now is None else now
    callstack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(stamp))},
        }
    }


def write_error_file(path: str, payload: Mapping[str, object]) -> None:
    """Write ``payload`` as JSON to ``path`` atomically, replacing any existing file.

    The document is written to a temporary file in the same directory, flushed to disk
    and renamed over ``path``, so a reader never sees a half-written file even if the
    writer is killed. Missing parent directories are created.

    Raises:
        OSError: the file could not be written.
        TypeError: ``payload`` holds values that JSON cannot represent.
    """
    import json

    text = json.dumps(payload)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # A unique name in the same directory (rename is only atomic within a file
    # system); O_EXCL so two writers never share a temporary file. Not tempfile:
    # it would cost this module's cheap import, and mkstemp's 0600 mode is wrong
    # for a file that other tools read. The umask applies as for any new file.
    tmp_path = os.path.join(
        directory, f".{os.path.basename(path)}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    )
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        try:
            os.unlink(tmp_path)
        except FileNotFoundError:
            pass
        raise


def read_error_file(path: str) -> ErrorFileContents | ErrorFileProblem:
    """Read and validate the error file at ``path``; never raises.

    Both layouts are accepted (nested torch ``record`` layout and flat
    ``{"message": str, "timestamp": ...}``); timestamps may be numbers or numeric
    strings. Anything that prevents reading the failure message -- no file, an
    unreadable, empty, truncated or oversized file, invalid JSON, JSON of the wrong
    shape -- is returned as an :class:`ErrorFileProblem` whose ``reason`` says which.
    A malformed timestamp or traceback is tolerated (reported as ``None``), because the
    message is still worth showing.
    """
    if not path:
        return ErrorFileProblem(path, "no error file path was given", missing=True)
    try:
        # Non-blocking and checked to be a regular file: a worker that left a FIFO (or
        # a device) at its error-file path must not hang the agent's report.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return ErrorFileProblem(path, "error file path is not a regular file")
            data = f.read(MAX_ERROR_FILE_BYTES + 1)
    except FileNotFoundError:
        return ErrorFileProblem(path, "no error file was written", missing=True)
    except IsADirectoryError:
        return ErrorFileProblem(path, "error file path is a directory")
    except OSError as exc:
        return ErrorFileProblem(path, f"error file could not be read: {exc}")
    if len(data) > MAX_ERROR_FILE_BYTES:
        return ErrorFileProblem(
            path, f"error file is larger than {MAX_ERROR_FILE_BYTES} bytes; not read"
        )
    if not data.strip():
        return ErrorFileProblem(path, "error file is empty")
    return _parse(path, data)


def _parse(path: str, data: bytes) -> ErrorFileContents | ErrorFileProblem:
    import json

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return ErrorFileProblem(path, f"error file is not valid UTF-8 text: {exc}")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        return ErrorFileProblem(path, f"error file is not valid JSON (truncated?): {exc}")
    except RecursionError:
        return ErrorFileProblem(path, "error file is not valid JSON: nested too deeply")
    if not isinstance(doc, dict):
        return ErrorFileProblem(
            path, f"error file holds a JSON {type(doc).__name__}, not an object"
        )
    if "message" not in doc:
        return ErrorFileProblem(path, "error file has no 'message' field")
    message = doc["message"]
    if isinstance(message, str):
        # Flat layout: {"message": "...", "timestamp": n}.
        return ErrorFileContents(
            message=message,
            traceback=None,
            timestamp=_as_timestamp(doc.get("timestamp")),
            error_code=None,
            raw=doc,
        )
    if isinstance(message, dict):
        text_msg = message.get("message")
        if not isinstance(text_msg, str):
            return ErrorFileProblem(
                path, "error file's 'message' object has no string 'message' field"
            )
        extra = message.get("extraInfo")
        extra = extra if isinstance(extra, dict) else {}
        callstack = extra.get("py_callstack")
        code = message.get("errorCode")
        return ErrorFileContents(
            message=text_msg,
            traceback=callstack if isinstance(callstack, str) and callstack else None,
            timestamp=_as_timestamp(extra.get("timestamp")),
            error_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
            raw=doc,
        )
    return ErrorFileProblem(
        path,
        f"error file's 'message' is a JSON {type(message).__name__}, "
        "expected a string or an object",
    )


def _as_timestamp(value: object) -> float | None:
    """An epoch timestamp from an int, float or numeric string; None otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        result = float(value)  # (float() strips the spaces around a number itself)
    except ValueError:
        return None
    # NaN and infinities cannot be shown as a time; negative stamps are nonsense.
    return result if math.isfinite(result) and result >= 0 else None


def copy_with_error_code(src: ErrorFileContents, dest_path: str, error_code: int) -> None:
    """Write ``src`` to ``dest_path`` with ``message["errorCode"] = error_code``.

    This is how an agent, itself run under another elastic launcher, passes its root
    cause upwards: a worker killed by a signal cannot record its own exit code, so the
    agent adds it. As torch does, the code is only added to the nested layout and only
    when it is non-zero; a flat-layout file is copied unchanged. Any existing file at
    ``dest_path`` is replaced atomically.

    Raises:
        OSError: ``dest_path`` could not be written.
    """
    import copy

    doc: dict[str, object] = copy.deepcopy(dict(src.raw))
    message = doc.get("message")
    if error_code and isinstance(message, dict):
        message["errorCode"] = error_code
    write_error_file(dest_path, doc)
