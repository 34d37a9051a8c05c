"""Event sinks that write events somewhere a person can read them.

Every event becomes one JSON object::

    {"name": "agent.restart", "source": "AGENT", "timestamp": 1718000000123,
     "metadata": {"attempt": 0, "rank": 1, "exitcode": 3}}

``timestamp`` is an integer: **milliseconds since the Unix epoch** (wall clock). Torch
declares the field as ``int`` but never fills it in (it stays 0); we keep the type and
give it a real value with millisecond resolution, which is what a timeline needs.
Metadata values are plain JSON scalars (``str | int | float | bool | None``).

``--event-log-handler`` chooses the sink (:func:`make_event_sink`):

* ``null`` -- discard events (the default); ``dynamic_rendezvous`` is accepted as a
  synonym because torchrun accepts that name too (it is a null handler there);
* ``console`` -- one JSON line per event on stderr, as torchrun's console handler does;
* ``file:PATH`` -- append one JSON line per event to PATH (:class:`JsonLinesEventSink`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Protocol, TextIO, TypedDict, Unpack

from elastrun.core.clock import SYSTEM_CLOCK, Clock
from elastrun.core.errors import ConfigError
from elastrun.observe.sinks import EventValue, NullEventSink

log = logging.getLogger(__name__)

FILE_PREFIX = "file:"
DEFAULT_SOURCE = "AGENT"


class EventLog(Protocol):
    """An event sink that also takes fully specified events.

    ``record`` is the agent's :class:`~elastrun.observe.sinks.EventSink` method: the sink
    stamps the event with its own source and the current time. ``record_event`` is for
    callers that already know both (the torch-compatible ``elastrun.events.record``).
    """

    def record(self, name: str, metadata: dict[str, EventValue]) -> None: ...

    def record_event(
        self, name: str, source: str, timestamp: int, metadata: Mapping[str, EventValue]
    ) -> None: ...


def now_ms(clock: Clock = SYSTEM_CLOCK) -> int:
    """The wall-clock time in whole milliseconds since the epoch (an event timestamp)."""
    return round(clock.time() * 1000)


def append_line(path: str, line: str) -> None:
    """Append ``line`` to ``path`` with a single ``write(2)`` on an ``O_APPEND`` descriptor.

    Why one write on O_APPEND: several agents (one per node on a shared file system, or
    several on one host) may log to the same file. The kernel positions every O_APPEND
    write at the end of the file atomically, and a single write of a short line is not
    interleaved with another writer's on a local file system, so lines stay whole. A
    buffered file object could split a line over two writes. The file is opened per
    line: events are rare (a few per restart), and this keeps no descriptor open
    between events and follows a rotated file.

    Raises ``OSError`` when the file cannot be opened or written.
    """
    view = memoryview(line.encode("utf-8"))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        while view:
            # Only a full disk or a signal cuts a regular-file write short; finish it.
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


class SinkOptions(TypedDict, total=False):
    """What a sink that writes events takes besides where: the ``source`` of events given
    to ``record``, ``context`` (metadata added to every event, e.g. run id, hostname,
    agent pid) and the ``clock`` that gives the timestamps."""

    source: str
    context: Mapping[str, EventValue] | None
    clock: Clock


class _StampingSink:
    """Shared part of the sinks: the default source, constant context and the clock."""

    def __init__(
        self,
        *,
        source: str = DEFAULT_SOURCE,
        context: Mapping[str, EventValue] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._source = source
        self._context: dict[str, EventValue] = dict(context or {})
        self._clock = clock

    def record(self, name: str, metadata: dict[str, EventValue]) -> None:
        """Record an event from this sink's source, stamped with the current time."""
        self.record_event(name, self._source, now_ms(self._clock), metadata)

    def record_event(
        self, name: str, source: str, timestamp: int, metadata: Mapping[str, EventValue]
    ) -> None:
        """Record a fully specified event (``timestamp`` in ms since the epoch)."""
        merged = {**self._context, **metadata}  # the event's own values win
        obj = {"name": name, "source": source, "timestamp": timestamp, "metadata": merged}
        # A value JSON cannot hold is written as its str(): an event log must never be
        # the reason a job dies.
        self._write(json.dumps(obj, default=str) + "\n")

    def _write(self, line: str) -> None:
        raise NotImplementedError


class NullEventLog(NullEventSink):
    """Discards every event (``--event-log-handler null``)."""

    def record_event(
        self, name: str, source: str, timestamp: int, metadata: Mapping[str, EventValue]
    ) -> None:
        pass


class ConsoleEventSink(_StampingSink):
    """Writes each event as one JSON line to a text stream (stderr by default).

    Args:
        stream: where to write; ``None`` means ``sys.stderr`` as it is at each event.
        options: see :class:`SinkOptions`.
    """

    def __init__(self, stream: TextIO | None = None, **options: Unpack[SinkOptions]) -> None:
        super().__init__(**options)
        self._stream = stream

    def _write(self, line: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        stream.write(line)
        stream.flush()

    def __repr__(self) -> str:
        return f"ConsoleEventSink(stream={self._stream!r}, source={self._source!r})"


class JsonLinesEventSink(_StampingSink):
    """Appends each event as one JSON line to a file; safe with concurrent writers.

    The file and its missing parent directories are created at the first event (the
    constructor does no I/O; call :meth:`probe` to check the path up front). A failed
    write is logged once as a warning and later events are still tried: losing the event
    log must not kill a training job.

    Args:
        path: the file to append to.
        options: see :class:`SinkOptions`.
    """

    def __init__(self, path: str | os.PathLike[str], **options: Unpack[SinkOptions]) -> None:
        super().__init__(**options)
        self.path = os.fspath(path)
        self.written = 0
        self.failed = 0

    def probe(self, field: str = "--event-log-handler") -> None:
        """Create the file (and its directory) now, so a bad path fails at startup.

        Raises:
            ConfigError: naming ``field`` when the file cannot be opened for appending.
        """
        try:
            self._ensure_dir()
            append_line(self.path, "")
        except OSError as exc:
            raise ConfigError(
                field, FILE_PREFIX + self.path, f"cannot append to the event log: {exc.strerror}"
            ) from exc

    def _ensure_dir(self) -> None:
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)

    def _write(self, line: str) -> None:
        try:
            if self.written == 0:
                self._ensure_dir()
            append_line(self.path, line)
        except OSError as exc:
            self.failed += 1
            if self.failed == 1:
                log.warning("cannot write the event log %s: %s (events are lost)", self.path, exc)
            return
        self.written += 1

    def __repr__(self) -> str:
        return (
            f"JsonLinesEventSink(path={self.path!r}, written={self.written}, failed={self.failed})"
        )


def make_event_sink(
    spec: str,
    *,
    field: str = "--event-log-handler",
    context: Mapping[str, EventValue] | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> EventLog:
    """Build the sink that ``--event-log-handler SPEC`` names; does no I/O.

    Args:
        spec: ``null``, ``console``, ``file:PATH`` (or torch's ``dynamic_rendezvous``,
            a synonym of ``null``).
        field: the option named in errors.
        context: metadata added to every event the sink writes.
        clock: gives the timestamps.

    Raises:
        ConfigError: for any other spec, or ``file:`` with an empty path.
    """
    if spec in ("null", "dynamic_rendezvous"):
        return NullEventLog()
    if spec == "console":
        return ConsoleEventSink(context=context, clock=clock)
    if spec.startswith(FILE_PREFIX):
        path = spec[len(FILE_PREFIX) :]
        if not path:
            raise ConfigError(field, spec, "file: needs a path, as in file:/tmp/events.jsonl")
        return JsonLinesEventSink(path, context=context, clock=clock)
    raise ConfigError(field, spec, "expected null, console or file:PATH")
