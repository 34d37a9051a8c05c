"""The store model shared by every implementation.

A store holds byte values under string keys, each write bumping a global revision.
``compare_set`` is the one primitive rendezvous needs for consistency; leases and
watches (DESIGN.md section 3) are part of the model and are provided by the networked
implementations.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

#: ``compare_set`` expectation meaning "the key must not exist".
ABSENT: None = None


@runtime_checkable
class Store(Protocol):
    """A key-value store. Every blocking method takes a timeout in seconds."""

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it does not exist."""
        ...

    def set(self, key: str, value: bytes) -> int:
        """Write ``value``; returns the new revision."""
        ...

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to an integer counter (absent = 0); returns the new value."""
        ...

    def compare_set(
        self, key: str, expected: bytes | None, value: bytes
    ) -> tuple[bool, bytes | None]:
        """Write ``value`` if the current value equals ``expected`` (None: key absent).

        Returns ``(swapped, current_value_after_the_call)``.
        """
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; returns whether it existed."""
        ...

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key starting with ``prefix`` and its value."""
        ...

    def wait(self, keys: list[str], timeout: float) -> None:
        """Block until every key exists; raises ``StoreTimeoutError`` after ``timeout``."""
        ...

    def close(self) -> None: ...
