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

The writer is in ``storage_writer``, the reader in ``storage_reader``, what both use in
``storage_io``; this module names them.
"""

from __future__ import annotations

from elastrun.checkpoint.worker.storage_io import default_rank_and_world
from elastrun.checkpoint.worker.storage_reader import MemoryStorageReader
from elastrun.checkpoint.worker.storage_writer import MemoryStorageWriter

__all__ = ["MemoryStorageReader", "MemoryStorageWriter", "default_rank_and_world"]
