"""Where the relay shows tee'd lines: the process's descriptors, or Python's streams.

The ``elastrun`` command owns its process's stdout and stderr, so it writes console
lines straight to descriptors 1 and 2 (:class:`FdConsole`): no encoding round trip, and
nothing can be left in a Python buffer when the process ends. Its entry point makes
that choice (``launch.entry``), not the launcher's ``main()``.

A user who runs workers from their own Python process (``elastic_launch``,
``start_processes``, ``LocalElasticAgent``, or the launcher's ``main()`` as torch's
tests call ``torch.distributed.run.main``) expects them where ``print`` goes:
``contextlib.redirect_stdout``, pytest's capsys and notebook cells replace
``sys.stdout``, not descriptor 1. torch's tee writes to ``sys.stdout``/``sys.stderr``
too. :class:`PythonConsole` does that.

When the streams are looked up: once per relay (each start of a worker group), when
its sinks are made -- as torch does when it makes its process context -- not at each
write. The relay writes from its own thread, and ``sys.stdout`` is a global that other
code keeps swapping (a redirect in another thread, the next test's capture, the next
notebook cell); looked up per write, a run's late lines would land in whichever of
those is current. Looked up once, the lines of one start all go where ``sys.stdout``
pointed when it began, even when the caller's redirect ends before the relay drained.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Protocol, TextIO

from elastrun.supervise.processes.relay.sinks import CloseAt, FdSink, Sink, logger

__all__ = ["FD_CONSOLE", "PYTHON_CONSOLE", "Console", "FdConsole", "PythonConsole", "TextSink"]

#: Held around each write-and-flush of every text sink. One lock for all, not one per
#: stream: relays of concurrent contexts may share a stream (both writing to the same
#: redirected ``sys.stdout``), a per-stream table would need keys that outlive the
#: streams, and the writes are short, so sharing one costs nothing worth having.
_TEXT_WRITE_LOCK = threading.Lock()


class Console(Protocol):
    """Makes the console sinks of one relay."""

    def sinks(self) -> tuple[Sink, Sink]:
        """Fresh stdout and stderr sinks for one relay (each relay's die alone)."""


@dataclass(frozen=True)
class FdConsole:
    """Console lines go to descriptors (the process's own 1 and 2 by default); the
    relay never closes them."""

    stdout: int = 1
    stderr: int = 2

    def sinks(self) -> tuple[Sink, Sink]:
        return (
            FdSink(self.stdout, "console stdout", owned=False),
            FdSink(self.stderr, "console stderr", owned=False),
        )


@dataclass(frozen=True)
class PythonConsole:
    """Console lines go to ``sys.stdout`` and ``sys.stderr`` as they are when a relay's
    sinks are made (see the module docstring for why then)."""

    def sinks(self) -> tuple[Sink, Sink]:
        return _text_or_nowhere(sys.stdout, "stdout"), _text_or_nowhere(sys.stderr, "stderr")


#: The ``elastrun`` command's console.
FD_CONSOLE = FdConsole()
#: The Python API's console.
PYTHON_CONSOLE = PythonConsole()


def _text_or_nowhere(stream: TextIO | None, kind: str) -> Sink:
    # sys.stdout is None when Python has no console (pythonw, a closed descriptor 1):
    # print() then does nothing, and neither do we. Falling back to descriptor 1 could
    # write into whatever file or socket now holds that number.
    if stream is None:
        return FdSink(-1, f"console {kind} (sys.{kind} is None)", owned=False)
    return TextSink(stream, f"console {kind} ({kind} of this Python process)")


class TextSink:
    """A Python text stream the relay thread writes to; never closed by the relay.

    Bytes are decoded as UTF-8, invalid bytes replaced (torch's tee reads the log files
    with ``errors="replace"`` too), so non-UTF-8 output is not byte-exact here, unlike
    on a descriptor. Each write is one ``write`` of whole lines followed by ``flush``,
    under one lock shared by all text sinks: concurrent relays never interleave parts of
    lines, lines show as they come (a notebook, pytest's capfd below capsys), and none
    is left in the stream's buffer when the run ends. A write cannot be bounded by the
    relay's deadline (a text stream has no "wait until writable"); ``OutputRelay.close``
    stops waiting for a relay thread blocked in one.
    """

    def __init__(self, stream: TextIO, name: str) -> None:
        self.stream = stream
        self.name = name
        self.path = ""
        self.local_rank: int | None = None
        self.dead = False

    def write(self, data: bytes | bytearray, close_at: CloseAt) -> OSError | None:
        """Write ``data`` as text and flush; see :class:`~.sinks.Sink`."""
        del close_at  # see the class docstring
        if self.dead:
            return None
        text = bytes(data).decode("utf-8", "replace")
        try:
            with _TEXT_WRITE_LOCK:
                self.stream.write(text)
                self.stream.flush()
        except Exception as exc:  # a user's stream may raise anything: it must not kill the relay
            self.dead = True
            logger.warning(
                "cannot write to %s (%s: %s); its output is dropped from now on",
                self.name,
                type(exc).__name__,
                exc,
            )
            return exc if isinstance(exc, OSError) else None
        return None

    def close(self) -> None:
        """Take no more output; the stream is the user's and stays open."""
        self.dead = True

    def __repr__(self) -> str:
        return f"TextSink({self.name!r}, stream={self.stream!r}, dead={self.dead})"
