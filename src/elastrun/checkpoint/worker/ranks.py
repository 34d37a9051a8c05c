"""What the ranks of a memory checkpoint's persister settle over its gloo group (the
checkpoint's own agreements go through the store: ``checkpoint.worker.agreement``), and
a DCP call made by one rank alone."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from elastrun.checkpoint.worker.errors import MemoryCheckpointError


def all_reduce(group: dist.ProcessGroup | None, value: int, op: dist.ReduceOp.RedOpType) -> int:
    """``value`` reduced by ``op`` over every rank of ``group`` (no group: this rank's
    own): the persister's, on the gloo group its DCP save needs anyway.

    Raises:
        RuntimeError: the collective failed (the ranks lost each other).
    """
    if group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=op, group=group)
    return int(tensor.item())


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
