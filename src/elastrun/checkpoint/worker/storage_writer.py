"""``MemoryStorageWriter``: DCP's storage writer into the node's shared memory (see
``checkpoint.worker.storage``): the layout of a rank's data file, its room reserved
before a byte is copied, the copy of each item, and the metadata and the marker last.
With a ``Staging``, tensors on a GPU are copied into its pinned buffer, and written into
the data file when the step is published (``checkpoint.worker.staging``)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from elastrun.checkpoint.worker.errors import CheckpointSpaceError, MemoryCheckpointError
from elastrun.checkpoint.worker.metadata import Span, encode_metadata
from elastrun.checkpoint.worker.staging import Staging
from elastrun.checkpoint.worker.steps import RankSteps
from elastrun.checkpoint.worker.storage_io import (
    ALONE,
    Alone,
    bytes_of,
    planned_bytes,
    pwrite_all,
    rank_steps,
)
from elastrun.core.values import size_text
from elastrun.wire.checkpoint import Marker

__all__ = ["ALIGN", "MemoryStorageWriter"]

#: Items start at multiples of this in the data file (a cache line).
ALIGN = 64


class MemoryStorageWriter(Alone, StorageWriter):
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
        staging: where tensors on a device are copied (None: each is brought to the
            host and written at once, on the calling thread).

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
        staging: Staging | None = None,
    ) -> None:
        super().__init__()
        self.step = step
        self._steps = rank_steps(directory, rank, world_size)
        self._publish_on_finish = publish_on_finish
        self._space_check = space_check
        self._staging = staging
        self._staged: list[tuple[int, int]] = []  # (offset, length) in the staging buffer
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
        self._staged = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not is_coordinator:
            raise MemoryCheckpointError(ALONE)

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
                self._write_item(fd, item, (offset, total), values, planner)
                for item, offset in zip(plan.items, places, strict=True)
            ]
            if self._staging is not None:
                self._staging.wait()  # (the copies from a device into the buffer)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
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
        place: tuple[int, int],
        values: dict[MetadataIndex, bytes],
        planner: SavePlanner,
    ) -> WriteResult:
        offset, total = place  # (the item's offset, and the data file's size)
        if item.type == WriteItemType.BYTE_IO:
            data = values[item.index]
            pwrite_all(fd, memoryview(data), offset)
            span = Span(offset, len(data))
        else:
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor):
                raise MemoryCheckpointError(f"{item.index.fqn}: DCP resolved it to no tensor")
            _check_dense(tensor, item.index.fqn)
            length = tensor.nbytes
            expected = planned_bytes(item)
            if length != expected:
                raise MemoryCheckpointError(
                    f"{item.index.fqn}: {length} bytes resolved, the plan has {expected}"
                )
            if self._staging is not None and self._staging.takes(tensor):
                if length:
                    self._staging.copy_in(tensor.detach(), offset, total)
                    self._staged.append((offset, length))
            else:
                host = _host_dense(tensor)  # (held while its bytes are written)
                pwrite_all(fd, bytes_of(host), offset)
            span = Span(offset, length, tensor.dtype, tuple(tensor.shape))
        return WriteResult(index=item.index, size_in_bytes=span.length, storage_data=span)

    def _write_staged(self) -> None:
        """Write the staged tensors into the data file (on the thread that publishes;
        the buffer mirrors the file, so each is at its own offset in both)."""
        staged, self._staged = self._staged, []
        if not staged:
            return
        assert self._staging is not None
        fd = os.open(self._steps.data_path(self.step), os.O_WRONLY | os.O_CLOEXEC)
        try:
            for offset, length in staged:
                pwrite_all(fd, bytes_of(self._staging.region(offset, length)), offset)
        finally:
            os.close(fd)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {r.index: r.storage_data for rank_results in results for r in rank_results}
        self._metadata = dataclasses.replace(metadata, storage_data=storage)
        if self._publish_on_finish:
            self.publish()

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
        self._write_staged()
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


# -- layout -----------------------------------------------------------------------------


def _value_bytes(data: object) -> bytes:
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    raise MemoryCheckpointError(f"DCP resolved a value to a {type(data).__name__}, not bytes")


def _place(items: list[WriteItem], values: dict[MetadataIndex, bytes]) -> tuple[list[int], int]:
    """Each item's offset in the data file, in the plan's order, and the file's size."""
    offsets = []
    end = 0
    for item in items:
        length = (
            len(values[item.index]) if item.type == WriteItemType.BYTE_IO else planned_bytes(item)
        )
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
                f"a memory checkpoint of {size_text(size)} does not fit in "
                f"{os.path.dirname(os.path.dirname(path))} ({size_text(free)} free)",
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


def _check_dense(tensor: torch.Tensor, fqn: str) -> None:
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise MemoryCheckpointError(f"{fqn}: a {tensor.layout} tensor cannot be saved in memory")


def _host_dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous tensor in host memory (a copy only where needed)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()
