"""One rank's memory checkpoint as DCP's save items, and the plan that merges the
ranks' items into one checkpoint in DCP's own format.

A persisted step (``checkpoint.worker.persist``) is written by DCP's own collective
save (``dcp.save`` with a ``FileSystemWriter``, over the persisting thread's gloo
group), so its files are those DCP writes and plain DCP reads. What DCP would take from
a state dict -- which pieces of which tensors this rank holds -- comes instead from the
rank's step in memory: its metadata names every item and where it lies in the data
file. :func:`read_snapshot` copies those items into the process's own memory (the step
in the node's memory is then free to go: the next save writes over its data file);
:class:`SnapshotPlanner` is the DCP planner that hands them to the writer.

**Merging.** Each rank's step in memory stands alone: it holds every item the rank
holds, replicated tensors and plain values included, so the ranks' items overlap. The
coordinator's global plan (:func:`merge_plans`, a pure function) keeps each piece once:
a value on the lowest rank that holds it (as the coordinator's would be), a tensor's
piece on the holder with the least bytes given so far (the largest pieces first), so
that a replicated state is written once, spread over the ranks. Every tensor's pieces
must cover it: a tensor that some rank did not hold whole is refused, naming it.

Rejected: rebuilding the rank's state dict (DTensors need their mesh, which the
background thread must not touch: its collectives run on the user's process group);
writing DCP's files and pickled metadata here (the format is DCP's to change: its
writer and its reader move together).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from elastrun.checkpoint.worker.errors import MemoryCheckpointError
from elastrun.checkpoint.worker.metadata import Span, decode_metadata
from elastrun.checkpoint.worker.steps import RankSteps
from elastrun.checkpoint.worker.storage_io import bytes_of, planned_bytes, pread_all

__all__ = ["Snapshot", "SnapshotPlanner", "merge_plans", "read_snapshot"]


@dataclass
class Snapshot:
    """One rank's step, copied out of the node's memory: DCP's save items, the data of
    each (a tensor with its own storage, or a value's bytes), and the planner's data of
    the step's metadata (the state dict's nesting)."""

    step: int
    items: list[WriteItem]
    data: dict[MetadataIndex, torch.Tensor | bytes]
    planner_data: Any

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes if isinstance(d, torch.Tensor) else len(d) for d in self.data.values())


def read_snapshot(steps: RankSteps, step: int) -> Snapshot:
    """Copy this rank's ``step`` out of the node's memory.

    Raises:
        MemoryCheckpointError: the step is not complete for this rank, or it was
            removed while it was read (its data may have been written over).
        OSError: a file could not be read.
    """
    if steps.marker(step) is None:
        raise MemoryCheckpointError(
            f"step {step} is not complete for rank {steps.rank} in {steps.directory}"
        )
    with open(steps.meta_path(step), "rb") as fh:
        metadata = decode_metadata(fh.read())
    items: list[WriteItem] = []
    data: dict[MetadataIndex, torch.Tensor | bytes] = {}
    with open(steps.data_path(step), "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        for index, span in (metadata.storage_data or {}).items():
            if span.offset + span.length > size:
                raise MemoryCheckpointError(f"{index.fqn}: beyond the end of the step's data")
            item, value = _item(metadata, index, span, fh.fileno())
            items.append(item)
            data[item.index] = value
    # The marker goes first when a step is removed: still there, nothing was removed
    # (nor written over) while the data was read.
    if steps.marker(step) is None:
        raise MemoryCheckpointError(f"step {step} was removed while it was read")
    return Snapshot(step, items, data, metadata.planner_data)


def _item(
    metadata: Metadata, index: MetadataIndex, span: Span, fd: int
) -> tuple[WriteItem, torch.Tensor | bytes]:
    entry = metadata.state_dict_metadata.get(index.fqn)
    if entry is None:
        raise MemoryCheckpointError(f"{index.fqn}: stored, but not in the step's metadata")
    if isinstance(entry, BytesStorageMetadata):
        raw = bytearray(span.length)
        pread_all(fd, memoryview(raw), span.offset)
        return WriteItem(index=MetadataIndex(index.fqn), type=WriteItemType.BYTE_IO), bytes(raw)
    chunk = _chunk(entry, index)
    if span.dtype is None or span.shape is None:
        raise MemoryCheckpointError(f"{index.fqn}: stored as a value, not a tensor")
    # Its own storage (DCP's writer saves a tensor's whole storage), read straight
    # into it: one copy, by the kernel, from the node's memory.
    tensor = torch.empty(span.shape, dtype=span.dtype)
    if tensor.nbytes != span.length:
        raise MemoryCheckpointError(f"{index.fqn}: {span.length} bytes stored for {span.shape}")
    pread_all(fd, bytes_of(tensor), span.offset)
    whole = tuple(chunk.sizes) == tuple(entry.size)
    item = WriteItem(
        index=MetadataIndex(index.fqn, chunk.offsets),
        type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=entry.properties, size=entry.size),
    )
    return item, tensor


def _chunk(entry: TensorStorageMetadata, index: MetadataIndex) -> ChunkStorageMetadata:
    offsets = tuple(index.offset or ())
    for chunk in entry.chunks:
        if tuple(chunk.offsets) == offsets:
            return chunk
    raise MemoryCheckpointError(f"{index.fqn}: no piece at {list(offsets)} in the metadata")


# -- the global plan ------------------------------------------------------------------


def merge_plans(plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """The ranks' plans (in rank order) with each item kept on one rank only, and the
    checkpoint's metadata (every tensor's pieces; the planner's data of all ranks, the
    lowest rank's first).

    Raises:
        MemoryCheckpointError: the ranks disagree on an item (a value on one, a tensor
            on another; a tensor's size or dtype), or a tensor's pieces do not cover it.
    """
    holders: dict[MetadataIndex, list[int]] = {}
    first: dict[MetadataIndex, WriteItem] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            seen = first.setdefault(item.index, item)
            if seen is not item:
                _check_same(seen, item)
    owner = _owners(first, holders, len(plans))
    state_dict_metadata = _global_metadata(first)
    kept: list[list[WriteItem]] = [[] for _ in plans]
    for index, item in first.items():
        kept[owner[index]].append(_with_hint(item, state_dict_metadata))
    planner_data: dict[Any, Any] = {}
    for plan in reversed(plans):
        if isinstance(plan.planner_data, dict):
            planner_data.update(plan.planner_data)
    new_plans = [dataclasses.replace(p, items=items) for p, items in zip(plans, kept, strict=True)]
    return new_plans, Metadata(state_dict_metadata, planner_data=planner_data)


def _check_same(a: WriteItem, b: WriteItem) -> None:
    fqn = a.index.fqn
    if (a.type == WriteItemType.BYTE_IO) != (b.type == WriteItemType.BYTE_IO):
        raise MemoryCheckpointError(f"{fqn}: a value on one rank, a tensor on another")
    ta, tb = a.tensor_data, b.tensor_data
    if ta is not None and tb is not None:
        if tuple(ta.size) != tuple(tb.size) or ta.properties.dtype != tb.properties.dtype:
            raise MemoryCheckpointError(
                f"{fqn}: {ta.properties.dtype} {list(ta.size)} on one rank, "
                f"{tb.properties.dtype} {list(tb.size)} on another"
            )
        if tuple(ta.chunk.sizes) != tuple(tb.chunk.sizes):
            raise MemoryCheckpointError(
                f"{fqn}: pieces of sizes {list(ta.chunk.sizes)} and {list(tb.chunk.sizes)} "
                f"at the same place"
            )


def _owners(
    first: dict[MetadataIndex, WriteItem], holders: dict[MetadataIndex, list[int]], ranks: int
) -> dict[MetadataIndex, int]:
    """Which rank writes each item: a value the lowest holder, a tensor's piece the
    holder with the fewest bytes so far, the largest pieces placed first."""
    owner: dict[MetadataIndex, int] = {}
    given = [0] * ranks
    pieces = []
    for index, item in first.items():
        if item.type == WriteItemType.BYTE_IO:
            owner[index] = min(holders[index])
        else:
            pieces.append((index, planned_bytes(item)))
    pieces.sort(key=lambda p: (-p[1], p[0].fqn, tuple(p[0].offset or ())))
    for index, size in pieces:
        rank = min(holders[index], key=lambda r: (given[r], r))
        owner[index] = rank
        given[rank] += size
    return owner


def _global_metadata(first: dict[MetadataIndex, WriteItem]) -> dict[str, STORAGE_TYPES]:
    metadata: dict[str, STORAGE_TYPES] = {}
    for item in first.values():
        fqn, data = item.index.fqn, item.tensor_data
        new: STORAGE_TYPES = BytesStorageMetadata()
        if data is not None:
            new = TensorStorageMetadata(properties=data.properties, size=data.size, chunks=[])
        entry = metadata.setdefault(fqn, new)
        if type(entry) is not type(new):
            raise MemoryCheckpointError(f"{fqn}: a value on one rank, a tensor on another")
        if isinstance(entry, TensorStorageMetadata) and data is not None:
            entry.chunks.append(data.chunk)
    for fqn, entry in metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            entry.chunks.sort(key=lambda c: tuple(c.offsets))
            held = sum(math.prod(c.sizes) for c in entry.chunks)
            if held != math.prod(entry.size):
                raise MemoryCheckpointError(
                    f"{fqn}: the ranks' pieces hold {held} of its {math.prod(entry.size)} "
                    f"elements (every piece of a tensor must be saved by some rank)"
                )
    return metadata


def _with_hint(item: WriteItem, metadata: dict[str, STORAGE_TYPES]) -> WriteItem:
    """``item`` with its index's hint set to its piece's place in the metadata."""
    entry = metadata[item.index.fqn]
    if not isinstance(entry, TensorStorageMetadata) or item.tensor_data is None:
        return item
    offsets = tuple(item.tensor_data.chunk.offsets)
    place = next(i for i, c in enumerate(entry.chunks) if tuple(c.offsets) == offsets)
    return dataclasses.replace(item, index=MetadataIndex(item.index.fqn, offsets, place))


# -- the planner ----------------------------------------------------------------------


class SnapshotPlanner(SavePlanner):
    """DCP's planner for a persisted step: the items of this rank's snapshot instead of
    a state dict's (the state dict DCP is given is empty), merged by
    :func:`merge_plans`.

    Args:
        snapshot: this rank's step, or None when it could not be read.
        failure: why it could not be read: raised from the local plan, so that DCP
            tells every rank that the save failed (no rank leaves the collectives
            early).
    """

    def __init__(self, snapshot: Snapshot | None, failure: BaseException | None = None) -> None:
        self._snapshot = snapshot
        self._failure = failure

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        pass  # (everything comes from the snapshot)

    def create_local_plan(self) -> SavePlan:
        if self._failure is not None:
            raise self._failure
        if self._snapshot is None:
            raise MemoryCheckpointError("nothing to persist: no snapshot")
        return SavePlan(list(self._snapshot.items), planner_data=self._snapshot.planner_data)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return merge_plans(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        snapshot = self._snapshot
        if snapshot is not None:  # drop what another rank writes: its memory goes now
            mine = {item.index for item in new_plan.items}
            snapshot.data = {k: v for k, v in snapshot.data.items() if k in mine}
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if self._snapshot is None:
            raise MemoryCheckpointError("nothing to persist: no snapshot")
        value = self._snapshot.data[write_item.index]
        return io.BytesIO(value) if isinstance(value, bytes) else value

    def __repr__(self) -> str:
        step = None if self._snapshot is None else self._snapshot.step
        return f"SnapshotPlanner(step={step}, failed={self._failure is not None})"
