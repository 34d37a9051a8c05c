"""The names of the variables an agent gives its workers to find its services by.

Both sides read these names from here: the agent's plan sets them, the worker side
(``record``, the bootstrap, the template's key) reads them. The per-round variables
torch defines (``RANK``, ``WORLD_SIZE``, ...) are torch's contract, written out where
the plan makes them; the variables of one format live with its module
(``wire.inprocess``: the in-process channel, ``wire.checkpoint``: the memory
checkpoints), except the progress board's, here because the worker bootstrap reads
them at start-up, where it imports nothing more (``wire.progress`` re-exports them).

**Version.** :data:`VERSION` counts the set of names; a name never changes meaning,
and a new variable is a new name. Nothing here is carried on a wire, so no reader
checks it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "ERROR_FILE_ENV",
    "INPROCESS_ENV",
    "PROGRESS_FILE_ENV",
    "PROGRESS_SLOT_ENV",
    "SIGNALS_TO_HANDLE_ENV",
    "STACKS_FILE_ENV",
    "TIMER_FILE_ENV",
    "inprocess_wanted",
]

#: The set of names (see the module's docstring).
VERSION = 1
#: Where a worker writes its uncaught exception (torch's ``@record`` format).
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
#: Where a worker dumps its threads' stacks on SIGUSR1 (``elastrun stacks``).
STACKS_FILE_ENV = "ELASTRUN_STACKS_FILE"
#: The expiration timers' FIFO (torch's file-based timer).
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
#: The signals a worker's ``record`` turns into an error file (torch's variable).
SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
#: The progress board the agent created; its presence is the agent asking for reports.
PROGRESS_FILE_ENV = "ELASTRUN_PROGRESS_FILE"
#: This worker's record in the board (an index, not a rank: see ProgressBoard.reset).
PROGRESS_SLOT_ENV = "ELASTRUN_PROGRESS_SLOT"
#: ``ELASTRUN_INPROCESS=0`` (the user's, read by the agent) turns in-process recovery
#: off: every failure restarts the whole group, as for scripts that do not use
#: ``elastrun.inprocess``.
INPROCESS_ENV = "ELASTRUN_INPROCESS"


def inprocess_wanted(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` leaves in-process recovery on (``INPROCESS_ENV``)."""
    return environ.get(INPROCESS_ENV, "1") != "0"
