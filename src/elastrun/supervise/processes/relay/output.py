"""The relay itself: wire each worker's streams, then one thread pumps every pipe.

See :mod:`elastrun.supervise.processes.relay` for what it does and why.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections.abc import Sequence

from elastrun.core.cancel import CancelScope
from elastrun.core.errors import ElastrunError
from elastrun.core.threads import Nursery
from elastrun.core.waker import Waker
from elastrun.supervise.processes.logs import LogsDest, Std, describe_os_error
from elastrun.supervise.processes.relay.console import FD_CONSOLE, Console
from elastrun.supervise.processes.relay.sinks import (
    FdSink,
    Sink,
    WorkerStdio,
    close_quietly,
    logger,
    open_log,
)
from elastrun.supervise.processes.relay.stream import Stream, last_line, render, split_lines

__all__ = ["OutputRelay"]

_READ_SIZE = 64 * 1024
#: Extra time granted to the relay thread after the drain deadline to flush and exit.
_JOIN_GRACE = 1.0
#: Reads per stream (of up to 64 KiB) taken without waiting once the deadline passed.
_FINAL_SWEEP_READS = 16


class OutputRelay:
    """Relays tee'd worker output; one instance per start of a worker group.

    Args:
        console: where tee'd lines are shown (the process's descriptors 1 and 2 by
            default; ``PYTHON_CONSOLE``: ``sys.stdout`` and ``sys.stderr`` as they are
            now); never closed by the relay.
        filtered_stdout, filtered_stderr: files for lines matching the duplicate
            filters (``LogsDest.filtered_*``); ``""`` disables them.
        stdout_filters, stderr_filters: substrings; a tee'd line shown on the console
            that contains any of them is also written to the filtered file.

    The constructor does no I/O; the relay thread starts at the first tee'd stream.
    """

    def __init__(
        self,
        *,
        console: Console = FD_CONSOLE,
        filtered_stdout: str = "",
        filtered_stderr: str = "",
        stdout_filters: Sequence[str] = (),
        stderr_filters: Sequence[str] = (),
    ) -> None:
        stdout_sink, stderr_sink = console.sinks()
        self._console = {"stdout": stdout_sink, "stderr": stderr_sink}
        self._filtered_paths = {"stdout": filtered_stdout, "stderr": filtered_stderr}
        self._needles = {
            kind: tuple(n.encode("utf-8", "surrogateescape") for n in filters if n)
            for kind, filters in (("stdout", stdout_filters), ("stderr", stderr_filters))
        }
        self._filtered: dict[str, Sink | None] = {}
        self._lock = threading.Lock()
        self._pending: list[Stream] = []
        # The relay thread's. Its close is no stop: the thread drains every stream until
        # it ends or close()'s deadline passes, then ends by itself (it leaves the scope
        # aside), so closing the nursery is only its join, bounded by that deadline.
        self._nursery = Nursery()
        self._started = False
        # Wakes the thread for new streams, and at close() for its deadline.
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

    # ----------------------------------------------------------------- wiring
    def wire(
        self,
        local_rank: int,
        dest: LogsDest,
        prefix: str,
        *,
        show_on_console: bool,
        append: bool = False,
    ) -> WorkerStdio:
        """Prepare the stdout and stderr of one worker about to be started.

        What each stream gets: tee'd and shown on the console -> a pipe read by the
        relay; written to a file (redirected, or tee'd but hidden by the local-ranks
        filter) -> the file itself; otherwise inherited when shown, ``/dev/null`` when
        hidden. A stream meant for a file that cannot be written (``dest.to_console``,
        or a file that cannot be opened) -> a pipe to the console only, shown even for
        a rank hidden by the filter, since the console is then its only copy.

        Args:
            local_rank: the worker's local rank (key into ``dest``).
            dest: the destinations from ``LogsSpecs.reify``.
            prefix: put before each console line of this worker's tee'd streams.
            show_on_console: False for ranks hidden by ``--local-ranks-filter``.
            append: add to the rank's log files instead of starting them anew (a worker
                replaced in place: its predecessor's output stays above).

        Raises:
            ElastrunError: the relay is already closed.
            OSError: a pipe could not be made (nothing is left open).
        """
        with self._lock:
            if self._close_at is not None:
                raise ElastrunError("the output relay is closed; no more workers can be wired")
            if dest.problem:
                shown = show_on_console or dest.to_console.get(local_rank, Std.NONE)
                where = " (its output went to the agent's console)" if shown else ""
                self._problems.setdefault(local_rank, dest.problem + where)
            fds, child_fds, new_streams = self._wire_streams(
                local_rank, dest, prefix, show_on_console, append
            )
            self._pending.extend(new_streams)
            self._n_streams += len(new_streams)
            if new_streams and self._waker is not None:
                self._waker.wake()
        return WorkerStdio(fds[0], fds[1], child_fds)

    def _wire_streams(
        self, local_rank: int, dest: LogsDest, prefix: str, shown: bool, append: bool
    ) -> tuple[list[int | None], list[int], list[Stream]]:
        """For :meth:`wire`, all or none: the worker's stdout and stderr descriptors
        (None: inherit), those the parent must close, and the relay's new streams."""
        fds: list[int | None] = []
        child_fds: list[int] = []
        new_streams: list[Stream] = []
        to_console = dest.to_console.get(local_rank, Std.NONE)
        try:
            for kind, bit, files, tees in dest.streams():
                filtered = self._filtered_sink(kind)
                path = files.get(local_rank, "")
                log_fd = self._open_rank_log(path, local_rank, append) if path else -1
                # A tee without a file (torch's /dev/null mode names a tee but no file)
                # shows the stream directly, as torch does.
                tee = shown and bool(tees.get(local_rank, ""))
                fd: int | None = None
                if to_console & bit or (path and (log_fd < 0 or tee)):
                    stream, fd = self._pipe_stream(kind, local_rank, path, log_fd, prefix, filtered)
                    new_streams.append(stream)
                elif log_fd >= 0:
                    fd = log_fd
                elif not shown:
                    fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                if fd is not None:
                    child_fds.append(fd)
                fds.append(fd)
            if new_streams and not self._started:
                self._start_thread()
        except BaseException:
            for fd in child_fds:
                close_quietly(fd, "worker stdio")
            for stream in new_streams:
                self._finish(stream)  # (nothing read yet: it only closes)
            raise
        return fds, child_fds, new_streams

    def _open_rank_log(self, path: str, local_rank: int, append: bool) -> int:
        """A rank's log file, opened; -1 (and the problem noted) when it cannot be."""
        try:
            return open_log(path, append=append)
        except OSError as exc:
            problem = f"cannot write worker logs to {describe_os_error(exc, path)}"
            # One line per attempt: with a full disk, every rank's files fail alike.
            logger.log(
                logging.DEBUG if self._problems else logging.WARNING,
                "%s; this attempt's streams whose log file cannot be opened go to the "
                "agent's console",
                problem,
            )
            self._problems.setdefault(local_rank, problem)
            return -1

    def _pipe_stream(
        self, kind: str, local_rank: int, path: str, log_fd: int, prefix: str, filtered: Sink | None
    ) -> tuple[Stream, int]:
        """A pipe the relay reads (to the log file, if any, and the console); returns
        the stream and the pipe's write end for the worker. Closes ``log_fd`` if it
        fails."""
        name = f"local rank {local_rank} {kind}"
        try:
            read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        except BaseException:
            if log_fd >= 0:
                close_quietly(log_fd, f"log file {path}")
            raise
        # Without a log file (log_fd -1) the sink is dead from the start: it drops everything.
        log = FdSink(
            log_fd, f"{name} log file {path}", owned=True, path=path, local_rank=local_rank
        )
        try:
            os.set_blocking(read_fd, False)
        except BaseException:
            close_quietly(read_fd, "relay pipe")
            close_quietly(write_fd, "relay pipe")
            log.close()
            raise
        stream = Stream(
            name=name,
            read_fd=read_fd,
            log=log,
            console=self._console[kind],
            filtered=filtered,
            needles=self._needles[kind],
            prefix=prefix.encode("utf-8", "surrogateescape"),
        )
        return stream, write_fd

    def _filtered_sink(self, kind: str) -> Sink | None:
        if kind not in self._filtered:
            path = self._filtered_paths[kind]
            sink = None
            if path and self._needles[kind]:
                try:
                    sink = FdSink(open_log(path), f"filtered {kind} file {path}", owned=True)
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
        try:
            self._nursery.start(self._run, name="elastrun-output-relay")
        except BaseException:
            self._waker.close()
            self._waker = None
            raise
        self._started = True

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
                if not self._started:
                    self._close_filtered()
                    return
                if self._waker is not None:
                    self._waker.wake()
            # A thread still running after it is left to finish on its own (blocked
            # writing to the console?); the nursery says so.
            self._nursery.close("closed", max(0.0, close_at - time.monotonic()) + _JOIN_GRACE)
        except Exception:
            logger.exception("error while closing the output relay")

    def _close_filtered(self) -> None:
        for sink in self._filtered.values():
            if sink is not None:
                sink.close()

    # ------------------------------------------------------------ the thread
    def _run(self, _scope: CancelScope) -> None:  # (it ends by itself: see __init__)
        waker = self._waker
        if waker is None:  # cannot happen: set before the thread starts
            return
        active: dict[int, Stream] = {}
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
        self, selector: selectors.BaseSelector, waker: Waker, active: dict[int, Stream]
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

    def _final_sweep(self, active: dict[int, Stream]) -> None:
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

    def _pump(self, stream: Stream) -> bool:
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

    def _on_data(self, stream: Stream, data: bytes) -> None:
        self._write(stream.log, data)
        lines, stream.partial = split_lines(stream.partial, data)
        if lines:
            self._emit(stream, lines)

    def _emit(self, stream: Stream, lines: list[bytes]) -> None:
        batches, matched = render(stream.prefix, lines, stream.needles)
        for batch in batches:
            self._write(stream.console, batch)
        if matched and stream.filtered is not None:
            self._write(stream.filtered, matched)

    def _finish(self, stream: Stream) -> None:
        """Show the last incomplete line of a stream and close its descriptors."""
        try:
            if stream.partial and not stream.broken:
                last = last_line(stream.partial)
                stream.partial = b""
                self._emit(stream, [last])
        except Exception:
            logger.exception("flushing the last line of %s failed", stream.name)
        finally:
            close_quietly(stream.read_fd, stream.name)
            stream.log.close()

    def _write(self, sink: Sink, data: bytes | bytearray) -> None:
        exc = sink.write(data, lambda: self._close_at)
        if exc is not None and sink.local_rank is not None:
            with self._lock:
                self._problems.setdefault(
                    sink.local_rank,
                    f"cannot write worker logs to {describe_os_error(exc, sink.path)}",
                )

    def __repr__(self) -> str:
        state = "closing" if self._close_at is not None else "open"
        return (
            f"OutputRelay({state}, streams={self._n_streams}, "
            f"thread={'alive' if self._nursery.running() else 'none'})"
        )
