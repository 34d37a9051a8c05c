"""The agent's end of the progress records: one shared file for a node's workers.

The file holds two records per local rank. A worker writes the one its variables name;
:meth:`ProgressBoard.reset` (a worker is replaced) moves the rank to its other record
and clears it. So a replaced worker that is somehow still running -- unkillable in the
kernel, not yet reaped -- writes into a record nobody reads, and never shares one with
its successor (two writers would defeat the sequence lock). The layout and the
protocol are :mod:`elastrun.wire.progress`'s.

Reading a snapshot copies each record (a few microseconds per worker) and keeps the
last consistent copy, which is what a snapshot shows for a record caught in the middle
of a write again and again (its writer stopped half-way, say).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterable, Mapping

from elastrun.core.errors import ConfigError, ElastrunError
from elastrun.pace.agent.record import ProgressRecord, Snapshot
from elastrun.wire.progress import (
    CHECK,
    LAST_NS,
    LONGEST_NS,
    PID,
    PROGRESS_FILE_ENV,
    PROGRESS_SLOT_ENV,
    REPORTS,
    SEQ,
    SLOT_WORDS,
    STEP,
    STEP_NS,
    file_size,
    header_words,
    record_check,
    slot_offset,
)

__all__ = ["FILE_NAME", "ProgressBoard", "read_record", "steps_of"]

#: The file's name in the directory given to :meth:`ProgressBoard.create`.
FILE_NAME = "progress"
# A copy is retried this often while its record is being written; a write takes about
# a microsecond, so only a writer stopped half-way exhausts this.
_READ_ATTEMPTS = 64
_NS = 1e-9


def read_record(words: memoryview, slot: int) -> ProgressRecord | None:
    """A consistent copy of record ``slot`` (None: never written, or no consistent copy).

    ``words`` is the file as signed 64-bit words.
    """
    base = slot_offset(slot)
    for _ in range(_READ_ATTEMPTS):
        seq = words[base + SEQ]
        if seq & 1:
            continue  # a write is under way
        copy = words[base : base + SLOT_WORDS].tolist()
        if words[base + SEQ] != seq or copy[SEQ] != seq:
            continue
        if copy[CHECK] != record_check(seq, *copy[PID:CHECK]):
            continue  # torn: some words from before the write, some from after
        if copy[REPORTS] <= 0:
            return None
        return ProgressRecord(
            step=copy[STEP],
            last_report=copy[LAST_NS] * _NS,
            step_time=copy[STEP_NS] * _NS if copy[REPORTS] > 1 else None,
            longest=copy[LONGEST_NS] * _NS if copy[REPORTS] > 1 else None,
            reports=copy[REPORTS],
            pid=copy[PID],
        )
    return None


class ProgressBoard:
    """The progress records of one node's workers, in a file the workers map.

    Made by :meth:`create`; give each worker :meth:`worker_env`, read
    :meth:`snapshot` as often as needed, :meth:`reset` a rank before its worker is
    replaced, :meth:`close` at the end (also a context manager).
    """

    def __init__(self, path: str, local_world_size: int, mapping: mmap.mmap) -> None:
        """Wrap an open mapping; use :meth:`create`, which makes the file."""
        self.path = path
        self.local_world_size = local_world_size
        self._map: mmap.mmap | None = mapping
        self._words = memoryview(mapping).cast("q")
        self._generation = [0] * local_world_size  # which of its two records a rank uses
        self._last_good: dict[int, ProgressRecord] = {}

    @classmethod
    def create(cls, directory: str | os.PathLike[str], local_world_size: int) -> ProgressBoard:
        """Create the file ``directory/progress`` for ``local_world_size`` workers.

        Raises:
            ConfigError: ``local_world_size`` is not a positive integer.
            ElastrunError: the file cannot be created (it exists, the directory does
                not, no space).
        """
        if isinstance(local_world_size, bool) or local_world_size < 1:
            raise ConfigError("local_world_size", local_world_size, "must be at least 1")
        path = os.path.join(os.fspath(directory), FILE_NAME)
        slots = 2 * local_world_size
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ElastrunError(f"cannot create the progress file {path}: {exc}") from exc
        try:
            os.ftruncate(fd, file_size(slots))  # zeros: every record unwritten
            mapping = mmap.mmap(fd, file_size(slots))
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise ElastrunError(f"cannot create the progress file {path}: {exc}") from exc
        os.close(fd)
        board = cls(path, local_world_size, mapping)
        for i, word in enumerate(header_words(slots)):
            board._words[i] = word
        return board

    def _slot(self, local_rank: int) -> int:
        if not 0 <= local_rank < self.local_world_size:
            raise ConfigError(
                "local_rank", local_rank, f"must be from 0 to {self.local_world_size - 1}"
            )
        return 2 * local_rank + self._generation[local_rank]

    def worker_env(self, local_rank: int) -> dict[str, str]:
        """The variables that make the worker of ``local_rank`` report into its record."""
        return {PROGRESS_FILE_ENV: self.path, PROGRESS_SLOT_ENV: str(self._slot(local_rank))}

    def snapshot(self, local_ranks: Iterable[int] | None = None) -> Snapshot:
        """The records of the workers (default: all) that have reported at least once."""
        words = self._live_words()
        ranks = range(self.local_world_size) if local_ranks is None else local_ranks
        out: Snapshot = {}
        for rank in ranks:
            record = read_record(words, self._slot(rank))
            if record is None:
                record = self._last_good.get(rank)
            else:
                self._last_good[rank] = record
            if record is not None:
                out[rank] = record
        return out

    def reset(self, local_rank: int) -> None:
        """Start ``local_rank`` afresh (its worker is being replaced): a new, empty record.

        Call it before building the new worker's environment (:meth:`worker_env`).
        """
        words = self._live_words()
        self._generation[local_rank] ^= 1
        base = slot_offset(self._slot(local_rank))
        for i in range(SLOT_WORDS):
            words[base + i] = 0  # seq 0 (even), check 0: a consistent, unwritten record
        self._last_good.pop(local_rank, None)

    def reset_all(self) -> None:
        """:meth:`reset` every rank (the whole group is restarted)."""
        for rank in range(self.local_world_size):
            self.reset(rank)

    def _live_words(self) -> memoryview:
        if self._map is None:
            raise ElastrunError(f"the progress board {self.path} is closed")
        return self._words

    def close(self) -> None:
        """Unmap and remove the file. Idempotent; never raises."""
        if self._map is None:
            return
        self._words.release()
        self._map.close()
        self._map = None
        with contextlib.suppress(OSError):  # removed already: the run directory went first
            os.unlink(self.path)

    @property
    def closed(self) -> bool:
        return self._map is None

    def __enter__(self) -> ProgressBoard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._map is None else f"generations={self._generation}"
        return f"ProgressBoard({self.path!r}, local_world_size={self.local_world_size}, {state})"


def steps_of(snapshot: Mapping[int, ProgressRecord]) -> dict[int, int]:
    """``{local_rank: step}`` of a snapshot (what :class:`NoProgressGuard` takes)."""
    return {rank: record.step for rank, record in snapshot.items()}
