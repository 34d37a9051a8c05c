"""What a node holds of the memory checkpoints, and the decisions made from it: who
copies whom, which step is complete in the job, what to pull, which copies to keep.

A *piece* is one rank's files of one step (data, metadata, marker:
:mod:`elastrun.wire.checkpoint`'s layout), wherever the node holds it: in its own steps
(written by its workers), in ``copies/<node>/`` (a copy of another node's steps) or in
``gathered/`` (pulled before a round). :func:`scan` lists a node directory's pieces with
valid markers (their files of the sizes the marker names); everything else here is a
pure function of such lists, so every agent that reads the same lists decides the same.

**Buddies.** In a round's group-rank order, each node's steps are copied by the next
node (its *copier*), and it copies the previous one's (its *source*): every node is one
node's buddy, and the loss of any one node leaves a copy of its steps on another. The
next round re-picks, so a lost buddy is replaced by another node.

**The newest complete step** of the job is the newest step of which the live nodes hold,
together, a piece of every rank of the world that saved it: the step every rank loads.

Plain files and JSON, no torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from elastrun.core.errors import ElastrunError
from elastrun.wire import checkpoint as layout
from elastrun.wire.checkpoint import MarkerError, RankReport, ReportError

__all__ = [
    "Held",
    "buddy_roles",
    "copies_to_keep",
    "copy_dir_name",
    "newest_complete",
    "next_to_copy",
    "pieces_to_pull",
    "scan",
]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class Held(NamedTuple):
    """One valid piece: its step, rank and the world that saved it, where it lies
    (``where``: the step directory's path relative to the node directory), its files'
    sizes, and ``version``, which changes when the piece is written again."""

    step: int
    rank: int
    world: int
    where: str
    data_bytes: int
    meta_bytes: int
    version: str

    @property
    def own(self) -> bool:
        """Written by the node's own workers (not a copy, not gathered)."""
        return self.where == layout.step_dir_name(self.step)


def copy_dir_name(node: str) -> str:
    """The directory under ``copies/`` for ``node``'s pieces: its id made safe for a
    file name, with a short hash of the id so that two ids never share one."""
    digest = hashlib.sha256(node.encode()).hexdigest()[:8]
    return f"{_UNSAFE.sub('_', node)[:40]}-{digest}"


def buddy_roles(order: Sequence[str], node: str) -> tuple[str | None, str | None]:
    """``node``'s copier (the next node of ``order``, the round's group-rank order,
    wrapping round) and its source (the previous one); both None when ``node`` is
    alone or not in ``order``."""
    if node not in order or len(order) < 2:
        return None, None
    i = order.index(node)
    return order[(i + 1) % len(order)], order[(i - 1) % len(order)]


def newest_complete(
    holdings: Iterable[Iterable[Held]], prefer: int | None = None
) -> tuple[int, int] | None:
    """The newest ``(step, world)`` of which ``holdings`` (each node's pieces) hold a
    piece of every rank of ``world`` together (None: none is complete). Of one step
    complete for several worlds, the world of size ``prefer`` (the one that will load
    it: its ranks need only their own pieces), else the largest."""
    ranks: dict[tuple[int, int], set[int]] = {}
    for pieces in holdings:
        for p in pieces:
            ranks.setdefault((p.step, p.world), set()).add(p.rank)
    complete = [key for key, got in ranks.items() if got == set(range(key[1]))]
    if not complete:
        return None
    return max(complete, key=lambda key: (key[0], key[1] == prefer, key[1]))


def pieces_to_pull(
    step: int,
    world: int,
    needed: Iterable[int],
    local: Iterable[Held],
    peers: Mapping[str, Iterable[Held]],
) -> list[tuple[str, Held]]:
    """The pieces of ``step`` (saved by ``world``) of the ranks ``needed`` that
    ``local`` lacks, each with a peer that holds it (the first in ``peers``' order that
    does, preferring a peer's own piece to its copy). A rank no peer holds is left out."""
    have = {p.rank for p in local if (p.step, p.world) == (step, world)}
    pulls = []
    for rank in sorted(set(needed) - have):
        offers = [
            (not p.own, node, p)
            for node, pieces in peers.items()
            for p in pieces
            if (p.step, p.rank, p.world) == (step, rank, world)
        ]
        if offers:
            _, node, piece = min(offers, key=lambda o: (o[0], list(peers).index(o[1])))
            pulls.append((node, piece))
    return pulls


def next_to_copy(source: Iterable[Held], ranks: Iterable[int], copied: Iterable[int]) -> int | None:
    """The step to copy next from a source whose own pieces are ``source`` and whose
    workers have the global ``ranks``: the newest step of which every one of them holds
    its piece, if newer than every step ``copied`` already (None: nothing to copy)."""
    wanted = set(ranks)
    if not wanted:
        return None
    by_step: dict[int, set[int]] = {}
    for p in source:
        if p.own:
            by_step.setdefault(p.step, set()).add(p.rank)
    whole = [step for step, got in by_step.items() if wanted <= got]
    if not whole:
        return None
    step = max(whole)
    done = list(copied)
    return step if not done or step > max(done) else None


def copies_to_keep(copied: Iterable[int], agreed: int | None, listed: Iterable[int]) -> set[int]:
    """Which copies of a source's steps to keep: the newest of those complete on every
    rank (at most ``agreed``, the newest step the source's ranks agreed on; the one a
    restart would load), and any newer one that the source still holds (its step may
    yet be agreed on; one the source removed never will)."""
    steps = set(copied)
    still = set(listed)
    keep = {s for s in steps if (agreed is None or s > agreed) and s in still}
    done = [s for s in steps if agreed is not None and s <= agreed]
    if done:
        keep.add(max(done))
    return keep


# -- reading a node directory -----------------------------------------------------------


def scan(directory: str) -> list[Held]:
    """Every piece with a valid marker under the node directory ``directory``: its own
    steps, ``gathered/`` and ``copies/<node>/``."""
    return [held for rel in _step_dirs(directory) for held in _pieces_in(directory, rel)]


def _step_dirs(directory: str) -> list[str]:
    """The step directories under ``directory``, relative to it."""
    return sorted(
        f"{base}/{n}" if base else n
        for base in layout.piece_bases(directory)
        for n in listdir(os.path.join(directory, base))
        if layout.step_of_dir(n) is not None
    )


def _pieces_in(directory: str, rel: str) -> list[Held]:
    step = layout.step_of_dir(os.path.basename(rel))
    assert step is not None  # (listed as a step directory)
    path = os.path.join(directory, rel)
    held = []
    for name in listdir(path):
        rank = layout.rank_of_file(name)
        if rank is None or name != layout.marker_name(rank):
            continue
        try:
            with open(os.path.join(path, name), "rb") as fh:
                marker_stat = os.fstat(fh.fileno())
                marker = layout.decode_marker(fh.read())
            data = os.stat(os.path.join(path, layout.data_name(rank)))
            meta = os.stat(os.path.join(path, layout.meta_name(rank)))
        except (OSError, MarkerError):
            continue
        if (marker.step, marker.rank) != (step, rank):
            continue
        if (data.st_size, meta.st_size) != (marker.data_bytes, marker.meta_bytes):
            continue
        version = layout.piece_version(marker_stat, data)
        held.append(
            Held(step, rank, marker.world_size, rel, marker.data_bytes, marker.meta_bytes, version)
        )
    return held


def drop_steps(base: str, steps: Iterable[int]) -> None:
    """Remove the step directories of ``steps`` in ``base`` (what cannot go stays)."""
    for step in steps:
        shutil.rmtree(os.path.join(base, layout.step_dir_name(step)), ignore_errors=True)


def listdir(path: str) -> list[str]:
    """The names in the directory ``path`` (none: it cannot be read)."""
    with contextlib.suppress(OSError):
        return os.listdir(path)
    return []


class PeerError(ElastrunError):
    """A peer's node directory could not be read (it is gone, or answered nonsense)."""


@dataclass(frozen=True, repr=False)
class Listing:
    """What a node said it holds (``GET /list``); ``changes``: what names this state of
    its steps, for a later listing held until they change (``serve``)."""

    node: str
    ranks: tuple[int, ...]
    newest: int | None
    pieces: list[Held]
    changes: str = ""

    def __repr__(self) -> str:
        return (
            f"Listing(node={self.node!r}, ranks={self.ranks}, newest={self.newest}, "
            f"pieces={len(self.pieces)}, changes={self.changes!r})"
        )


def read_reports(
    directory: str, skipped: Callable[[str, Exception], object] | None = None
) -> list[RankReport]:
    """The ranks' reports in the node directory ``directory`` (none: it cannot be read),
    by name; ``skipped`` is told of each one that cannot be read (but one gone since it
    was listed)."""
    reports = []
    for name in sorted(listdir(directory)):
        if layout.rank_of_report(name) is None:
            continue
        try:
            with open(os.path.join(directory, name), "rb") as fh:
                reports.append(layout.decode_report(fh.read()))
        except FileNotFoundError:
            continue
        except (OSError, ReportError) as exc:
            if skipped is not None:
                skipped(name, exc)
    return reports


def newest_agreed(directory: str) -> int | None:
    """The newest step the node's ranks last reported complete on every rank (their
    reports in ``directory``; None: none reported one)."""
    return max((r.newest for r in read_reports(directory) if r.newest is not None), default=None)
