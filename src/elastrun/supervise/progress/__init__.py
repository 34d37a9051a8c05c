"""Workers' progress as the agent sees it: the shared records and the verdicts read from them.

:class:`ProgressBoard` owns the file the workers report into (:mod:`elastrun.worker.progress`
writes it, in :mod:`elastrun.wire.progress`'s layout); its snapshots feed the pure
detectors: :class:`HangDetector` (``--hang-timeout``), :class:`StragglerDetector` and
:class:`NoProgressGuard` (no progress across restarts).
"""

from typing import TYPE_CHECKING

from elastrun.core.lazy import lazy_getattr

if TYPE_CHECKING:
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
        StragglerSettings,
        pace_times,
        parse_straggler_factor,
        step_times,
        summarize,
    )

# Resolved on first use: the agent imports this package on the launch path and needs
# only the board and the detectors it uses.
_LAZY = {
    "AutoTimeout": "elastrun.supervise.progress.hang",
    "FILE_NAME": "elastrun.supervise.progress.board",
    "HangDetector": "elastrun.supervise.progress.hang",
    "HangVerdict": "elastrun.supervise.progress.hang",
    "NoProgressGuard": "elastrun.supervise.progress.guard",
    "NodeSummary": "elastrun.supervise.progress.straggler",
    "ProgressBoard": "elastrun.supervise.progress.board",
    "ProgressRecord": "elastrun.supervise.progress.record",
    "RankSilence": "elastrun.supervise.progress.hang",
    "Snapshot": "elastrun.supervise.progress.record",
    "Straggler": "elastrun.supervise.progress.straggler",
    "StragglerDetector": "elastrun.supervise.progress.straggler",
    "StragglerSettings": "elastrun.supervise.progress.straggler",
    "pace_times": "elastrun.supervise.progress.straggler",
    "parse_straggler_factor": "elastrun.supervise.progress.straggler",
    "parse_hang_timeout": "elastrun.supervise.progress.hang",
    "read_record": "elastrun.supervise.progress.board",
    "step_times": "elastrun.supervise.progress.straggler",
    "steps_of": "elastrun.supervise.progress.board",
    "summarize": "elastrun.supervise.progress.straggler",
}


__getattr__ = lazy_getattr(__name__, _LAZY)

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
    "StragglerSettings",
    "pace_times",
    "parse_hang_timeout",
    "parse_straggler_factor",
    "read_record",
    "step_times",
    "steps_of",
    "summarize",
]
