"""One tee'd stream of one worker, and how its bytes are cut into console lines.

Pure functions of bytes (no I/O): :func:`split_lines` keeps the incomplete tail of a
chunk for the next one and cuts endless lines into :data:`MAX_LINE` pieces;
:func:`render` prefixes lines and batches them into writes of at most ``PIPE_BUF``
bytes, so lines of different ranks never interleave mid-line.
"""

from __future__ import annotations

import select
from collections.abc import Sequence
from dataclasses import dataclass

from elastrun.supervise.processes.relay.sinks import Sink

__all__ = ["MAX_LINE", "Stream", "last_line", "render", "split_lines"]

#: Longest console line; a longer run of bytes without a newline is shown in pieces.
MAX_LINE = 64 * 1024
_ATOMIC_WRITE = select.PIPE_BUF


@dataclass(eq=False)
class Stream:
    """One tee'd stream of one worker: a pipe's read end and where its bytes go."""

    name: str
    read_fd: int
    log: Sink
    console: Sink
    filtered: Sink | None
    needles: tuple[bytes, ...]
    prefix: bytes
    partial: bytes = b""  # bytes after the last complete line
    broken: bool = False  # after an internal error: read and discard

    def __repr__(self) -> str:
        return f"Stream({self.name!r}, fd={self.read_fd}, partial={len(self.partial)}B)"


def split_lines(partial: bytes, data: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of ``partial + data`` (each with its terminator) and the rest.

    The last piece is incomplete unless it ends with ``\\n``; a trailing lone ``\\r`` is
    held too, since a ``\\n`` may follow in the next chunk. A rest longer than
    :data:`MAX_LINE` is cut into pieces, each given a newline.
    """
    lines = (partial + data).splitlines(keepends=True)
    rest = b""
    if lines and not lines[-1].endswith(b"\n"):
        rest = lines.pop()
    while len(rest) > MAX_LINE:
        lines.append(rest[:MAX_LINE] + b"\n")
        rest = rest[MAX_LINE:]
    return lines, rest


def last_line(partial: bytes) -> bytes:
    """The unfinished last line of an ended stream, with a newline added if it has none."""
    return partial if partial.endswith((b"\n", b"\r")) else partial + b"\n"


def render(
    prefix: bytes, lines: Sequence[bytes], needles: Sequence[bytes]
) -> tuple[list[bytes], bytes]:
    """Console writes for ``lines`` (prefixed, whole lines, at most ``PIPE_BUF`` bytes each
    unless one line is longer) and the prefixed lines containing one of ``needles``."""
    batches: list[bytes] = []
    batch = bytearray()
    matched = bytearray()
    for line in lines:
        out = prefix + line
        if needles and any(needle in line for needle in needles):
            matched += out
        if batch and len(batch) + len(out) > _ATOMIC_WRITE:
            batches.append(bytes(batch))
            batch.clear()
        batch += out
    if batch:
        batches.append(bytes(batch))
    return batches, bytes(matched)
