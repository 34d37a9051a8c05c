"""One rank's steps in the node's checkpoint directory: which are complete, publishing
a step's marker, and removing steps.

Plain file operations, no torch: the layout and the marker are
:mod:`elastrun.wire.checkpoint`'s. Every rank of a node shares the step directories
and touches only its own files in them; the last rank to leave a step directory
removes it (a removal that finds another rank's file, or no directory, is not an error).
"""

from __future__ import annotations

import contextlib
import errno
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

    @property
    def spare_path(self) -> str:
        """Where this rank keeps the data file of a removed step, for its next step."""
        return os.path.join(self.directory, layout.spare_name(self.rank))

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

    def remove(self, step: int, *, spare: bool = False) -> None:
        """Remove this rank's files of ``step`` (the marker first, so that no reader
        takes the step for complete while its data goes), then the step's directory
        if no other rank has files left in it. ``spare``: keep the data file as this
        rank's spare (:attr:`spare_path`), unless it has one, for the next step to
        write over: its memory is allocated already, which a new file's is not (about
        a quarter of a save's time), and it counts as the step it replaces."""
        path = self.step_dir(step)
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return
        mine = [n for n in names if layout.rank_of_file(n) == self.rank]
        mine.sort(key=lambda n: not n.endswith(".done"))
        data = layout.data_name(self.rank)
        for name in mine:
            with contextlib.suppress(FileNotFoundError):
                if spare and name == data and not os.path.exists(self.spare_path):
                    os.replace(os.path.join(path, name), self.spare_path)
                else:
                    os.unlink(os.path.join(path, name))
        try:
            os.rmdir(path)
        except OSError as exc:
            # Another rank's files are still in it, or another rank removed it: fine.
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise

    def keep_only(self, keep: set[int]) -> None:
        """Remove this rank's files of every step not in ``keep`` (complete or not),
        keeping one data file as the spare."""
        for step in self.all_steps():
            if step not in keep:
                self.remove(step, spare=True)

    def take_spare(self, path: str) -> bool:
        """Move the spare data file to ``path``; False when there is none."""
        try:
            os.replace(self.spare_path, path)
        except FileNotFoundError:
            return False
        return True

    def make_spare(self, size: int) -> None:
        """Allocate a spare data file of ``size`` bytes if there is none (the first
        step has no older one to leave its file); a full file system leaves none."""
        if os.path.exists(self.spare_path) or size <= 0:
            return
        fd = os.open(self.spare_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            log.info("memory checkpoint: no spare data file of %d bytes (%s)", size, exc)
            os.close(fd)
            self.drop_spare()
            return
        os.close(fd)

    def drop_spare(self) -> None:
        """Free the spare data file (no next step is coming)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.spare_path)

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
