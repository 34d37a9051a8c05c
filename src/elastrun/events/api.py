"""Event types, with torch's names and serialized form.

Differences from torch, on purpose (reference §5.15):

* ``timestamp`` is real: an ``int`` of **milliseconds since the Unix epoch**.
  ``Event(...)`` still defaults it to 0 (torch's signature); 0 means "not set", and
  :func:`elastrun.events.record` stamps such an event with the time it is recorded.
* :class:`RdzvEvent` has a ``timestamp`` too, as its last field (same rule).
* metadata values are plain JSON scalars, never one-element lists or tuples.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TypeVar

__all__ = ["Event", "EventMetadataValue", "EventSource", "NodeState", "RdzvEvent"]

EventMetadataValue = str | int | float | bool | None

E = TypeVar("E", bound=Enum)


class EventSource(str, Enum):
    """Who an event is about: the agent, or one worker process."""

    AGENT = "AGENT"
    WORKER = "WORKER"


class NodeState(str, Enum):
    """State of a node, as reported by rendezvous events."""

    INIT = "INIT"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


def _member(enum: type[E], value: object) -> E:
    """An enum member from its name or value (torch writes names; they are equal here)."""
    if isinstance(value, enum):
        return value
    text = str(value)
    try:
        return enum[text]
    except KeyError:
        return enum(text)


def _load_object(data: str) -> dict[str, object]:
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"an event must be a JSON object, got {type(obj).__name__}")
    return obj


def _as_int(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int | float | str):
        return int(value)
    raise ValueError(f"expected an integer, got {value!r}")


class _Serialized:
    def __str__(self) -> str:
        return self.serialize()

    def serialize(self) -> str:
        """This event as one line of JSON, its fields in their order."""
        return json.dumps(asdict(self), default=str)  # type: ignore[call-overload]  # subclasses are dataclasses


@dataclass
class Event(_Serialized):
    """A lifecycle event of a job.

    Args:
        name: what happened, e.g. ``agent.restart``.
        source: :attr:`EventSource.AGENT` or :attr:`EventSource.WORKER`.
        timestamp: milliseconds since the epoch; 0 until recorded.
        metadata: plain values describing the event.
    """

    name: str
    source: EventSource
    timestamp: int = 0
    metadata: dict[str, EventMetadataValue] = field(default_factory=dict)

    @staticmethod
    def deserialize(data: str | Event) -> Event:
        """Parse :meth:`serialize`'s output; an ``Event`` is returned as it is.

        Raises:
            ValueError: for text that is not an event object (``KeyError`` when the
                ``name`` or ``source`` is missing, as in torch).
        """
        if isinstance(data, Event):
            return data
        obj = _load_object(data)
        metadata = obj.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ValueError(f"event metadata must be an object, got {metadata!r}")
        return Event(
            name=str(obj["name"]),
            source=_member(EventSource, obj["source"]),
            timestamp=_as_int(obj.get("timestamp")),
            metadata=dict(metadata),
        )


@dataclass
class RdzvEvent(_Serialized):
    """A rendezvous event of one node.

    Args:
        name: what happened (torch prefixes the caller's file name).
        run_id: the job's run id.
        message: a human-readable description.
        hostname: the node's host name.
        pid: the agent's process id.
        node_state: the node's state.
        master_endpoint: ``host:port`` of the rendezvous store, when known.
        rank: the node's rank in the round, when known.
        local_id: the node's local id, when known.
        error_trace: the traceback of a ``FAILED`` event.
        timestamp: milliseconds since the epoch; 0 until recorded (elastrun only).
    """

    name: str
    run_id: str
    message: str
    hostname: str
    pid: int
    node_state: NodeState
    master_endpoint: str = ""
    rank: int | None = None
    local_id: int | None = None
    error_trace: str = ""
    timestamp: int = 0

    @staticmethod
    def deserialize(data: str | RdzvEvent) -> RdzvEvent:
        """Parse :meth:`serialize`'s output (also torch's, which has no timestamp).

        Raises:
            ValueError: for text that is not a rendezvous event object (``KeyError`` for
                a missing required field).
        """
        if isinstance(data, RdzvEvent):
            return data
        obj = _load_object(data)
        rank, local_id = obj.get("rank"), obj.get("local_id")
        return RdzvEvent(
            name=str(obj["name"]),
            run_id=str(obj["run_id"]),
            message=str(obj["message"]),
            hostname=str(obj["hostname"]),
            pid=_as_int(obj["pid"]),
            node_state=_member(NodeState, obj["node_state"]),
            master_endpoint=str(obj.get("master_endpoint") or ""),
            rank=None if rank is None else _as_int(rank),
            local_id=None if local_id is None else _as_int(local_id),
            error_trace=str(obj.get("error_trace") or ""),
            timestamp=_as_int(obj.get("timestamp")),
        )

    def metadata(self) -> dict[str, EventMetadataValue]:
        """Everything but the name and timestamp, as plain event metadata."""
        fields = asdict(self)
        del fields["name"], fields["timestamp"]
        return {**fields, "node_state": _member(NodeState, self.node_state).value}
