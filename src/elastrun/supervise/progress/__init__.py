"""Workers' progress as the agent sees it: the shared records and the verdicts read from them.

:class:`ProgressBoard` owns the file the workers report into
(:mod:`elastrun.worker.progress` writes it); its snapshots feed the pure detectors:
:class:`HangDetector` (``--hang-timeout``), :class:`StragglerDetector` and
:class:`NoProgressGuard` (no progress across restarts).
"""

from elastrun.supervise.progress.board import FILE_NAME, ProgressBoard, read_record, steps_of
from elastrun.supervise.progress.guard import NoProgressGuard
from elastrun.supervise.progress.hang import (
    AutoTimeout,
    HangDetector,
    HangVerdict,
    RankSilence,
    parse_hang_timeout,
)
from elastrun.supervise.progress.record import ProgressRecord, Snapshot
from elastrun.supervise.progress.straggler import (
    NodeSummary,
    Straggler,
    StragglerDetector,
    step_times,
    summarize,
)

__all__ = [
    "FILE_NAME",
    "AutoTimeout",
    "HangDetector",
    "HangVerdict",
    "NoProgressGuard",
    "NodeSummary",
    "ProgressBoard",
    "ProgressRecord",
    "RankSilence",
    "Snapshot",
    "Straggler",
    "StragglerDetector",
    "parse_hang_timeout",
    "read_record",
    "step_times",
    "steps_of",
    "summarize",
]
