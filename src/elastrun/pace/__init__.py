"""Pace: how far and how fast each worker goes -- progress, hangs and stragglers.

Both sides of the concept live here. The workers' side is one module,
:mod:`elastrun.pace.worker` (``elastrun.progress``: a step counter in shared memory,
written in :mod:`elastrun.wire.progress`'s layout); it imports nothing else of the
package. The rest is the agent's side, which never imports the worker's:

- :class:`ProgressBoard` (``board``) owns the file the workers report into; its
  snapshots (``record``) feed the pure detectors: :class:`HangDetector` (``hang``,
  ``--hang-timeout``), :class:`StragglerDetector` (``straggler``) and
  :class:`NoProgressGuard` (``guard``: no progress across restarts).
- ``progress_watch``: the agent's verdicts from the board (hangs, stalled restarts);
  ``pace_watch``: step metrics and stragglers, across nodes through ``exchange`` (one
  small store key per node).
"""

from elastrun.core.lazy import lazy_getattr

# As in elastrun/__init__.py: not typing.TYPE_CHECKING, so that workers skip typing.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from elastrun.pace.board import FILE_NAME, ProgressBoard, read_record, steps_of
    from elastrun.pace.guard import NoProgressGuard
    from elastrun.pace.hang import (
        AutoTimeout,
        HangDetector,
        HangVerdict,
        RankSilence,
        parse_hang_timeout,
    )
    from elastrun.pace.record import ProgressRecord, Snapshot
    from elastrun.pace.straggler import (
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
    "AutoTimeout": "elastrun.pace.hang",
    "FILE_NAME": "elastrun.pace.board",
    "HangDetector": "elastrun.pace.hang",
    "HangVerdict": "elastrun.pace.hang",
    "NoProgressGuard": "elastrun.pace.guard",
    "NodeSummary": "elastrun.pace.straggler",
    "ProgressBoard": "elastrun.pace.board",
    "ProgressRecord": "elastrun.pace.record",
    "RankSilence": "elastrun.pace.hang",
    "Snapshot": "elastrun.pace.record",
    "Straggler": "elastrun.pace.straggler",
    "StragglerDetector": "elastrun.pace.straggler",
    "StragglerSettings": "elastrun.pace.straggler",
    "pace_times": "elastrun.pace.straggler",
    "parse_straggler_factor": "elastrun.pace.straggler",
    "parse_hang_timeout": "elastrun.pace.hang",
    "read_record": "elastrun.pace.board",
    "step_times": "elastrun.pace.straggler",
    "steps_of": "elastrun.pace.board",
    "summarize": "elastrun.pace.straggler",
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
