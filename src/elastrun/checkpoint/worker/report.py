"""What a rank tells its agent about its memory checkpoints: its report file.

The agent records events and metrics of the checkpoints (the time a save blocks, its
copy lag, the step a restart restored), but it never imports torch and holds no channel
to the checkpoints' background thread. The node directory is what both already share,
and it outlives the worker: so each rank keeps its totals in a small file there
(``report-rank-<R>.json``, :mod:`elastrun.wire.checkpoint`), rewritten by a rename
after each save finished in the background and after each load, and the agent reads
the files now and then and once more before it removes the directory.

Rejected: a line per save in an append-only file (it grows with the run, and a reader
must track offsets across restarts); the progress board's shared memory (its records
are the progress watch's, fixed in size, and a new field there is a new wire version
for every worker); the rendezvous store (a client the workers do not otherwise hold,
and a write per step per rank). Totals, not the last save's values, so that a reader
that looks once a second still counts every save: it takes the mean of those between
two looks.

A report that cannot be written (the node's shared memory full) is logged once and
skipped: it never fails a save.
"""

from __future__ import annotations

import logging
import os
import threading

from elastrun.wire.checkpoint import RankReport, encode_report, replace_file, report_name

__all__ = ["RankReporter"]

log = logging.getLogger("elastrun.checkpoint")


class RankReporter:
    """One process's totals for rank ``rank``, rewritten to its report file in
    ``directory`` after each change. Thread-safe: the training thread reports loads,
    the background thread saves.

    Args:
        directory: the node's checkpoint directory.
        rank, local_rank: whose report it is.
        pid: the process it describes (a restarted worker's report replaces its
            predecessor's; the reader tells them apart by it).
    """

    def __init__(self, directory: str, rank: int, local_rank: int, pid: int) -> None:
        self._path = os.path.join(directory, report_name(rank))
        self._lock = threading.Lock()
        self._report = RankReport(rank=rank, local_rank=local_rank, pid=pid)
        self._failed = False

    @property
    def report(self) -> RankReport:
        """The totals as last written (or about to be)."""
        with self._lock:
            return self._report

    def saved(
        self, *, blocked: float, written: float | None, agreed: float | None, newest: int | None
    ) -> None:
        """Count one save finished in the background.

        Args:
            blocked: seconds the training thread spent in ``save``.
            written: seconds from the call until this rank's marker (None: the step was
                not written here, or not kept).
            agreed: seconds from the call until the ranks agreed that the step is
                complete on all of them (None: it was not).
            newest: the newest step complete on every rank, after this save.
        """
        with self._lock:
            r = self._report
            r = r._replace(saves=r.saves + 1, blocked_s=r.blocked_s + blocked, newest=newest)
            if written is not None and agreed is not None:
                r = r._replace(
                    complete=r.complete + 1, save_s=r.save_s + written, lag_s=r.lag_s + agreed
                )
            self._report = r
            self._write()

    def loaded(self, step: int | None, took: float) -> None:
        """Count one load that restored ``step`` (None: none was complete on every
        rank) in ``took`` seconds."""
        with self._lock:
            r = self._report
            self._report = r._replace(loads=r.loads + 1, restored=step, restore_s=took, newest=step)
            self._write()

    def _write(self) -> None:
        """Write the report (under the lock): to a temporary name, then renamed, so
        that the agent reads a whole report or the one before."""
        try:
            replace_file(self._path, encode_report(self._report))
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning(
                    "memory checkpoint: rank %d cannot write its report for the agent (%s); "
                    "its events and metrics will be missing",
                    self._report.rank,
                    exc.strerror or exc,
                )

    def __repr__(self) -> str:
        return f"RankReporter(path={self._path!r}, report={self.report!r})"
