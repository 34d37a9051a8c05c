"""What the joining protocol (``joining``) yields, and how a driver runs it.

The protocol is a generator: it yields operations (a driver performs each and sends back
its result) and notes (a driver shows each and sends back None), and returns its
outcome. ``advance`` is every driver's one step; ``drive`` runs a protocol to its end
with a blocking ``perform`` (the threaded handler), while the benchmarks' asyncio
participant awaits each operation instead. ``joining`` re-exports these names: its
readers and drivers speak of ``joining.Get``. The records the protocol reads and writes
are JSON with sorted keys (``dump``, ``load``), as the handler's other records are.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

# -- values (a record on the store is JSON, keys sorted) ------------------------------------


def dump(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def load(raw: bytes | None) -> object:
    """A record as read (None: no record)."""
    return None if raw is None else json.loads(raw)


def load_doc(raw: bytes | None) -> dict[str, object]:
    """A record that should be a JSON object ({}: absent, unreadable or not one)."""
    try:
        data = load(raw)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


# -- operations (the driver performs them) ------------------------------------------------


@dataclass(frozen=True)
class Get:
    key: str  # -> bytes | None


@dataclass(frozen=True)
class GetPrefix:
    prefix: str  # -> (dict[str, bytes], revision)


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    leased: bool = False  # bound to the node's lease -> revision


@dataclass(frozen=True)
class PutAll:
    """Several unleased ``Put``s in no particular order: a driver may send them at once
    instead of one round trip after another (the closer's member pages)."""

    items: tuple[tuple[str, bytes], ...]  # -> None


@dataclass(frozen=True)
class ReadAll:
    """Several reads (``Get``, ``GetPrefix``) in no particular order: a driver may send
    them at once instead of one round trip after another (the closer's view, read while
    thousands of survivors' requests queue before each of its round trips)."""

    reads: tuple[Get | GetPrefix, ...]  # -> [each read's result, in order]


@dataclass(frozen=True)
class CompareSet:
    key: str
    expected: bytes | None
    value: bytes
    leased: bool = False  # -> (won, current)


@dataclass(frozen=True)
class Watch:
    prefix: str
    after: int
    timeout: float  # -> WatchResult; may raise StoreCompactedError


@dataclass(frozen=True)
class Wait:
    keys: tuple[str, ...]
    timeout: float  # -> None


# -- notes (the driver shows them, and sends back None) -------------------------------------


@dataclass(frozen=True)
class Progress:
    """How round ``n`` is going: the closer's status dict (None: nothing known yet)."""

    n: int
    status: dict[str, Any] | None


@dataclass(frozen=True)
class Closed:
    """This node closed round ``n`` with ``size`` members."""

    n: int
    size: int


@dataclass(frozen=True)
class Seen:
    """As the closer of round ``n``: how many nodes have joined it so far."""

    n: int
    joined: int


Op = Get | GetPrefix | ReadAll | Put | PutAll | CompareSet | Watch | Wait | Progress | Closed | Seen
Protocol = Generator[Op, Any, Any]


# -- the synchronous driver -------------------------------------------------------------------


@dataclass(frozen=True)
class Finished:
    """The protocol ended with ``value``."""

    value: Any


def advance(protocol: Protocol, value: Any, error: BaseException | None) -> Op | Finished:
    """Hand the protocol the last operation's result (or its exception); returns the
    next operation, or ``Finished``. Every driver's one step, blocking or not."""
    try:
        return protocol.throw(error) if error is not None else protocol.send(value)
    except StopIteration as stop:
        return Finished(stop.value)


def drive(protocol: Protocol, perform: Callable[[Op], Any]) -> Any:
    """Run ``protocol`` to its end, performing each operation with ``perform`` (which
    may raise: the exception is thrown into the protocol at that point)."""
    value: Any = None
    error: BaseException | None = None
    while not isinstance(op := advance(protocol, value, error), Finished):
        try:
            value, error = perform(op), None
        except Exception as exc:  # handed to the protocol, which re-raises what it cannot use
            value, error = None, exc
    return op.value
