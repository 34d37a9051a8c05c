"""A ``torch.distributed.checkpoint`` storage layer in the node's shared memory.

``MemoryStorageWriter`` and ``MemoryStorageReader`` put one rank's checkpoint of one
step in the node directory (``elastrun.wire.checkpoint``'s layout) instead of files
on a disk::

    dcp.save(state_dict, storage_writer=MemoryStorageWriter(directory, step), no_dist=True)
    dcp.load(state_dict, storage_reader=MemoryStorageReader(directory, step), no_dist=True)

**Each rank's checkpoint stands alone** (``no_dist=True``: every rank is its own
coordinator, and writes its own metadata). DCP's collective save would not do here:
its coordinator writes the one metadata file, on its own node, and saves each
replicated tensor and every plain value on one rank only, so a rank on another node
would find neither in its own node's memory. Standing alone, a rank writes every item it
holds (its shards of DTensors, its replicated tensors, the values) and reads back only
its own files; no save waits on a peer, so a dead peer never stalls one. Loading into
another world size reads every rank's pieces, which the node then holds (its own, its
buddy's copy, or pieces its agent gathered before the round): the reader plans over the
union of their metadata, DCP's global metadata, and DCP reshards.

**The bytes.** The writer sizes the rank's data file first (``posix_fallocate``: a full
``/dev/shm`` fails there, before a byte is copied, never later as a bus error), then
copies each tensor into it with ``pwrite`` from the tensor's own memory (one copy; a
tensor on a GPU is brought to the host first), values (DCP serializes them) after. The
reader reads each stored chunk straight into the destination tensor when it can (same
dtype and shape, contiguous, on the CPU), else through a buffer. The metadata (DCP's,
as JSON: ``checkpoint.worker.metadata``) and the marker are written when DCP calls
``finish``; the marker last, by a rename (``checkpoint.worker.steps``), so a step whose
writer died is never read. ``MemoryCheckpoint`` defers them to its background thread
(``publish_on_finish=False``, then :meth:`MemoryStorageWriter.publish`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import io
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from elastrun.checkpoint.worker.errors import CheckpointSpaceError, MemoryCheckpointError
from elastrun.checkpoint.worker.metadata import (
    Span,
    decode_metadata,
    encode_metadata,
    merge_metadata,
)
from elastrun.checkpoint.worker.steps import RankSteps
from elastrun.wire.checkpoint import Marker

__all__ = ["MemoryStorageReader", "MemoryStorageWriter", "default_rank_and_world"]

#: Items start at multiples of this in the data file (a cache line).
ALIGN = 64
# pwrite/pread move at most this much per call on Linux (2 GiB less a page).
_IO_MAX = 0x7FFFF000

_ALONE = (
    "each rank's memory checkpoint stands alone: call dcp.save/dcp.load with "
    "no_dist=True (the node's memory holds only its own ranks' pieces)"
)


def default_rank_and_world() -> tuple[int, int]:
    """This process's rank and world size: the default process group's, else ``RANK``
    and ``WORLD_SIZE`` (0 and 1 when unset)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _rank_steps(directory: str, rank: int | None, world_size: int | None) -> RankSteps:
    own_rank, own_world = default_rank_and_world()
    return RankSteps(
        directory,
        own_rank if rank is None else rank,
        own_world if world_size is None else world_size,
    )


class MemoryStorageWriter(StorageWriter):
    """Writes one rank's checkpoint of ``step`` into the node directory ``directory``.

    Args:
        directory: the node's checkpoint directory (``ELASTRUN_CHECKPOINT_DIR``).
        step: the step this checkpoint is of (a new one: its files are replaced).
        rank, world_size: this rank's (None: the default process group's, or ``RANK``
            and ``WORLD_SIZE``).
        publish_on_finish: write the metadata and the marker when DCP calls ``finish``
            (False: when :meth:`publish` is called, e.g. on another thread).
        space_check: called with the bytes the data file will take before any is
            written (it raises to refuse the save).

    Raises (from DCP's calls):
        MemoryCheckpointError: a collective save (not ``no_dist=True``), or a tensor
            that is not a dense strided one.
        CheckpointSpaceError: the node's shared memory cannot hold the data file.
    """

    def __init__(
        self,
        directory: str,
        step: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        publish_on_finish: bool = True,
        space_check: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__()
        self.step = step
        self._steps = _rank_steps(directory, rank, world_size)
        self._publish_on_finish = publish_on_finish
        self._space_check = space_check
        self._data_bytes: int | None = None
        self._metadata: Metadata | None = None

    # -- DCP's calls, in order ---------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            raise MemoryCheckpointError(
                "a memory checkpoint's step is given to its writer, not as checkpoint_id"
            )
        self._data_bytes = None
        self._metadata = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not is_coordinator:
            raise MemoryCheckpointError(_ALONE)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if len(plans) != 1:
            raise MemoryCheckpointError(_ALONE)
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # Values first: DCP serializes them only when asked, and their sizes place the
        # rest. Tensors are resolved one at a time, as they are copied.
        values = {
            item.index: _value_bytes(planner.resolve_data(item))
            for item in plan.items
            if item.type == WriteItemType.BYTE_IO
        }
        places, total = _place(plan.items, values)
        if self._space_check is not None:
            self._space_check(total)
        path = self._steps.data_path(self.step)
        fd = _create(self._steps, self.step)
        try:
            _reserve(fd, total, path)
            results = [
                self._write_item(fd, item, offset, values, planner)
                for item, offset in zip(plan.items, places, strict=True)
            ]
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        self._data_bytes = total
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_item(
        self,
        fd: int,
        item: WriteItem,
        offset: int,
        values: dict[MetadataIndex, bytes],
        planner: SavePlanner,
    ) -> WriteResult:
        if item.type == WriteItemType.BYTE_IO:
            data = values[item.index]
            _pwrite_all(fd, memoryview(data), offset)
            span = Span(offset, len(data))
        else:
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor):
                raise MemoryCheckpointError(f"{item.index.fqn}: DCP resolved it to no tensor")
            tensor = _host_dense(tensor, item.index.fqn)
            length = tensor.numel() * tensor.element_size()
            expected = _planned_bytes(item)
            if length != expected:
                raise MemoryCheckpointError(
                    f"{item.index.fqn}: {length} bytes resolved, the plan has {expected}"
                )
            _pwrite_all(fd, _bytes_of(tensor), offset)
            span = Span(offset, length, tensor.dtype, tuple(tensor.shape))
        return WriteResult(index=item.index, size_in_bytes=span.length, storage_data=span)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {r.index: r.storage_data for rank_results in results for r in rank_results}
        self._metadata = dataclasses.replace(metadata, storage_data=storage)
        if self._publish_on_finish:
            self.publish()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen from a checkpoint_id: it is given a directory and step

    # -- the end of a save -------------------------------------------------------------

    @property
    def data_bytes(self) -> int | None:
        """The size of the data file written (None before ``write_data``)."""
        return self._data_bytes

    def publish(self, before_marker: Callable[[int], object] | None = None) -> None:
        """Write the metadata, then the marker: the step is then complete for this rank;
        then, when the agent names a copier for this node (``buddy.json``), wait until
        it says the node's step is copied there (``RankSteps.wait_copied``), so that the
        step the caller removes next is never the last one held on two nodes.

        ``before_marker``: called with the step between the two (a seam for tests that
        kill the process there).

        Raises:
            MemoryCheckpointError: DCP has not finished the save.
            OSError: a file could not be written.
        """
        if self._metadata is None or self._data_bytes is None:
            raise MemoryCheckpointError(f"step {self.step} was not written: nothing to publish")
        text = encode_metadata(self._metadata).encode()
        with open(self._steps.meta_path(self.step), "wb") as fh:
            fh.write(text)
        if before_marker is not None:
            before_marker(self.step)
        steps = self._steps
        self._steps.publish(
            Marker(self.step, steps.rank, steps.world_size, self._data_bytes, len(text))
        )
        self._steps.wait_copied(self.step)

    def __repr__(self) -> str:
        return (
            f"MemoryStorageWriter(directory={self._steps.directory!r}, step={self.step}, "
            f"rank={self._steps.rank}, written={self._data_bytes is not None}, "
            f"finished={self._metadata is not None})"
        )


class MemoryStorageReader(StorageReader):
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
    ) -> None:
        super().__init__()
        self.step = step
        self._steps = _rank_steps(directory, rank, world_size)
        self._storage: dict[MetadataIndex, Span] = {}
        self._files: dict[MetadataIndex, str] = {}
        self._data_paths: dict[int, str] = {}  # rank -> its data file (set at read_metadata)
        self._where: dict[MetadataIndex, int] = {}

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
        if len(metas) == 1:
            ((rank, metadata),) = metas.items()
            self._where = dict.fromkeys((metadata.storage_data or {}), rank)
            return metadata
        metadata, self._where = merge_metadata(metas)
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not is_coordinator:
            raise MemoryCheckpointError(_ALONE)
        self._storage = dict(metadata.storage_data or {})
        self._files = {
            index: self._data_paths[rank]
            for index, rank in self._where.items()
            if rank in self._data_paths
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if len(plans) != 1:
            raise MemoryCheckpointError(_ALONE)
        return plans

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
                for item, span in items:
                    if item.type == LoadItemType.BYTE_IO:
                        buf = bytearray(span.length)
                        _pread_all(fh.fileno(), memoryview(buf), span.offset)
                        planner.load_bytes(item, io.BytesIO(buf))
                    else:
                        target = planner.resolve_tensor(item).detach()
                        _read_tensor(fh.fileno(), item, span, target)
                        planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def __repr__(self) -> str:
        return (
            f"MemoryStorageReader(directory={self._steps.directory!r}, step={self.step}, "
            f"rank={self._steps.rank}, pieces={sorted(self._data_paths)})"
        )


# -- layout -----------------------------------------------------------------------------


def _value_bytes(data: object) -> bytes:
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    raise MemoryCheckpointError(f"DCP resolved a value to a {type(data).__name__}, not bytes")


def _planned_bytes(item: WriteItem) -> int:
    """The bytes of the chunk a tensor item holds (its shard, not the whole tensor: DCP's
    ``tensor_storage_size`` counts the whole)."""
    data = item.tensor_data
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * torch.empty((), dtype=data.properties.dtype).element_size()


def _place(items: list[WriteItem], values: dict[MetadataIndex, bytes]) -> tuple[list[int], int]:
    """Each item's offset in the data file, in the plan's order, and the file's size."""
    offsets = []
    end = 0
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            length = len(values[item.index])
        else:
            length = _planned_bytes(item)
        offset = -(-end // ALIGN) * ALIGN
        offsets.append(offset)
        end = offset + length
    return offsets, end


# -- bytes in and out ---------------------------------------------------------------------


def _create(steps: RankSteps, step: int) -> int:
    """Open the rank's data file of ``step``: the rank's spare, written over (its pages
    are there: see ``RankSteps.remove``), else a new file. A peer on the node that
    removes an empty step directory may race the first file into it: the directory is
    made again."""
    path = steps.data_path(step)
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
    for attempt in range(3):
        steps.make_step_dir(step)
        try:
            if not steps.take_spare(path):
                flags |= os.O_TRUNC
            return os.open(path, flags, 0o600)
        except FileNotFoundError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _reserve(fd: int, size: int, path: str) -> None:
    """Allocate the file's memory now: on a full tmpfs this fails (ENOSPC) before a
    byte is copied, where writing through a mapping would end in SIGBUS. A spare file
    (see ``_create``) holds its pages already, up to its size: only a larger step
    allocates, and only the rest."""
    held = os.fstat(fd).st_size  # a spare's pages are allocated up to its size
    if held >= size:
        if held > size:
            os.ftruncate(fd, size)
        return
    try:
        os.posix_fallocate(fd, held, size - held)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            free = _free_bytes(os.path.dirname(path))
            raise CheckpointSpaceError(
                f"a memory checkpoint of {_size(size)} does not fit in "
                f"{os.path.dirname(os.path.dirname(path))} ({_size(free)} free)",
                needed=size,
                free=free,
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a file system that cannot preallocate


def _free_bytes(path: str) -> int:
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _host_dense(tensor: torch.Tensor, fqn: str) -> torch.Tensor:
    """``tensor`` as a contiguous tensor in host memory (a copy only where needed)."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise MemoryCheckpointError(f"{fqn}: a {tensor.layout} tensor cannot be saved in memory")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (valid while it lives)."""
    length = tensor.numel() * tensor.element_size()
    if length == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * length).from_address(tensor.data_ptr())).cast("B")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data[:_IO_MAX], offset)
        data, offset = data[n:], offset + n


def _pread_all(fd: int, into: memoryview, offset: int) -> None:
    while into:
        n = os.preadv(fd, [into[:_IO_MAX]], offset)
        if n == 0:
            raise MemoryCheckpointError(f"the data file ends at {offset}: truncated")
        into, offset = into[n:], offset + n


def _read_tensor(fd: int, item: ReadItem, span: Span, target: torch.Tensor) -> None:
    """Fill ``target`` with the part of the stored chunk ``item`` names."""
    if span.dtype is None or span.shape is None:
        raise MemoryCheckpointError(f"{item.storage_index.fqn}: stored as a value, not a tensor")
    whole = tuple(item.lengths) == span.shape and not any(item.storage_offsets)
    if (
        whole
        and target.device.type == "cpu"
        and target.dtype == span.dtype
        and target.is_contiguous()
        and tuple(target.shape) == span.shape
    ):
        _pread_all(fd, _bytes_of(target), span.offset)
        return
    buf = torch.empty(span.length, dtype=torch.uint8)
    _pread_all(fd, _bytes_of(buf), span.offset)
    stored = buf.view(span.dtype).reshape(span.shape)
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        stored = stored.narrow(dim, start, length)
    target.copy_(stored)
