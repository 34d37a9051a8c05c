"""Where the agent's lifecycle events and metrics go (injected, never global)."""

from __future__ import annotations

import logging
from typing import Protocol

EventValue = str | int | float | bool | None


class EventSink(Protocol):
    """Receives lifecycle events: a name and plain metadata."""

    def record(self, name: str, metadata: dict[str, EventValue]) -> None: ...


class MetricSink(Protocol):
    """Receives metric values."""

    def put(self, name: str, value: float) -> None: ...


class NullEventSink:
    def record(self, name: str, metadata: dict[str, EventValue]) -> None:
        pass

    def __repr__(self) -> str:
        return "NullEventSink()"


class NullMetricSink:
    def put(self, name: str, value: float) -> None:
        pass

    def __repr__(self) -> str:
        return "NullMetricSink()"


class LoggingEventSink:
    """Writes each event as one DEBUG log line (for troubleshooting)."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._log = logger or logging.getLogger("elastrun.events")

    def record(self, name: str, metadata: dict[str, EventValue]) -> None:
        self._log.debug("event %s %s", name, metadata)


class MemoryEventSink:
    """Keeps events in a list (tests)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, EventValue]]] = []

    def record(self, name: str, metadata: dict[str, EventValue]) -> None:
        self.events.append((name, dict(metadata)))

    def names(self) -> list[str]:
        return [n for n, _ in self.events]
