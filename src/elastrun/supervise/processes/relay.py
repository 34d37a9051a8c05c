"""The output relay: tee'd worker streams to their log files, the console and filter files.

torchrun implements ``--tee`` by letting the worker write to its log file and tailing
that file from a thread per file, polling every 0.1 s. That delays output, costs a
thread per file, and the tail can lose the end of a file when it is stopped early.

Here a tee'd stream goes into a pipe. One relay thread waits on all pipes with a
selector; for each chunk read it writes the raw bytes to the log file (byte-exact), and
each complete line, with the rank's prefix, to the console and, when the line contains
one of the duplicate filters, to the filtered file. :meth:`OutputRelay.close` drains
every pipe until its writers are gone, bounded by a deadline, so nothing written by a
worker that has exited is lost.

Streams that are only redirected go straight to their file (the worker gets the file's
descriptor; the relay is not involved), and streams that are neither are inherited.

Line handling:

* lines end at ``\\n``, ``\\r\\n`` or a lone ``\\r`` (so progress bars that redraw with
  ``\\r`` still show progress, as with torchrun, whose tail reads in universal-newline
  mode); each console line keeps its own terminator;
* bytes are passed through unchanged (no decoding, non-UTF-8 output survives);
* a line longer than 64 KiB is shown in 64 KiB pieces, each with the prefix and a
  newline, so one endless line cannot grow memory without bound; the log file still
  gets the line unchanged;
* a last line without a newline is shown, with a newline added, when its stream ends
  or the relay closes.

Console writes never split a line unless it is longer than ``PIPE_BUF`` (a single
``os.write`` of whole lines, at most ``PIPE_BUF`` bytes), so lines of different ranks,
and of other writers to the same pipe, do not interleave mid-line.

The filtered file of a stream is created (empty) at the first :meth:`OutputRelay.wire`
when filters for that stream are set, as torchrun does, so that it can be watched
before any line matches.

Log files that cannot be written (a full disk, a removed directory) never stop a worker
from starting: a stream whose file cannot be opened, or whose attempt has no log
directory (``LogsDest.problem``), is shown on the console with the rank's prefix
instead, with one warning line; a log file that fails later is dropped while the
console copy goes on. :meth:`OutputRelay.log_problem` tells the failure report why a
rank's log files may be missing or incomplete.
"""

from __future__ import annotations

import logging
import os
import select
import selectors
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from elastrun.core.errors import ElastrunError
from elastrun.core.waker import Waker
from elastrun.supervise.processes.logs import LogsDest, Std, describe_os_error

logger = logging.getLogger(__name__)

_READ_SIZE = 64 * 1024
#: Longest console line; a longer run of bytes without a newline is shown in pieces.
MAX_LINE = 64 * 1024
_ATOMIC_WRITE = select.PIPE_BUF
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
_FILE_MODE = 0o666  # the umask applies, as with open()
#: Extra time granted to the relay thread after the drain deadline to flush and exit.
_JOIN_GRACE = 1.0
#: Longest wait for a non-blocking console to become writable before re-checking.
_WRITABLE_POLL = 1.0
#: Reads per stream (of up to 64 KiB) taken without waiting once the deadline passed.
_FINAL_SWEEP_READS = 16


def _open_log(path: str) -> int:
    return os.open(path, _FILE_FLAGS, _FILE_MODE)


def _close_quietly(fd: int, what: str) -> None:
    try:
        os.close(fd)
    except OSError as exc:
        logger.warning("could not close %s (fd %d): %s", what, fd, exc)


@dataclass(frozen=True)
class WorkerStdio:
    """The descriptors one worker gets for its stdout and stderr.

    ``None`` means "inherit the launcher's". Give them to ``Popen`` as ``stdout=`` and
    ``stderr=`` (or ``dup2`` them in a forked child), then call :meth:`close_in_parent`
    whether or not the start succeeded: the relay sees a stream's end only when every
    copy of the pipe's write end is closed.

    Attributes:
        stdout_fd, stderr_fd: descriptors for the child, created close-on-exec.
        owned_fds: descriptors created for the child that the parent must close.
    """

    stdout_fd: int | None
    stderr_fd: int | None
    owned_fds: list[int] = field(default_factory=list, repr=False, compare=False)

    def close_in_parent(self) -> None:
        """Close the parent's copies of the descriptors made for the child; idempotent."""
        while self.owned_fds:
            _close_quietly(self.owned_fds.pop(), "worker stdio")


class _Sink:
    """A descriptor the relay thread writes to; it stops writing after an error.

    ``path`` and ``local_rank`` are set for a worker's log file, so that a failure to
    write it can be told to the failure report.
    """

    def __init__(
        self, fd: int, name: str, *, owned: bool, path: str = "", local_rank: int | None = None
    ) -> None:
        self.fd = fd
        self.name = name
        self.owned = owned
        self.path = path
        self.local_rank = local_rank
        self.dead = fd < 0

    @classmethod
    def nowhere(cls) -> _Sink:
        """A sink that drops everything: the log of a stream that has no log file."""
        return cls(-1, "no log file", owned=False)

    def close(self) -> None:
        if self.owned and self.fd >= 0:
            _close_quietly(self.fd, self.name)
        self.fd = -1
        self.dead = True

    def __repr__(self) -> str:
        return f"_Sink({self.name!r}, fd={self.fd}, dead={self.dead})"


@dataclass(eq=False)
class _Stream:
    """One tee'd stream of one worker: a pipe's read end and where its bytes go."""

    name: str
    read_fd: int
    log: _Sink
    console: _Sink
    filtered: _Sink | None
    needles: tuple[bytes, ...]
    prefix: bytes
    partial: bytes = b""  # bytes after the last complete line
    broken: bool = False  # after an internal error: read and discard

    def __repr__(self) -> str:
        return f"_Stream({self.name!r}, fd={self.read_fd}, partial={len(self.partial)}B)"


class OutputRelay:
    """Relays tee'd worker output; one instance per start of a worker group.

    Args:
        console_stdout, console_stderr: where tee'd lines are shown (the launcher's
            own stdout and stderr by default); never closed by the relay.
        filtered_stdout, filtered_stderr: files for lines matching the duplicate
            filters (``LogsDest.filtered_*``); ``""`` disables them.
        stdout_filters, stderr_filters: substrings; a tee'd line shown on the console
            that contains any of them is also written to the filtered file.

    The constructor does no I/O; the relay thread starts at the first tee'd stream.
    """

    def __init__(
        self,
        *,
        console_stdout: int = 1,
        console_stderr: int = 2,
        filtered_stdout: str = "",
        filtered_stderr: str = "",
        stdout_filters: Sequence[str] = (),
        stderr_filters: Sequence[str] = (),
    ) -> None:
        self._console = {
            "stdout": _Sink(console_stdout, "console stdout", owned=False),
            "stderr": _Sink(console_stderr, "console stderr", owned=False),
        }
        self._filtered_paths = {"stdout": filtered_stdout, "stderr": filtered_stderr}
        self._needles = {
            "stdout": tuple(n.encode("utf-8", "surrogateescape") for n in stdout_filters if n),
            "stderr": tuple(n.encode("utf-8", "surrogateescape") for n in stderr_filters if n),
        }
        self._filtered: dict[str, _Sink | None] = {}
        self._lock = threading.Lock()
        self._pending: list[_Stream] = []
        self._thread: threading.Thread | None = None
        self._waker: Waker | None = None
        self._close_at: float | None = None  # monotonic; set once by close()
        self._n_streams = 0
        self._problems: dict[int, str] = {}  # local rank -> why its logs are incomplete

    def log_problem(self, local_rank: int) -> str | None:
        """Why ``local_rank``'s log files are missing or incomplete, or None.

        Set when its attempt has no log directory, when one of its log files could not
        be opened (its stream went to the console), or when writing a tee'd stream's
        log file failed; the first problem of a rank is kept.
        """
        with self._lock:
            return self._problems.get(local_rank)

    def _note_problem(self, local_rank: int, problem: str) -> None:
        """Keep the first problem of a rank; the caller holds ``self._lock``."""
        self._problems.setdefault(local_rank, problem)

    # ----------------------------------------------------------------- wiring
    def wire(
        self, local_rank: int, dest: LogsDest, prefix: str, *, show_on_console: bool
    ) -> WorkerStdio:
        """Prepare the stdout and stderr of one worker about to be started.

        Per stream: tee'd and shown on the console -> a pipe read by the relay;
        written to a file (redirected, or tee'd but hidden by the local-ranks filter)
        -> the file itself; otherwise inherited when shown, ``/dev/null`` when hidden.
        A stream meant for a file that cannot be written (``dest.to_console``, or a
        file that cannot be opened) -> a pipe to the console only, shown even for a
        rank hidden by the filter, since the console is then its only copy.

        Args:
            local_rank: the worker's local rank (key into ``dest``).
            dest: the destinations from ``LogsSpecs.reify``.
            prefix: put before each console line of this worker's tee'd streams.
            show_on_console: False for ranks hidden by ``--local-ranks-filter``.

        Raises:
            ElastrunError: the relay is already closed.
            OSError: a pipe could not be made (nothing is left open).
        """
        child_fds: list[int] = []
        new_streams: list[_Stream] = []
        with self._lock:
            if self._close_at is not None:
                raise ElastrunError("the output relay is closed; no more workers can be wired")
            if dest.problem:
                shown = show_on_console or dest.to_console.get(local_rank, Std.NONE)
                where = " (its output went to the agent's console)" if shown else ""
                self._note_problem(local_rank, dest.problem + where)
            try:
                fds = [
                    self._wire_stream(
                        kind=kind,
                        local_rank=local_rank,
                        files=files,
                        tees=tees,
                        prefix=prefix,
                        show_on_console=show_on_console,
                        to_console=bool(dest.to_console.get(local_rank, Std.NONE) & bit),
                        child_fds=child_fds,
                        new_streams=new_streams,
                    )
                    for kind, bit, files, tees in (
                        ("stdout", Std.OUT, dest.stdouts, dest.tee_stdouts),
                        ("stderr", Std.ERR, dest.stderrs, dest.tee_stderrs),
                    )
                ]
                if new_streams and self._thread is None:
                    self._start_thread()
            except BaseException:
                for fd in child_fds:
                    _close_quietly(fd, "worker stdio")
                for stream in new_streams:
                    _close_quietly(stream.read_fd, stream.name)
                    stream.log.close()
                raise
            self._pending.extend(new_streams)
            self._n_streams += len(new_streams)
            if new_streams and self._waker is not None:
                self._waker.wake()
        return WorkerStdio(fds[0], fds[1], child_fds)

    def _wire_stream(
        self,
        *,
        kind: str,
        local_rank: int,
        files: dict[int, str],
        tees: dict[int, str],
        prefix: str,
        show_on_console: bool,
        to_console: bool,
        child_fds: list[int],
        new_streams: list[_Stream],
    ) -> int | None:
        filtered = self._filtered_sink(kind)
        path = files.get(local_rank, "")
        log_fd = -1
        if path:
            try:
                log_fd = _open_log(path)
            except OSError as exc:
                problem = f"cannot write worker logs to {describe_os_error(exc, path)}"
                # One line per attempt: with a full disk, every rank's files fail alike.
                logger.log(
                    logging.DEBUG if self._problems else logging.WARNING,
                    "%s; this attempt's streams whose log file cannot be opened go to the "
                    "agent's console",
                    problem,
                )
                self._note_problem(local_rank, problem)
                to_console = True
        # A tee without a file (torch's /dev/null mode names a tee but no file) shows
        # the stream directly, as torch does.
        if to_console or (path and tees.get(local_rank, "") and show_on_console):
            try:
                read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
            except BaseException:
                if log_fd >= 0:
                    _close_quietly(log_fd, f"log file {path}")
                raise
            child_fds.append(write_fd)
            name = f"local rank {local_rank} {kind}"
            log = (
                _Sink(
                    log_fd,
                    f"{name} log file {path}",
                    owned=True,
                    path=path,
                    local_rank=local_rank,
                )
                if log_fd >= 0
                else _Sink.nowhere()
            )
            try:
                os.set_blocking(read_fd, False)
            except BaseException:
                _close_quietly(read_fd, "relay pipe")
                log.close()
                raise
            new_streams.append(
                _Stream(
                    name=name,
                    read_fd=read_fd,
                    log=log,
                    console=self._console[kind],
                    filtered=filtered,
                    needles=self._needles[kind],
                    prefix=prefix.encode("utf-8", "surrogateescape"),
                )
            )
            return write_fd
        if log_fd >= 0:
            child_fds.append(log_fd)
            return log_fd
        if show_on_console:
            return None
        fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        child_fds.append(fd)
        return fd

    def _filtered_sink(self, kind: str) -> _Sink | None:
        if kind not in self._filtered:
            path = self._filtered_paths[kind]
            sink = None
            if path and self._needles[kind]:
                try:
                    sink = _Sink(_open_log(path), f"filtered {kind} file {path}", owned=True)
                except OSError as exc:
                    # Only a copy of console lines: not worth failing a start for.
                    logger.warning(
                        "cannot write filtered %s to %s; this attempt has no %s copy of "
                        "the matching lines",
                        kind,
                        describe_os_error(exc, path),
                        kind,
                    )
            self._filtered[kind] = sink
        return self._filtered[kind]

    def _start_thread(self) -> None:
        self._waker = Waker()
        self._thread = threading.Thread(target=self._run, name="elastrun-output-relay", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._waker.close()
            self._waker = None
            self._thread = None
            raise

    # ---------------------------------------------------------------- closing
    def close(self, timeout: float = 5.0) -> None:
        """Drain every tee'd stream to its end, then stop the relay; never raises.

        Waits until every pipe's writers are gone (workers, and any children that
        inherited their stdout), but not past ``timeout`` seconds: at the deadline the
        remaining streams are flushed as they are and closed. Idempotent; a later call
        keeps the first deadline.
        """
        try:
            with self._lock:
                if self._close_at is None:
                    self._close_at = time.monotonic() + max(0.0, timeout)
                close_at = self._close_at
                thread = self._thread
                if thread is None:
                    self._close_filtered()
                    return
                if self._waker is not None:
                    self._waker.wake()
            thread.join(max(0.0, close_at - time.monotonic()) + _JOIN_GRACE)
            if thread.is_alive():
                logger.warning(
                    "output relay did not stop in time (blocked writing to the console?); "
                    "leaving it to finish on its own"
                )
        except Exception:
            logger.exception("error while closing the output relay")

    def _close_filtered(self) -> None:
        for sink in self._filtered.values():
            if sink is not None:
                sink.close()

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        waker = self._waker
        if waker is None:  # cannot happen: set before the thread starts
            return
        active: dict[int, _Stream] = {}
        selector = selectors.DefaultSelector()
        try:
            selector.register(waker.fileno(), selectors.EVENT_READ, None)
            self._loop(selector, waker, active)
        except Exception:
            logger.exception("output relay failed; worker output may be incomplete")
        finally:
            with self._lock:
                leftovers, self._pending = self._pending, []
            for stream in [*active.values(), *leftovers]:
                self._finish(stream)
            selector.close()
            with self._lock:
                self._close_filtered()
                waker.close()
                self._waker = None

    def _loop(
        self, selector: selectors.BaseSelector, waker: Waker, active: dict[int, _Stream]
    ) -> None:
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
                close_at = self._close_at
            for stream in pending:
                selector.register(stream.read_fd, selectors.EVENT_READ, stream)
                active[stream.read_fd] = stream
            timeout: float | None = None
            if close_at is not None:
                if not active:
                    return
                timeout = close_at - time.monotonic()
                if timeout <= 0:
                    self._final_sweep(active)
                    if active:
                        logger.warning(
                            "output relay deadline passed with streams still open (a child "
                            "of a worker may hold them): %s",
                            ", ".join(s.name for s in active.values()),
                        )
                    return
            for key, _ in selector.select(timeout):
                stream = key.data
                if stream is None:
                    waker.drain()
                elif not self._pump(stream):
                    selector.unregister(stream.read_fd)
                    del active[stream.read_fd]
                    self._finish(stream)

    def _final_sweep(self, active: dict[int, _Stream]) -> None:
        """At the deadline, take what the pipes already hold (bounded per stream)."""
        for fd, stream in list(active.items()):
            for _ in range(_FINAL_SWEEP_READS):
                try:
                    data = os.read(fd, _READ_SIZE)
                except OSError:  # BlockingIOError: nothing more buffered right now
                    break
                if not data:
                    del active[fd]
                    self._finish(stream)
                    break
                if not stream.broken:
                    self._on_data(stream, data)

    def _pump(self, stream: _Stream) -> bool:
        """Read one chunk of ``stream`` and pass it on; False at the end of the stream."""
        try:
            data = os.read(stream.read_fd, _READ_SIZE)
        except BlockingIOError:
            return True
        except OSError as exc:
            logger.warning("reading %s failed: %s", stream.name, exc)
            return False
        if not data:
            return False
        if not stream.broken:
            try:
                self._on_data(stream, data)
            except Exception:
                # Keep reading (and discarding): a worker must never block on a full pipe.
                logger.exception(
                    "relaying %s failed; its output is dropped from now on", stream.name
                )
                stream.broken = True
        return True

    def _on_data(self, stream: _Stream, data: bytes) -> None:
        self._write(stream.log, data)
        lines = (stream.partial + data).splitlines(keepends=True)
        rest = b""
        # The last piece is incomplete unless it ends with "\n"; a trailing lone "\r"
        # is held too, since a "\n" may follow in the next chunk.
        if lines and not lines[-1].endswith(b"\n"):
            rest = lines.pop()
        while len(rest) > MAX_LINE:
            lines.append(rest[:MAX_LINE] + b"\n")
            rest = rest[MAX_LINE:]
        stream.partial = rest
        if lines:
            self._emit(stream, lines)

    def _emit(self, stream: _Stream, lines: list[bytes]) -> None:
        batch = bytearray()
        matched = bytearray()
        for line in lines:
            out = stream.prefix + line
            if stream.needles and any(needle in line for needle in stream.needles):
                matched += out
            if batch and len(batch) + len(out) > _ATOMIC_WRITE:
                self._write(stream.console, batch)
                batch.clear()
            batch += out
        if batch:
            self._write(stream.console, batch)
        if matched and stream.filtered is not None:
            self._write(stream.filtered, matched)

    def _finish(self, stream: _Stream) -> None:
        """Show the last incomplete line of a stream and close its descriptors."""
        try:
            if stream.partial and not stream.broken:
                last = stream.partial
                if not last.endswith((b"\n", b"\r")):
                    last += b"\n"
                stream.partial = b""
                self._emit(stream, [last])
        except Exception:
            logger.exception("flushing the last line of %s failed", stream.name)
        finally:
            _close_quietly(stream.read_fd, stream.name)
            stream.log.close()

    def _write(self, sink: _Sink, data: bytes | bytearray) -> None:
        if sink.dead:
            return
        view = memoryview(data)
        while view:
            try:
                written = os.write(sink.fd, view)
            except BlockingIOError:
                # Someone made the console non-blocking; wait for room, not past close.
                if not self._wait_writable(sink.fd):
                    logger.warning("%s stayed full until the deadline; output dropped", sink.name)
                    return
                continue
            except OSError as exc:
                sink.dead = True
                logger.warning(
                    "cannot write to %s (%s); its output is dropped from now on", sink.name, exc
                )
                if sink.local_rank is not None:
                    with self._lock:
                        self._note_problem(
                            sink.local_rank,
                            f"cannot write worker logs to {describe_os_error(exc, sink.path)}",
                        )
                return
            view = view[written:]

    def _wait_writable(self, fd: int) -> bool:
        close_at = self._close_at
        timeout = _WRITABLE_POLL if close_at is None else close_at - time.monotonic()
        if timeout <= 0:
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        poller.poll(timeout * 1000.0)
        return True

    def __repr__(self) -> str:
        thread = self._thread
        state = "closing" if self._close_at is not None else "open"
        return (
            f"OutputRelay({state}, streams={self._n_streams}, "
            f"thread={'alive' if thread is not None and thread.is_alive() else 'none'})"
        )
