"""Events, compatible with ``torch.distributed.elastic.events``.

Record an :class:`Event` to a destination (``null``, ``console`` or ``file:PATH``)::

    from elastrun import events

    events.record(
        events.Event("trainer.checkpoint", events.EventSource.WORKER, metadata={"step": 100}),
        destination="file:/tmp/events.jsonl",
    )

Every destination writes one JSON object per event: ``name``, ``source``,
``timestamp`` (int, milliseconds since the epoch; filled in at recording time when the
event has none) and ``metadata`` (plain values). The launcher writes its own lifecycle
events in the same form (``--event-log-handler``); ``elastrun timeline FILE`` draws
them. An unknown destination raises :class:`UnknownEventDestinationError`.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

from elastrun.events.api import Event, EventMetadataValue, EventSource, NodeState, RdzvEvent
from elastrun.events.handlers import (
    JsonLinesLogHandler,
    UnknownEventDestinationError,
    get_event_sink,
    get_logging_handler,
    is_null_destination,
)
from elastrun.observe.eventlog import now_ms

__all__ = [
    "Event",
    "EventMetadataValue",
    "EventSource",
    "JsonLinesLogHandler",
    "NodeState",
    "RdzvEvent",
    "UnknownEventDestinationError",
    "construct_and_record_rdzv_event",
    "get_logging_handler",
    "record",
    "record_rdzv_event",
]

RDZV_DESTINATION = "dynamic_rendezvous"


def record(event: Event, destination: str = "null") -> None:
    """Write ``event`` to ``destination``; an unset (0) timestamp becomes now.

    The event object itself is not changed.

    Raises:
        UnknownEventDestinationError: for a destination that is not accepted.
    """
    sink = get_event_sink(destination)
    timestamp = event.timestamp or now_ms()
    source = EventSource(event.source).value
    sink.record_event(event.name, source, timestamp, dict(event.metadata))


def record_rdzv_event(event: RdzvEvent, destination: str = RDZV_DESTINATION) -> None:
    """Write a rendezvous event (source ``AGENT``; its fields become the metadata).

    The default destination, ``dynamic_rendezvous``, discards events, as in torch.

    Raises:
        UnknownEventDestinationError: for a destination that is not accepted.
    """
    record(Event(event.name, EventSource.AGENT, event.timestamp, event.metadata()), destination)


def construct_and_record_rdzv_event(
    run_id: str,
    message: str,
    node_state: NodeState,
    name: str = "",
    hostname: str = "",
    pid: int | None = None,
    master_endpoint: str = "",
    local_id: int | None = None,
    rank: int | None = None,
    *,
    destination: str = RDZV_DESTINATION,
) -> None:
    """Build a :class:`RdzvEvent` about this process and record it.

    Does nothing (and costs nothing) when ``destination`` discards events. Otherwise
    the hostname and pid default to this machine and process, the name becomes
    ``<caller's file name>:<name or caller's function>``, and a ``FAILED`` event
    carries the traceback of the exception being handled.

    Raises:
        UnknownEventDestinationError: for a destination that is not accepted.
    """
    if is_null_destination(destination):
        return
    caller = sys._getframe(1)
    # format_exc() outside an except block gives "NoneType: None"; say nothing instead.
    trace = node_state == NodeState.FAILED and sys.exc_info()[0] is not None
    filename = os.path.basename(caller.f_code.co_filename)
    event = RdzvEvent(
        name=f"{filename}:{name or caller.f_code.co_name}",
        run_id=run_id,
        message=message,
        hostname=hostname or socket.getfqdn(),
        pid=pid if pid is not None else os.getpid(),
        node_state=node_state,
        master_endpoint=master_endpoint,
        rank=rank,
        local_id=local_id,
        error_trace=traceback.format_exc() if trace else "",
    )
    record_rdzv_event(event, destination)
