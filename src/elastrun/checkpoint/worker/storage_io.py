"""What the memory storage writer and reader share (``checkpoint.worker.storage``):
whose steps they handle, their refusal of a collective save or load, and the copy of
bytes between a data file and a tensor's memory, without a buffer in between."""

from __future__ import annotations

import ctypes
import math
import os
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import WriteItem

from elastrun.checkpoint.worker.errors import MemoryCheckpointError
from elastrun.checkpoint.worker.steps import RankSteps

__all__ = [
    "ALONE",
    "Alone",
    "bytes_of",
    "default_rank_and_world",
    "planned_bytes",
    "pread_all",
    "pwrite_all",
    "rank_steps",
]

# pwrite/pread move at most this much per call on Linux (2 GiB less a page).
_IO_MAX = 0x7FFFF000

#: Why a collective save or load is refused.
ALONE = (
    "each rank's memory checkpoint stands alone: call dcp.save/dcp.load with "
    "no_dist=True (the node's memory holds only its own ranks' pieces)"
)

Plan = TypeVar("Plan")


class Alone:
    """DCP's storage calls that the memory storage reader and writer answer alike: each
    rank's checkpoint stands alone (a collective save or load is refused: ``ALONE``),
    and its step is given to it, never chosen from a ``checkpoint_id``."""

    def prepare_local_plan(self, plan: Plan) -> Plan:
        return plan

    def prepare_global_plan(self, plans: list[Plan]) -> list[Plan]:
        if len(plans) != 1:
            raise MemoryCheckpointError(ALONE)
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def default_rank_and_world() -> tuple[int, int]:
    """This process's rank and world size: the default process group's, else ``RANK``
    and ``WORLD_SIZE`` (0 and 1 when unset)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def rank_steps(directory: str, rank: int | None, world_size: int | None) -> RankSteps:
    """The steps of ``rank`` in a world of ``world_size`` (None: this process's, as
    :func:`default_rank_and_world` says) in the node directory ``directory``."""
    own_rank, own_world = default_rank_and_world()
    return RankSteps(
        directory,
        own_rank if rank is None else rank,
        own_world if world_size is None else world_size,
    )


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (valid while it lives)."""
    length = tensor.nbytes
    if length == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * length).from_address(tensor.data_ptr())).cast("B")


def planned_bytes(item: WriteItem) -> int:
    """The bytes of the chunk a tensor item holds (its shard, not the whole tensor: DCP's
    ``tensor_storage_size`` counts the whole; 0 for a value)."""
    data = item.tensor_data
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * torch.empty((), dtype=data.properties.dtype).element_size()


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` to ``fd`` at ``offset`` (``pwrite`` moves at most 2 GiB a
    call, and may move less)."""
    while data:
        n = os.pwrite(fd, data[:_IO_MAX], offset)
        data, offset = data[n:], offset + n


def pread_all(fd: int, into: memoryview, offset: int) -> None:
    """Fill ``into`` from ``fd`` at ``offset``.

    Raises:
        MemoryCheckpointError: the file ends first (truncated).
    """
    while into:
        n = os.preadv(fd, [into[:_IO_MAX]], offset)
        if n == 0:
            raise MemoryCheckpointError(f"the data file ends at {offset}: truncated")
        into, offset = into[n:], offset + n
