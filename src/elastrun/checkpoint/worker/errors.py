"""What memory checkpoints raise (no torch here: the size check's error is raised
before torch is asked for anything)."""

from __future__ import annotations

from elastrun.core.errors import ElastrunError

__all__ = ["CheckpointSpaceError", "MemoryCheckpointError"]


class MemoryCheckpointError(ElastrunError):
    """A memory checkpoint could not be saved or loaded, or was used in a way it does
    not support (the message says which, and what to do)."""


class CheckpointSpaceError(MemoryCheckpointError):
    """The node's shared memory cannot hold the checkpoints.

    ``needed`` and ``free`` are in bytes: what the node's ranks need (the newest step
    and the one in progress) and what the file system has free for it.
    """

    def __init__(self, message: str, *, needed: int, free: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free
