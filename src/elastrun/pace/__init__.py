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
    name: f"elastrun.pace.agent.{module}"
    for module, names in {
        "board": ("FILE_NAME", "ProgressBoard", "read_record", "steps_of"),
        "guard": ("NoProgressGuard",),
        "hang": ("AutoTimeout", "HangDetector", "HangVerdict", "RankSilence", "parse_hang_timeout"),
        "record": ("ProgressRecord", "Snapshot"),
        "straggler": (
            "NodeSummary", "Straggler", "StragglerDetector", "StragglerSettings", "pace_times",
            "parse_straggler_factor", "step_times", "summarize",
        ),
    }.items()
    for name in names
}  # fmt: skip


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
