"""A self-pipe that wakes a selector loop from signal handlers and other threads."""

from __future__ import annotations

import os
import signal


class Waker:
    """Wake a thread blocked in ``select`` on :meth:`fileno`.

    ``wake()`` is async-signal-safe and thread-safe: it writes one byte to a
    non-blocking pipe and ignores a full pipe (one pending byte is enough to wake).
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closed = False

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        if self._closed:
            return  # its descriptor number may belong to another file by now
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):
            pass  # full (already woken) or closed during shutdown: nothing to add

    def drain(self) -> bytes:
        """Consume pending wake-ups; returns their bytes (the numbers of the signals
        received, when the pipe is the interpreter's wake-up descriptor)."""
        got = b""
        try:
            while chunk := os.read(self._r, 4096):
                got += chunk
        except (BlockingIOError, OSError):
            pass
        return got

    def install_as_signal_wakeup(self) -> int:
        """Make signal delivery wake this pipe; returns the previous wakeup fd."""
        return signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._r)
            os.close(self._w)

    def __repr__(self) -> str:
        return f"Waker(r={self._r}, w={self._w}, closed={self._closed})"
