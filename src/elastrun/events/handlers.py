"""Event destinations: what ``record(event, destination)`` writes to.

A destination is one of the ``--event-log-handler`` values: ``null``, ``console``,
``file:PATH``, or torch's ``dynamic_rendezvous`` (where rendezvous events go; null).
Torch fails with a bare ``KeyError`` at the first event for an unknown name; here the
error is :class:`UnknownEventDestinationError`, raised when the destination is first
used, naming the value and the accepted forms. It is a ``ConfigError`` (so a
``ValueError``) and also a ``KeyError``, so torch-era ``except KeyError`` still works.
"""

from __future__ import annotations

import logging
import threading

from elastrun.core.errors import ConfigError
from elastrun.observe.eventlog import (
    FILE_PREFIX,
    ConsoleEventSink,
    EventLog,
    NullEventLog,
    append_line,
    make_event_sink,
)

__all__ = ["JsonLinesLogHandler", "UnknownEventDestinationError", "get_logging_handler"]

_FIELD = "destination"


class UnknownEventDestinationError(ConfigError, KeyError):
    """An event destination that is not ``null``, ``console`` or ``file:PATH``."""

    # KeyError's own __str__ would print the repr of the message in quotes.
    __str__ = ConfigError.__str__


class JsonLinesLogHandler(logging.Handler):
    """A logging handler that appends each formatted record as one line to a file.

    Each line is written with a single append (see
    ``elastrun.observe.eventlog.append_line``), so processes sharing the file do not
    interleave lines.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            append_line(self.path, self.format(record) + "\n")
        except OSError:
            self.handleError(record)

    def __repr__(self) -> str:
        return f"JsonLinesLogHandler(path={self.path!r})"


_lock = threading.Lock()
_sinks: dict[str, EventLog] = {}
_handlers: dict[str, logging.Handler] = {}


def get_event_sink(destination: str = "null") -> EventLog:
    """The sink that events recorded to ``destination`` go to (one per destination).

    Raises:
        UnknownEventDestinationError: for a destination that is not accepted.
    """
    with _lock:
        sink = _sinks.get(destination)
        if sink is None:
            try:
                sink = make_event_sink(destination, field=_FIELD)
            except ConfigError as exc:
                raise UnknownEventDestinationError(_FIELD, destination, exc.reason) from None
            _sinks[destination] = sink
        return sink


def is_null_destination(destination: str) -> bool:
    """Whether events sent to ``destination`` are discarded."""
    return isinstance(get_event_sink(destination), NullEventLog)


def get_logging_handler(destination: str = "null") -> logging.Handler:
    """The ``logging.Handler`` of a destination (torch's API; one per destination).

    ``console`` is a ``StreamHandler`` on stderr, ``null`` and ``dynamic_rendezvous``
    are ``NullHandler`` objects, ``file:PATH`` is a :class:`JsonLinesLogHandler`.

    Raises:
        UnknownEventDestinationError: for a destination that is not accepted.
    """
    sink = get_event_sink(destination)  # validates the name
    with _lock:
        handler = _handlers.get(destination)
        if handler is None:
            if isinstance(sink, ConsoleEventSink):
                handler = logging.StreamHandler()
            elif destination.startswith(FILE_PREFIX):
                handler = JsonLinesLogHandler(destination[len(FILE_PREFIX) :])
            else:
                handler = logging.NullHandler()
            _handlers[destination] = handler
        return handler
