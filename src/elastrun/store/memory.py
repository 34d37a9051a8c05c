"""An in-process store: for a single node and for unit tests."""

from __future__ import annotations

import threading

from elastrun.core.clock import Deadline
from elastrun.core.errors import StoreError, StoreTimeoutError


class MemoryStore:
    """A thread-safe store living in this process (implements ``Store``)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._revision = 0
        self._cond = threading.Condition()

    def _bump(self) -> int:
        self._revision += 1
        self._cond.notify_all()
        return self._revision

    def get(self, key: str) -> bytes | None:
        with self._cond:
            return self._data.get(key)

    def set(self, key: str, value: bytes) -> int:
        with self._cond:
            self._data[key] = bytes(value)
            return self._bump()

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            raw = self._data.get(key, b"0")
            try:
                current = int(raw)
            except ValueError:
                raise StoreError(f"add: value of {key!r} is not an integer: {raw!r}") from None
            current += amount
            self._data[key] = str(current).encode()
            self._bump()
            return current

    def compare_set(
        self, key: str, expected: bytes | None, value: bytes
    ) -> tuple[bool, bytes | None]:
        with self._cond:
            current = self._data.get(key)
            if current != expected:
                return False, current
            self._data[key] = bytes(value)
            self._bump()
            return True, self._data[key]

    def delete(self, key: str) -> bool:
        with self._cond:
            existed = self._data.pop(key, None) is not None
            if existed:
                self._bump()
            return existed

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        with self._cond:
            return {k: v for k, v in self._data.items() if k.startswith(prefix)}

    def wait(self, keys: list[str], timeout: float) -> None:
        deadline = Deadline.after(timeout)
        with self._cond:
            while not all(k in self._data for k in keys):
                if deadline.expired():
                    missing = [k for k in keys if k not in self._data]
                    raise StoreTimeoutError(f"timed out after {timeout}s waiting for {missing}")
                self._cond.wait(deadline.timeout())

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"MemoryStore(keys={len(self._data)}, revision={self._revision})"
