"""The progress file: the workers' records, in shared memory, and its header.

The agent creates the file (``elastrun.pace.ProgressBoard``) and names it
to each worker in :data:`PROGRESS_FILE_ENV`, with the worker's record in
:data:`PROGRESS_SLOT_ENV`; the worker (:mod:`elastrun.pace.worker.report`) maps it and
writes its record on every report; the agent reads every record. This module is what
both ends agree on: the layout, the check word, the variables.

**The header** (:data:`HEADER_WORDS` signed 64-bit words, little-endian, as the host
stores them)::

    MAGIC  VERSION  SLOTS  SLOT_WORDS  (reserved)...

**Version.** :data:`VERSION` is the header's second word. A worker refuses a file of
another magic, version or record size (:func:`header_problem`): it runs on without
reports and says why on its stderr, once; the agent made the file, so it reads only its
own version.

**The record** (:data:`SLOT_WORDS` signed 64-bit words, one cache line; the file starts
with a header of the same size)::

    SEQ  PID  STEP  REPORTS  LAST_NS  STEP_NS  LONGEST_NS  CHECK

``LAST_NS`` is ``CLOCK_MONOTONIC`` in nanoseconds (the agent is on the same host, and its
monotonic clock is that clock), ``STEP_NS`` an exponentially weighted moving average of
the time per step (weight 1/8 for the newest interval, divided by the steps it covers),
``LONGEST_NS`` the longest interval between two reports seen. A reader must never see a
half-written record: the writer makes ``SEQ`` odd, writes the fields and ``CHECK``, then
makes ``SEQ`` even (a sequence lock); a reader accepts a copy whose ``SEQ`` is even and
unchanged around the copy and whose ``CHECK`` matches (:func:`record_check`). The
sequence lock alone suffices where stores are seen in order (x86); the check word also
catches the reordering a weaker memory model (arm64) may show to a reader without
barriers, which Python cannot issue.
"""

from __future__ import annotations

from collections.abc import Sequence

from elastrun.core.errors import ElastrunError
from elastrun.wire.env import PROGRESS_FILE_ENV, PROGRESS_SLOT_ENV

__all__ = [
    "HEADER_WORDS",
    "MAGIC",
    "MAX_STEP",
    "PROGRESS_FILE_ENV",
    "PROGRESS_SLOT_ENV",
    "SLOT_WORDS",
    "VERSION",
    "ProgressFileError",
    "file_size",
    "header_problem",
    "header_words",
    "record_check",
    "slot_offset",
]


#: ``b"ELPROGR1"`` as a little-endian signed word: the file's first word.
MAGIC = int.from_bytes(b"ELPROGR1", "little", signed=True)
VERSION = 1
WORD = 8
SLOT_WORDS = 8
HEADER_WORDS = SLOT_WORDS  # magic, version, slots, slot words, then reserved
# Record words.
SEQ, PID, STEP, REPORTS, LAST_NS, STEP_NS, LONGEST_NS, CHECK = range(SLOT_WORDS)
#: The largest step a record holds.
MAX_STEP = (1 << 63) - 1

_CHECK_MASK = (1 << 63) - 1


def record_check(
    seq: int, pid: int, step: int, reports: int, last_ns: int, step_ns: int, longest_ns: int
) -> int:
    """The ``CHECK`` word of a record with these fields (non-negative, below 2**63).

    A sum of the fields times odd 64-bit constants (from splitmix64 and murmur3): a copy
    mixing two versions of a record matches only if ``sum(k_i * delta_i) == 0`` modulo
    2**63 over the words it took from the other version, which no realistic pair of
    versions satisfies (and a single changed word never does). Written out, literals
    inline: it runs on every report.
    """
    return (
        seq * 0x9E3779B97F4A7C15
        + pid * 0xBF58476D1CE4E5B9
        + step * 0x94D049BB133111EB
        + reports * 0xFF51AFD7ED558CCD
        + last_ns * 0xC4CEB9FE1A85EC53
        + step_ns * 0x2545F4914F6CDD1D
        + longest_ns * 0xD6E8FEB86659FD93
    ) & _CHECK_MASK


def slot_offset(slot: int) -> int:
    """The index of ``slot``'s first word (the file as an array of words)."""
    return HEADER_WORDS + slot * SLOT_WORDS


def file_size(slots: int) -> int:
    """The size in bytes of a progress file with ``slots`` records."""
    return (HEADER_WORDS + slots * SLOT_WORDS) * WORD


def header_words(slots: int) -> list[int]:
    """The header of a progress file with ``slots`` records."""
    return [MAGIC, VERSION, slots, SLOT_WORDS] + [0] * (HEADER_WORDS - 4)


class ProgressFileError(ElastrunError):
    """The progress file cannot be used: missing, too small, or of another layout."""


def header_problem(header: Sequence[int], size: int, slot: int) -> str | None:
    """What keeps a writer from record ``slot`` of a file of ``size`` bytes whose first
    four words are ``header`` (None: nothing).

    The answer completes a sentence whose subject is the file: "is a version 2
    progress file, not version 1", "has no record 3 (2 records, 192 bytes)".
    """
    magic, version, slots, slot_words = header
    if magic != MAGIC:
        return "is not a progress file"
    if version != VERSION or slot_words != SLOT_WORDS:
        return f"is a version {version} progress file, not version {VERSION}"
    if size < file_size(slots) or not 0 <= slot < slots:
        return f"has no record {slot} ({slots} records, {size} bytes)"
    return None
