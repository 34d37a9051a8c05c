"""The launcher's exit statuses: what a scheduler can act on.

One table, used by the launcher (``launch.main``), the failure report's errors and the
Kubernetes pod failure policy (``launch.k8s``); ``docs/failures.md`` shows it.

Why these values:

* 0, 1 and 2 are what users and wrappers already see: 1 is torchrun's status for a
  failed job (kept), 2 elastrun's for a configuration error (torchrun exits 1 with a
  traceback), and ``128 + N`` the shell's convention for "ended by signal N".
* "Do not requeue" is 93, the value NVIDIA's resiliency extension gives a job that
  makes no progress, so that a wrapper written for it works unchanged.
* "Replace the node" is 75, ``EX_TEMPFAIL`` of ``sysexits.h``: the job may go on or run
  again, elsewhere.
* ``srun`` returns the highest status of a step's tasks. Where one node says "replace
  me" (75) and the others fail because of it (1), the step says 75; where any node says
  "do not requeue" (93), the step says so, whatever the others say -- except a signal
  (128 + N), which the scheduler sent and knows about.
"""

from __future__ import annotations

import enum

__all__ = ["ExitStatus", "signal_status"]


class ExitStatus(enum.IntEnum):
    """The launcher's exit statuses (a signal adds ``signal_status``)."""

    #: Every worker succeeded.
    SUCCESS = 0
    #: A worker failed and the restart budget ran out (after the report), the
    #: rendezvous failed, or the job failed on another node. A retry may succeed.
    WORKER_FAILED = 1
    #: An option or variable is invalid; nothing was started. No retry fixes it.
    BAD_CONFIG = 2
    #: This node was found bad (its check failed, or it was excluded for failing
    #: again and again): replace the node; the job may go on, or be requeued, without it.
    #: Reserved: defined (and handled by the Kubernetes policy) before the node checks
    #: and the exclusion that will return it.
    REPLACE_NODE = 75
    #: More restarts will not help: the restarts made no progress, or the same rank
    #: failed the same way at the same step twice in a row (a crash loop). Do not requeue.
    DO_NOT_REQUEUE = 93


def signal_status(signum: int) -> int:
    """The exit status after stopping on signal ``signum``: ``128 + signum``."""
    return 128 + signum
