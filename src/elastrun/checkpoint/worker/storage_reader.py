"""``MemoryStorageReader``: DCP's storage reader from the node's shared memory (see
``checkpoint.worker.storage``): a rank's own piece of a step, or every rank's when the
world that saved it had another size, read straight into the destination tensors (a
tensor on a GPU through a ``Staging`` buffer, pinned, when one is given)."""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from elastrun.checkpoint.worker.errors import MemoryCheckpointError
from elastrun.checkpoint.worker.metadata import Span, decode_metadata, merge_metadata
from elastrun.checkpoint.worker.staging import Staging
from elastrun.checkpoint.worker.storage_io import ALONE, Alone, bytes_of, pread_all, rank_steps

__all__ = ["MemoryStorageReader"]


class MemoryStorageReader(Alone, StorageReader):
    """Reads one step of a memory checkpoint from the node directory ``directory``.

    A rank of a world of the size that saved the step reads its own piece (in the
    node's steps, or a copy another node's agent brought: ``RankSteps.needed``). A rank
    of a world of another size reads every rank's pieces: its metadata is their union
    (DCP's global metadata, ``merge_metadata``), so DCP's planner reshards (each item
    read from the rank's file that holds it).

    Args:
        directory: the node's checkpoint directory (``ELASTRUN_CHECKPOINT_DIR``).
        step: the step to read.
        rank, world_size: this rank's (None: as for the writer).
        staging: where the bytes of a tensor on a device are read first (None: into
            ordinary host memory, then copied).

    Raises (from DCP's calls):
        MemoryCheckpointError: the node does not hold the pieces this rank needs of the
            step, a metadata file is unreadable, or a collective load (not
            ``no_dist=True``).
    """

    def __init__(
        self,
        directory: str,
        step: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        staging: Staging | None = None,
    ) -> None:
        super().__init__()
        self.step = step
        self._steps = rank_steps(directory, rank, world_size)
        self._staging = staging
        self._storage: dict[MetadataIndex, Span] = {}
        self._files: dict[MetadataIndex, str] = {}  # (the data file of each stored item)
        self._data_paths: dict[int, str] = {}  # rank -> its data file (set at read_metadata)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            raise MemoryCheckpointError(
                "a memory checkpoint's step is given to its reader, not as checkpoint_id"
            )
        self._storage = {}
        self._files = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        steps = self._steps
        pieces = steps.needed(self.step)
        if pieces is None:
            raise MemoryCheckpointError(
                f"step {self.step} of rank {steps.rank} is not complete in {steps.directory} "
                f"(no valid marker of its own piece, saved by a world of {steps.world_size}, "
                f"nor of every rank's piece: its save did not finish, or went with its node)"
            )
        metas = {}
        for rank, piece in pieces.items():
            with open(piece.meta_path, "rb") as fh:
                metas[rank] = decode_metadata(fh.read())
        self._data_paths = {rank: piece.data_path for rank, piece in pieces.items()}
        metadata, where = merge_metadata(metas)  # (of one rank: the same metadata)
        self._files = {index: self._data_paths[rank] for index, rank in where.items()}
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not is_coordinator:
            raise MemoryCheckpointError(ALONE)
        self._storage = dict(metadata.storage_data or {})

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[tuple[ReadItem, Span]]] = {}
        for item in plan.items:
            span = self._storage.get(item.storage_index)
            path = self._files.get(item.storage_index)
            if span is None or path is None:
                raise MemoryCheckpointError(
                    f"{item.storage_index.fqn}: not in step {self.step}'s data"
                )
            by_file.setdefault(path, []).append((item, span))
        for path, items in by_file.items():
            with open(path, "rb", buffering=0) as fh:
                fd = fh.fileno()
                for item, span in items:
                    if item.type == LoadItemType.BYTE_IO:
                        buf = bytearray(span.length)
                        pread_all(fd, memoryview(buf), span.offset)
                        planner.load_bytes(item, io.BytesIO(buf))
                    else:
                        target = planner.resolve_tensor(item).detach()
                        staging = self._staging
                        staged = staging is not None and staging.takes(target)
                        _read_tensor(fd, item, span, target, staging if staged else None)
                        planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def __repr__(self) -> str:
        return (
            f"MemoryStorageReader(directory={self._steps.directory!r}, step={self.step}, "
            f"rank={self._steps.rank}, pieces={sorted(self._data_paths)})"
        )


def _read_tensor(
    fd: int, item: ReadItem, span: Span, target: torch.Tensor, staging: Staging | None
) -> None:
    """Fill ``target`` with the part of the stored chunk ``item`` names: straight into
    it where it is the whole chunk in host memory, else through a buffer (``staging``'s,
    which mirrors the data file: the copy to the device is waited for before DCP sees
    the tensor; None: a new one)."""
    if span.dtype is None or span.shape is None:
        raise MemoryCheckpointError(f"{item.storage_index.fqn}: stored as a value, not a tensor")
    whole = tuple(item.lengths) == span.shape and not any(item.storage_offsets)
    if (
        staging is None
        and whole
        and target.device.type == "cpu"
        and target.dtype == span.dtype
        and target.is_contiguous()
        and tuple(target.shape) == span.shape
    ):
        pread_all(fd, bytes_of(target), span.offset)
        return
    if staging is None:
        buf = torch.empty(span.length, dtype=torch.uint8)
    else:
        staging.buffer(os.fstat(fd).st_size)
        buf = staging.region(span.offset, span.length)
    pread_all(fd, bytes_of(buf), span.offset)
    stored = buf.view(span.dtype).reshape(span.shape)
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        stored = stored.narrow(dim, start, length)
    if staging is None:
        target.copy_(stored)
    else:
        staging.copy_out(stored, target)
