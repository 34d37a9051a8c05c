"""What the ranks of a memory checkpoint settle together (the step to load, whether a
step is complete everywhere), and a DCP call made by one rank alone."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastrun.checkpoint.worker.errors import MemoryCheckpointError

log = logging.getLogger("elastrun.checkpoint")

#: Steps each rank reports to the agreement on the step to load (it holds at most two
#: complete, more only if left by a writer other than ``MemoryCheckpoint``).
REPORTED = 4


def newest_common(group: dist.ProcessGroup | None, world: int, complete: list[int]) -> int | None:
    """The newest of ``complete`` (this rank's complete steps, oldest first) that every
    rank of ``group`` holds complete (None: there is none; no group: this rank alone)."""
    mine = complete[-REPORTED:]
    if group is None:
        return mine[-1] if mine else None
    report = torch.full((REPORTED,), -1, dtype=torch.int64)
    report[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    held = [torch.empty_like(report) for _ in range(world)]
    dist.all_gather(held, report, group=group)
    sets = [{s for s in r.tolist() if s >= 0} for r in held]
    common = set.intersection(*sets)
    if not common and any(sets):
        log.warning(
            "memory checkpoint: no step is complete on every rank (held: %s); starting without one",
            {rank: sorted(s) for rank, s in enumerate(sets) if s},
        )
    return max(common) if common else None


def all_hold(group: dist.ProcessGroup | None, here: bool) -> bool:
    """Whether every rank of ``group`` says ``here`` (no group: this rank's word).

    Raises:
        RuntimeError: the collective failed (the ranks lost each other).
    """
    if group is None:
        return here
    flag = torch.tensor([int(here)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


@contextlib.contextmanager
def dcp_call(what: str) -> Iterator[None]:
    """A call of DCP on this rank alone: its failure raised as elastrun's (DCP gathers
    every rank's exception into a ``CheckpointException``, a ``BaseException`` whose
    text is a traceback), and its warning that it assumes one process silenced, which
    is the point here (see ``checkpoint.worker.storage``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        try:
            yield
        except CheckpointException as exc:
            inner = next(iter(exc.failures.values()), (exc, None))[0]
            if isinstance(inner, MemoryCheckpointError):
                raise inner from None
            raise MemoryCheckpointError(f"{what} failed: {inner!r}") from inner
