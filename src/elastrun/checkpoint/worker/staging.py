"""``Staging``: where a save copies the tensors that live on a GPU, so that the training
thread waits only for that copy.

A tensor on a device is copied into one pinned host buffer that the checkpoint keeps
from save to save (a device-to-host copy into pinned memory runs at the bus's speed;
into ordinary memory it is staged by the driver and allocates anew each time). The
copies run without waiting, one after another on the current stream, and the save waits
once for all of them. Their writes into the node's shared memory are left to the
background thread, before the step's metadata and marker (``MemoryStorageWriter
.publish``): a step is complete only once they are in.

At most one save is in flight (``MemoryCheckpoint``), so one buffer serves every save:
the next one copies into it only after the background thread wrote the last one out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Staging"]


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class Staging:
    """One host buffer for the device tensors of a save, kept across saves.

    Args:
        allocate: makes a buffer of so many bytes (pinned memory; tests pass another).
        host_too: stage host tensors as well (tests on a machine without a GPU).
    """

    def __init__(
        self,
        allocate: Callable[[int], torch.Tensor] = _pinned,
        *,
        host_too: bool = False,
    ) -> None:
        self._allocate = allocate
        self._host_too = host_too
        self._buffer: torch.Tensor | None = None
        self._copying: set[torch.device] = set()  # CUDA devices with copies in flight

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` goes through the buffer (it lives on a device)."""
        return tensor.device.type != "cpu" or self._host_too

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The buffer, of at least ``nbytes`` bytes (a larger one replaces a smaller)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # (the old one freed before the new one is made)
            self._buffer = self._allocate(nbytes)
        return self._buffer

    def copy_in(self, tensor: torch.Tensor, offset: int, total: int) -> None:
        """Copy ``tensor`` into the buffer (of at least ``total`` bytes) at ``offset``,
        which is aligned for its dtype; from a CUDA device without waiting (see
        :meth:`wait`)."""
        length = tensor.nbytes
        into = self.buffer(total)[offset : offset + length].view(tensor.dtype)
        into.view(tensor.shape).copy_(tensor, non_blocking=self._async(tensor.device))

    def copy_out(self, stored: torch.Tensor, target: torch.Tensor) -> None:
        """Copy ``stored`` (a view of the buffer) into ``target``, and wait for it."""
        target.copy_(stored, non_blocking=self._async(target.device))
        self.wait()

    def wait(self) -> None:
        """Until the copies issued since the last wait are done."""
        copying, self._copying = self._copying, set()
        for device in copying:
            torch.cuda.synchronize(device)

    def region(self, offset: int, length: int) -> torch.Tensor:
        """The buffer's bytes at ``offset`` (the buffer is made already)."""
        assert self._buffer is not None, "nothing was staged"
        return self._buffer[offset : offset + length]

    def _async(self, device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        self._copying.add(device)
        return True

    @property
    def held(self) -> int:
        """The bytes the buffer holds (0: none made yet)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def release(self) -> None:
        self._buffer = None

    def __repr__(self) -> str:
        return f"Staging(held={self.held})"
