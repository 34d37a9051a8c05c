"""Will the node's shared memory hold the checkpoints? Asked before any byte is written.

A node holds, for each of its ranks, the newest complete step and the one in progress:
twice the rank's state; and when its agent copies another node's steps here (its
``buddy.json`` names a source), twice that node's state more (the newest copy and the
one arriving), counted as this node's (nodes of one job hold near equal shards).
``/dev/shm`` is a tmpfs, limited by its size and by the machine's memory; a container
often gets 64 MiB of it. Writing past its end through a mapping ends in SIGBUS in the
middle of a run; the writer preallocates each file (``posix_fallocate``) so that a save
never gets that far, and this check refuses, at the start, a state that would not fit,
with one line that names the size needed and the space free.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from elastrun.checkpoint.worker.errors import CheckpointSpaceError
from elastrun.checkpoint.worker.steps import directory_usage, read_buddy
from elastrun.core.values import size_text
from elastrun.wire.checkpoint import COPIES_HELD, STEPS_HELD

__all__ = ["StatvfsResult", "check_space", "state_bytes"]


class StatvfsResult(Protocol):
    """What the check reads of ``os.statvfs``'s answer."""

    @property
    def f_bavail(self) -> int: ...

    @property
    def f_frsize(self) -> int: ...


def state_bytes(state: object) -> int:
    """Bytes of the tensors in ``state`` (nested mappings, lists and tuples; an object
    with ``state_dict()`` counts as its state dict; a DTensor as its local shard):
    what a rank's checkpoint of it holds, values aside (they are small)."""
    if isinstance(state, DTensor):
        return state.to_local().nbytes
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, Stateful):
        return state_bytes(state.state_dict())
    if isinstance(state, Mapping):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


def check_space(
    directory: str,
    rank_bytes: int,
    *,
    rank: int,
    local_ranks: int,
    statvfs: Callable[[str], StatvfsResult] = os.statvfs,
) -> None:
    """Refuse a checkpoint of ``rank_bytes`` per rank that the file system of
    ``directory`` cannot hold for ``local_ranks`` ranks, two steps each, and as much
    again of a buddy's copy when the node holds one.

    The space counted is what is free plus what ``directory`` already holds (this
    job's own steps, which the new ones replace). Every rank of a node is assumed to
    hold as much as this one (shards of one model are near equal).

    Raises:
        CheckpointSpaceError: one line naming the size needed and the space free.
    """
    buddy = read_buddy(directory)
    copies = COPIES_HELD if buddy is not None and buddy.source is not None else 0
    needed = (STEPS_HELD + copies) * local_ranks * rank_bytes
    st = statvfs(directory)
    free = st.f_bavail * st.f_frsize
    held = directory_usage(directory)
    if needed <= free + held:
        return
    where = os.path.dirname(directory.rstrip("/")) or directory
    of_copy = f"; {copies} of the steps a buddy node's copy" if copies else ""
    raise CheckpointSpaceError(
        f"memory checkpoints need {size_text(needed)} of shared memory on this node "
        f"({STEPS_HELD + copies} steps x {local_ranks} local rank(s) x {size_text(rank_bytes)}, "
        f"rank {rank}'s state{of_copy}), and {where} has {size_text(free + held)} "
        f"for them ({size_text(free)} free, {size_text(held)} held by this job's "
        f"checkpoints): give the node more shared "
        f"memory (a container's --shm-size) or checkpoint less state",
        needed=needed,
        free=free + held,
    )
