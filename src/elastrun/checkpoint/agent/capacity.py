"""What the node's shared memory can hold of memory checkpoints, said before a launch.

The size of a checkpoint is known only to the workers, at their first load or save
(the state's tensors: the agent never imports torch), where the worker side checks it
(``checkpoint.worker.space``). Before that, what is known is the limit and the rule:
each rank holds :data:`~elastrun.wire.checkpoint.STEPS_HELD` steps of its state (the
newest complete and the one in progress), and a job of several nodes holds
:data:`~elastrun.wire.checkpoint.COPIES_HELD` more of another node's (its buddy's
copy: the newest, one arriving), so ``--dry-run`` states the space free in ``/dev/shm``
and the state per rank it leaves room for. It reads the file system's figures and
writes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from elastrun.checkpoint.agent.node_dir import SHARED_MEMORY
from elastrun.core.values import size_text
from elastrun.wire.checkpoint import COPIES_HELD, STEPS_HELD

__all__ = ["capacity_lines"]


def capacity_lines(
    local_ranks: int,
    *,
    nodes: int = 1,
    base: str = SHARED_MEMORY,
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
) -> list[str]:
    """One or two lines for ``--dry-run``: where a node's memory checkpoints go, what it
    holds of them, and the largest state per rank that the space free now leaves room
    for with ``local_ranks`` ranks (and, with up to ``nodes`` > 1 nodes, a buddy's copy
    of as many); one line when ``base`` cannot be read."""
    try:
        st = statvfs(base)
    except OSError as exc:
        return [
            f"none: {base} cannot be read here ({exc.strerror or exc}), so workers get no "
            f"node directory"
        ]
    free = st.f_bavail * st.f_frsize
    total = st.f_blocks * st.f_frsize
    copies = COPIES_HELD if nodes > 1 else 0
    per_rank = free // ((STEPS_HELD + copies) * max(1, local_ranks))
    buddy = (
        f", and {copies} of each of its buddy node's ranks (a copy: the newest, one arriving)"
        if copies
        else ""
    )
    return [
        f"in {base} when the script uses elastrun.checkpoint: {STEPS_HELD} steps of each "
        f"rank's state (the newest complete, one in progress){buddy}",
        f"{size_text(free)} free of {size_text(total)} now for {local_ranks} local rank(s): up to "
        f"{size_text(per_rank)} of state per rank (checked before training)",
    ]
