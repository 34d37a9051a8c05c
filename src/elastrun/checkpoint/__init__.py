"""Memory checkpoints: ``torch.distributed.checkpoint`` in the node's shared memory,
which outlives the workers, so a restarted group resumes from the newest step.

    import elastrun.checkpoint

    ckpt = elastrun.checkpoint.MemoryCheckpoint()
    step = ckpt.load_latest(state)        # the newest step every rank holds, or None
    ...
    ckpt.save(step, state)                # every step: the copy blocks, the rest does not

``MemoryStorageWriter`` and ``MemoryStorageReader`` are the storage layer underneath,
for ``dcp.save``/``dcp.load`` called directly. See docs/checkpoints.md.

This package holds both sides of the concept: ``elastrun.checkpoint.worker`` (the
workers', which imports torch) and ``elastrun.checkpoint.agent`` (the agent's, which
makes the node's directory and never imports torch). The names below load when first
read: importing the package loads neither side.
"""

from __future__ import annotations

from elastrun.core.lazy import lazy_getattr

# As in elastrun/__init__.py: not typing.TYPE_CHECKING, so that workers skip typing.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from elastrun.checkpoint.worker.errors import CheckpointSpaceError, MemoryCheckpointError
    from elastrun.checkpoint.worker.memory import MemoryCheckpoint
    from elastrun.checkpoint.worker.storage import MemoryStorageReader, MemoryStorageWriter

__getattr__ = lazy_getattr(
    __name__,
    {
        "CheckpointSpaceError": "elastrun.checkpoint.worker.errors",
        "MemoryCheckpointError": "elastrun.checkpoint.worker.errors",
        "MemoryCheckpoint": "elastrun.checkpoint.worker.memory",
        "MemoryStorageReader": "elastrun.checkpoint.worker.storage",
        "MemoryStorageWriter": "elastrun.checkpoint.worker.storage",
    },
)

__all__ = [
    "CheckpointSpaceError",
    "MemoryCheckpoint",
    "MemoryCheckpointError",
    "MemoryStorageReader",
    "MemoryStorageWriter",
]
