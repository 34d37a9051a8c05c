"""One rank's steps in the node's checkpoint directory: which are complete, publishing
a step's marker, and removing steps.

Plain file operations, no torch: the layout and the marker are
:mod:`elastrun.wire.checkpoint`'s. Every rank of a node shares the step directories
and touches only its own files in them; the last rank to leave a step directory
removes it (a removal that finds another rank's file, or no directory, is not an error).
"""

from __future__ import annotations

import contextlib
import logging
import os

from elastrun.wire import checkpoint as layout
from elastrun.wire.checkpoint import Marker, MarkerError

__all__ = [
    "RankSteps",
    "directory_usage",
]

log = logging.getLogger("elastrun.checkpoint")


class RankSteps:
    """The steps of rank ``rank`` (of ``world_size``) in the node directory ``directory``."""

    def __init__(self, directory: str, rank: int, world_size: int) -> None:
        self.directory = directory
        self.rank = rank
        self.world_size = world_size

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, layout.step_dir_name(step))

    def data_path(self, step: int) -> str:
        return os.path.join(self.step_dir(step), layout.data_name(self.rank))

    def meta_path(self, step: int) -> str:
        return os.path.join(self.step_dir(step), layout.meta_name(self.rank))

    def marker_path(self, step: int) -> str:
        return os.path.join(self.step_dir(step), layout.marker_name(self.rank))

    def make_step_dir(self, step: int) -> str:
        """The step's directory, made if missing (mode 0700)."""
        path = self.step_dir(step)
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def all_steps(self) -> list[int]:
        """Every step directory in the node directory (complete or not, any rank's)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(s for s in map(layout.step_of_dir, names) if s is not None)

    def marker(self, step: int) -> Marker | None:
        """This rank's marker of ``step`` when the step is complete for this rank: the
        marker exists, is of this version and of this rank and world, and the files it
        vouches for have the sizes it names. None otherwise (said at debug level)."""
        try:
            with open(self.marker_path(step), "rb") as fh:
                marker = layout.decode_marker(fh.read())
        except FileNotFoundError:
            return None
        except (OSError, MarkerError) as exc:
            log.warning("step %d of rank %d: unreadable marker (%s)", step, self.rank, exc)
            return None
        problem = self._problem(step, marker)
        if problem is not None:
            log.warning("step %d of rank %d is not loadable: %s", step, self.rank, problem)
            return None
        return marker

    def _problem(self, step: int, marker: Marker) -> str | None:
        if (marker.step, marker.rank) != (step, self.rank):
            return f"its marker names step {marker.step} of rank {marker.rank}"
        if marker.world_size != self.world_size:
            return (
                f"it was saved by a world of {marker.world_size} ranks, this one has "
                f"{self.world_size} (loading into another world size is not built yet)"
            )
        for path, size in ((self.data_path(step), marker.data_bytes),
                           (self.meta_path(step), marker.meta_bytes)):  # fmt: skip
            try:
                found = os.stat(path).st_size
            except OSError as exc:
                return f"{os.path.basename(path)}: {exc.strerror}"
            if found != size:
                return f"{os.path.basename(path)} has {found} bytes, its marker says {size}"
        return None

    def complete_steps(self) -> list[int]:
        """The steps complete for this rank, oldest first."""
        return [s for s in self.all_steps() if self.marker(s) is not None]

    def publish(self, marker: Marker) -> None:
        """Write ``marker`` for its step: to a temporary name, then renamed into place,
        so that a reader sees the whole marker or none."""
        final = self.marker_path(marker.step)
        tmp = final + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(layout.encode_marker(marker))
        os.replace(tmp, final)

    def remove(self, step: int) -> None:
        """Remove this rank's files of ``step`` (the marker first, so that no reader
        takes the step for complete while its data goes), then the step's directory
        if no other rank has files left in it."""
        path = self.step_dir(step)
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return
        mine = [n for n in names if layout.rank_of_file(n) == self.rank]
        mine.sort(key=lambda n: not n.endswith(".done"))
        for name in mine:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, name))
        # Not empty (another rank's files), or already gone: either is fine.
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(path)

    def keep_only(self, keep: set[int]) -> None:
        """Remove this rank's files of every step not in ``keep`` (complete or not)."""
        for step in self.all_steps():
            if step not in keep:
                self.remove(step)

    def __repr__(self) -> str:
        return (
            f"RankSteps(directory={self.directory!r}, rank={self.rank}, "
            f"world_size={self.world_size})"
        )


def directory_usage(directory: str) -> int:
    """Bytes of memory the files under ``directory`` hold (allocated blocks)."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total
