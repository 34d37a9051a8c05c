"""Pace: how far and how fast each worker goes -- progress, hangs and stragglers.

Both sides of the concept live here, one subpackage each. The workers' side,
``elastrun.pace.worker``, is one module, :mod:`elastrun.pace.worker.report`
(``elastrun.progress``: a step counter in shared memory, written in
:mod:`elastrun.wire.progress`'s layout); it imports nothing else of the package. The
agent's side, ``elastrun.pace.agent``, never imports the worker's:

- :class:`ProgressBoard` (``board``) owns the file the workers report into; its
  snapshots (``record``) feed the pure detectors: :class:`HangDetector` (``hang``,
  ``--hang-timeout``), :class:`StragglerDetector` (``straggler``) and
  :class:`NoProgressGuard` (``guard``: no progress across restarts).
- ``stall_watch``: the agent's verdicts from the board (hangs, stalled restarts);
  ``step_watch``: step metrics and stragglers, across nodes through ``exchange`` (one
  small store key per node).
"""

from elastrun.core.lazy import lazy_getattr

# As in elastrun/__init__.py: not typing.TYPE_CHECKING, so that workers skip typing.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from elastrun.pace.agent.board import FILE_NAME, ProgressBoard, read_record, steps_of
    from elastrun.pace.agent.guard import NoProgressGuard
    from elastrun.pace.agent.hang import (
        AutoTimeout,
        HangDetector,
        HangVerdict,
        RankSilence,
        parse_hang_timeout,
    )
    from elastrun.pace.agent.record import ProgressRecord, Snapshot
    from elastrun.pace.agent.straggler import (
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
    "AutoTimeout": "elastrun.pace.agent.hang",
    "FILE_NAME": "elastrun.pace.agent.board",
    "HangDetector": "elastrun.pace.agent.hang",
    "HangVerdict": "elastrun.pace.agent.hang",
    "NoProgressGuard": "elastrun.pace.agent.guard",
    "NodeSummary": "elastrun.pace.agent.straggler",
    "ProgressBoard": "elastrun.pace.agent.board",
    "ProgressRecord": "elastrun.pace.agent.record",
    "RankSilence": "elastrun.pace.agent.hang",
    "Snapshot": "elastrun.pace.agent.record",
    "Straggler": "elastrun.pace.agent.straggler",
    "StragglerDetector": "elastrun.pace.agent.straggler",
    "StragglerSettings": "elastrun.pace.agent.straggler",
    "pace_times": "elastrun.pace.agent.straggler",
    "parse_straggler_factor": "elastrun.pace.agent.straggler",
    "parse_hang_timeout": "elastrun.pace.agent.hang",
    "read_record": "elastrun.pace.agent.board",
    "step_times": "elastrun.pace.agent.straggler",
    "steps_of": "elastrun.pace.agent.board",
    "summarize": "elastrun.pace.agent.straggler",
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
