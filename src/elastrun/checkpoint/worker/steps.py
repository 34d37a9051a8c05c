"""One rank's steps in the node's checkpoint directory: which are complete, publishing
a step's marker, and removing steps; and the pieces of any rank that the node holds.

Plain file operations, no torch: the layout and the marker are
:mod:`elastrun.wire.checkpoint`'s. Every rank of a node shares the step directories
and touches only its own files in them; the last rank to leave a step directory
removes it (a removal that finds another rank's file, or no directory, is not an error).

Pieces of other ranks (a copy of another node's steps, or pieces the agent gathered
before the round) lie in ``copies/<node>/`` and ``gathered/``, which the agent alone
writes and removes: a rank reads them (:meth:`RankSteps.pieces`), never changes them.
A step is *loadable* here when the node holds what this rank needs of it: its own
piece when the world that saved it is this one's size, else every rank's piece (DCP
reshards from the union: :meth:`RankSteps.loadable_steps`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from collections.abc import Callable
from typing import NamedTuple

from elastrun.wire import checkpoint as layout
from elastrun.wire.checkpoint import Marker, MarkerError

__all__ = [
    "COPY_WAIT",
    "Piece",
    "RankSteps",
    "directory_usage",
    "read_buddy",
]

log = logging.getLogger("elastrun.checkpoint")

#: Seconds a rank's save waits for the buddy's copy of its step before it goes on without.
COPY_WAIT = 60.0


class Piece(NamedTuple):
    """One rank's files of one step, where the node holds them (``directory``: the
    step's directory, in the node's own steps, ``gathered/`` or ``copies/<node>/``)."""

    directory: str
    marker: Marker

    @property
    def data_path(self) -> str:
        return os.path.join(self.directory, layout.data_name(self.marker.rank))

    @property
    def meta_path(self) -> str:
        return os.path.join(self.directory, layout.meta_name(self.marker.rank))


def read_buddy(directory: str) -> layout.Buddy | None:
    """The agent's ``buddy.json`` in ``directory`` (None: none, or unreadable)."""
    try:
        with open(os.path.join(directory, layout.BUDDY_FILE), "rb") as fh:
            return layout.decode_buddy(fh.read())
    except (OSError, MarkerError):
        return None


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

    def make_step_dir(self, step: int) -> None:
        """Make the step's directory if missing (mode 0700)."""
        os.makedirs(self.step_dir(step), mode=0o700, exist_ok=True)

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
        vouches for have the sizes it names. None otherwise (said in the log)."""
        return _valid_marker(self.step_dir(step), step, self.rank, world_size=self.world_size)

    # -- pieces of any rank --------------------------------------------------------------

    def piece_dirs(self, step: int) -> list[str]:
        """The directories that may hold pieces of ``step``: the node's own step
        directory, then ``gathered/``'s, then each ``copies/<node>/``'s (sorted)."""
        name = layout.step_dir_name(step)
        dirs = (os.path.join(self.directory, b, name) for b in layout.piece_bases(self.directory))
        return [d for d in dirs if os.path.isdir(d)]

    def pieces(self, step: int) -> dict[int, dict[int, Piece]]:
        """Every valid piece of ``step`` that the node holds, by the size of the world
        that saved it, then by rank (the first found in :meth:`piece_dirs`' order)."""
        found: dict[int, dict[int, Piece]] = {}
        for directory in self.piece_dirs(step):
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            for name in names:
                rank = layout.rank_of_file(name)
                if rank is None or name != layout.marker_name(rank):
                    continue
                marker = _valid_marker(directory, step, rank)
                if marker is not None:
                    found.setdefault(marker.world_size, {}).setdefault(
                        rank, Piece(directory, marker)
                    )
        return found

    def every_step(self) -> list[int]:
        """Every step of which the node holds some piece, oldest first."""
        _own, *others = layout.piece_bases(self.directory)
        held = (s for b in others for s in layout.steps_in(os.path.join(self.directory, b)))
        return sorted({*self.all_steps(), *held})

    def needed(self, step: int) -> dict[int, Piece] | None:
        """The pieces this rank loads ``step`` from, when the node holds them: its own,
        saved by a world of this size; else every rank's of another world that saved
        the step (the largest such world, when pieces of several are here: a step
        number a smaller world saved again after a node was lost). None: neither."""
        by_world = self.pieces(step)
        own = by_world.get(self.world_size, {}).get(self.rank)
        if own is not None:
            return {self.rank: own}
        for world in sorted(by_world, reverse=True):
            if world != self.world_size and set(by_world[world]) == set(range(world)):
                return by_world[world]
        return None

    def loadable_steps(self) -> list[int]:
        """The steps this rank can load from the node's memory (:meth:`needed`), oldest
        first."""
        return [s for s in self.every_step() if self.needed(s) is not None]

    def _copied(self, path: str, step: int) -> bool:
        """Whether ``copied-<step>`` names this rank's piece as it is now (a word about
        an earlier writing of the step, before a restart, does not count)."""
        try:
            with open(path, "rb") as fh:
                copied = json.loads(fh.read())
            version = layout.piece_version(
                os.stat(self.marker_path(step)), os.stat(self.data_path(step))
            )
        except (OSError, ValueError):
            return False
        return isinstance(copied, dict) and copied.get(str(self.rank)) == version

    def wait_copied(
        self,
        step: int,
        *,
        timeout: float = COPY_WAIT,
        sleep: Callable[[float], object] = time.sleep,
    ) -> bool:
        """Wait until the agent says ``step`` of this node is copied to its buddy
        (``copied-<step>``, naming this rank's piece as it is now), when ``buddy.json``
        names a copier; True at once when it names none. False after ``timeout``
        seconds (said once per step).

        Why a poll: the file is written by another process, and a rank's background
        thread has nothing else to wait on; the first looks are 1 ms apart (a copy on a
        fast link takes milliseconds), later ones at most 20 ms."""
        path = os.path.join(self.directory, layout.copied_name(step))
        start = time.monotonic()
        pause = 0.001
        while not self._copied(path, step):
            buddy = read_buddy(self.directory)
            if buddy is None or buddy.copier is None:
                return True
            if time.monotonic() - start >= timeout:
                log.warning(
                    "memory checkpoint: step %d of rank %d is not copied to node %s after "
                    "%.0f s; it is kept without its copy (a loss of this node now loses it)",
                    step, self.rank, buddy.copier, timeout,
                )  # fmt: skip
                return False
            sleep(pause)
            pause = min(0.02, pause * 2)
        return True

    def complete_steps(self) -> list[int]:
        """The steps complete for this rank, oldest first."""
        return [s for s in self.all_steps() if self.marker(s) is not None]

    def publish(self, marker: Marker) -> None:
        """Write ``marker`` for its step: to a temporary name, then renamed into place,
        so that a reader sees the whole marker or none."""
        layout.replace_file(self.marker_path(marker.step), layout.encode_marker(marker))

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
            self.drop_spare()
        finally:
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


def _valid_marker(
    directory: str, step: int, rank: int, *, world_size: int | None = None
) -> Marker | None:
    """Rank ``rank``'s marker of ``step`` in ``directory`` when its files are whole;
    with ``world_size`` (the rank's own step directory, which the log leaves unnamed),
    only when a world of that size saved it."""
    what = f"step {step} of rank {rank}" + ("" if world_size is not None else f" in {directory}")
    try:
        with open(os.path.join(directory, layout.marker_name(rank)), "rb") as fh:
            marker = layout.decode_marker(fh.read())
    except FileNotFoundError:
        return None
    except (OSError, MarkerError) as exc:
        log.warning("%s: unreadable marker (%s)", what, exc)
        return None
    if world_size is not None and marker.world_size != world_size:
        problem: str | None = (
            f"it was saved by a world of {marker.world_size} ranks, this one has "
            f"{world_size} (it is loaded from every rank's pieces, when the node "
            f"holds them)"
        )
    else:
        problem = _piece_problem(directory, step, rank, marker)
    if problem is not None:
        log.warning("%s is not loadable: %s", what, problem)
        return None
    return marker


def _piece_problem(directory: str, step: int, rank: int, marker: Marker) -> str | None:
    """Why ``marker`` does not vouch for rank ``rank``'s files of ``step`` in
    ``directory`` (None: it does)."""
    if (marker.step, marker.rank) != (step, rank):
        return f"its marker names step {marker.step} of rank {marker.rank}"
    for name, size in ((layout.data_name(rank), marker.data_bytes),
                       (layout.meta_name(rank), marker.meta_bytes)):  # fmt: skip
        try:
            found = os.stat(os.path.join(directory, name)).st_size
        except OSError as exc:
            return f"{name}: {exc.strerror}"
        if found != size:
            return f"{name} has {found} bytes, its marker says {size}"
    return None


def directory_usage(directory: str) -> int:
    """Bytes of memory the files under ``directory`` hold (allocated blocks)."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total
