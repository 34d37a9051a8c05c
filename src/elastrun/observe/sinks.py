"""Where the agent's lifecycle events and metrics go (injected, never global)."""

from __future__ import annotations

from typing import Protocol

EventValue = str | int | float | bool | None


class EventSink(Protocol):
    """Receives lifecycle events: a name and plain metadata."""

    def record(self, name: str, metadata: dict[str, EventValue]) -> None: ...


class MetricSink(Protocol):
    """Receives metric values.

    A metric of one worker (or node) carries its labels in its name:
    ``worker.steps{rank=3,local_rank=1}`` (:func:`labelled`). Sinks that know labels
    (Prometheus) split them off (:func:`split_labels`); the others keep the name whole.
    """

    def put(self, name: str, value: float) -> None: ...


def labelled(name: str, **labels: str | int) -> str:
    """``name{key=value,...}``: a metric name with labels, in the order given."""
    return name + "{" + ",".join(f"{key}={value}" for key, value in labels.items()) + "}"


def split_labels(name: str) -> tuple[str, dict[str, str]]:
    """The base name and the labels of a :func:`labelled` name (no labels: ``{}``)."""
    base, brace, rest = name.partition("{")
    if not brace or not rest.endswith("}"):
        return name, {}
    labels = {}
    for part in rest[:-1].split(","):
        key, eq, value = part.partition("=")
        if not eq or not key:
            return name, {}
        labels[key] = value
    return base, labels


class NullEventSink:
    def record(self, name: str, metadata: dict[str, EventValue]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NullMetricSink:
    def put(self, name: str, value: float) -> None:
        pass

    def __repr__(self) -> str:
        return "NullMetricSink()"


class MemoryEventSink:
    """Keeps events in a list (tests)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, EventValue]]] = []

    def record(self, name: str, metadata: dict[str, EventValue]) -> None:
        self.events.append((name, dict(metadata)))

    def names(self) -> list[str]:
        return [n for n, _ in self.events]
