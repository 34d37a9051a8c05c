"""The thread that copies a source node's newly complete steps into this node, and
removes what the node no longer needs (``buddy`` starts one per round).

It lists the source's pieces (``serve.NodeClient``), each listing held by the source
until its steps changed since the last one, or ``LIST_HOLD`` seconds (``serve``: no
poll); a step of which every one of the source's ranks wrote its piece
(``holdings.next_to_copy``) is pulled into ``copies/<source>/step-<S>.tmp/``, checked
against a second listing (the same files: none written again meanwhile), renamed into
place and confirmed to the source, whose ranks' saves wait for that word. It keeps the
newest copy complete on every rank and the one that may become it
(``holdings.copies_to_keep``). Between two listings, at most once every ``TIDY_EVERY``
seconds (at least once every ``LIST_HOLD``), it also removes the copies of nodes no
longer its source, the pieces gathered before the round, and pieces its own steps hold
of ranks no longer the node's, once the node's ranks agreed on a newer step (a restart
would load that one or a newer).

Plain files, no torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from elastrun.checkpoint.agent.holdings import (
    Held,
    PeerError,
    copies_to_keep,
    copy_dir_name,
    drop_steps,
    newest_agreed,
    next_to_copy,
    scan,
)
from elastrun.core.cancel import CancelScope
from elastrun.core.threads import Nursery
from elastrun.observe.sinks import MetricSink
from elastrun.wire import checkpoint as layout

if TYPE_CHECKING:  # (the server's module loads http: only a job of several nodes needs it)
    from elastrun.checkpoint.agent.serve import NodeClient

__all__ = ["LIST_HOLD", "TIDY_EVERY", "Copier", "pull_piece"]

log = logging.getLogger("elastrun.agent")

#: The longest the source holds a listing while none of its steps changes (seconds).
LIST_HOLD = 2.0
#: After a look at the source that failed (or found no server yet): the first pause
#: before the next, in seconds, doubled at each failure in a row up to ``_RETRY_MAX``.
_RETRY_FIRST = 0.02
_RETRY_MAX = 0.5
#: The longest ``Copier.close`` waits for its thread (seconds).
CLOSE_WAIT = 2.0
#: Seconds between two removals of the pieces the node no longer needs.
TIDY_EVERY = 1.0
#: In a copy's step directory: the versions of the source's pieces it was made from.
_VERSIONS = "made-from.json"


class Copier:
    """The thread that copies a source node's newly complete steps, and removes the
    pieces the node no longer needs (see the module). With no source (the node is
    alone) it only removes.

    Args:
        directory: the node directory.
        ranks: the global ranks of the node's workers in this round.
        source: the node whose steps are copied here (None: none).
        connect: a client of the source's server (None: it published none yet).
        hold: the longest the source holds a listing while nothing changes (seconds).
        metrics: where each copy's duration and rate go.
    """

    def __init__(
        self,
        directory: str,
        ranks: Sequence[int],
        source: str | None,
        connect: Callable[[], NodeClient | None] | None,
        hold: float,
        metrics: MetricSink,
    ) -> None:
        self._directory = directory
        self._ranks = set(ranks)
        self._source = source
        self._connect = connect
        self._client: NodeClient | None = None
        self._hold = hold
        self._seen: str | None = None  # (the source's state at the last listing)
        self._metrics = metrics
        name = copy_dir_name(source) if source is not None else ""
        self._base = os.path.join(directory, layout.COPIES_DIR, name)
        self._nursery = Nursery(join_timeout=CLOSE_WAIT)
        self._failing: str | None = None

    def start(self) -> None:
        self._nursery.start(self._run, name="elastrun-checkpoint-copy")

    def close(self) -> None:
        """Stop copying, without waiting long: the next round must not wait on a source
        that stopped answering (a partitioned node holds a request until its timeout).
        A request in flight is cut; a thread still connecting ends on its own once the
        connection times out, and does nothing more (it sees the stop first)."""
        if not self._nursery.close() and self._client is not None:
            self._client.close()

    def _run(self, scope: CancelScope) -> None:
        tidied = -TIDY_EVERY
        pause = 0.0 if self._source is not None else TIDY_EVERY
        while True:
            scope.sleep(pause)  # (raises Cancelled when closed)
            if self._source is not None:
                pause = self._look(pause)
            if time.monotonic() - tidied >= TIDY_EVERY:
                tidied = time.monotonic()
                try:
                    self._tidy()
                except OSError as exc:
                    log.info("memory checkpoint: removing what the node no longer needs: %s", exc)

    def _look(self, pause: float) -> float:
        """One held listing of the source, and the copy it calls for: the pause before
        the next (none after a listing; growing while the source fails or has no server
        yet, said once)."""
        try:
            looked = self._copy_new()
        except (PeerError, OSError) as exc:
            if self._nursery.scope.cancelled:
                return pause  # (closing cut the held request: nothing to say)
            if self._failing is None:
                log.info("memory checkpoint: copying node %s's steps: %s", self._source, exc)
            self._failing = str(exc)
            looked = False
        else:
            self._failing = None
        return 0.0 if looked else min(_RETRY_MAX, max(_RETRY_FIRST, pause * 2))

    def _tidy(self) -> None:
        keep = self._base if self._source is not None else None
        agreed = newest_agreed(self._directory)
        _drop_foreign(self._directory, keep, agreed)
        _drop_left_behind(self._directory, self._ranks, agreed)

    def _copy_new(self) -> bool:
        """Whether the source was listed (False: it has no server yet)."""
        if self._client is None:
            self._client = self._connect() if self._connect is not None else None
            if self._client is None:
                return False  # (the source has not published its server yet)
            self._nursery.scope.on_cancel(self._client.abort)  # (closing cuts a request)
        listing = self._client.listing(after=self._seen, hold=self._hold)
        self._seen = listing.changes
        if self._nursery.scope.cancelled:
            return True  # (closed while it listed: the next round's copier takes over)
        own = [p for p in listing.pieces if p.own]
        self._drop_stale(own)
        copied = layout.steps_in(self._base)
        step = next_to_copy(own, listing.ranks, copied)
        if step is not None:
            self._copy(step, [p for p in own if p.step == step and p.rank in listing.ranks])
            listing = self._client.listing()
            self._seen = listing.changes
            own = [p for p in listing.pieces if p.own]
            copied = layout.steps_in(self._base)
        keep = copies_to_keep(copied, listing.newest, {p.step for p in own})
        drop_steps(self._base, set(copied) - keep)
        return True

    def _drop_stale(self, own: list[Held]) -> None:
        """Remove the copies of steps that the source wrote again since they were made
        (a restart loaded an older step and saved this one anew): a copy holds the
        versions of the pieces it was made from, and must match the source's."""
        listed: dict[int, dict[int, str]] = {}
        for p in own:
            listed.setdefault(p.step, {})[p.rank] = p.version
        for step in layout.steps_in(self._base):
            if step not in listed:
                continue  # (the source removed it: kept or dropped by copies_to_keep)
            where = os.path.join(self._base, layout.step_dir_name(step))
            made_from = _read_versions(where)
            if not made_from or any(
                listed[step].get(rank, version) != version for rank, version in made_from.items()
            ):
                shutil.rmtree(where, ignore_errors=True)

    def _copy(self, step: int, pieces: list[Held]) -> None:
        client = self._client
        assert client is not None  # (connected by the caller)
        t0 = time.monotonic()
        final = os.path.join(self._base, layout.step_dir_name(step))
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        moved = 0
        try:
            for piece in pieces:
                moved += pull_piece(client, piece, tmp)
            # The step still there, the same files: none was written again meanwhile.
            now = {(p.rank, p.version) for p in client.listing().pieces if p.step == step}
            if not {(p.rank, p.version) for p in pieces} <= now:
                raise PeerError(f"step {step} changed on node {self._source} while it was copied")
            with open(os.path.join(tmp, _VERSIONS), "w", encoding="utf-8") as fh:
                json.dump({str(p.rank): p.version for p in pieces}, fh)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        client.copied(step, {p.rank: p.version for p in pieces})
        took = time.monotonic() - t0
        self._metrics.put("checkpoint.copy.duration_ms", took * 1000)
        if took > 0:
            self._metrics.put("checkpoint.copy.bytes_per_second", moved / took)
        log.debug(
            "memory checkpoint: copied step %d of node %s (%d bytes)", step, self._source, moved
        )

    def __repr__(self) -> str:
        return f"Copier(source={self._source!r}, failing={self._failing!r})"


# -- files ---------------------------------------------------------------------------------


def pull_piece(client: NodeClient, piece: Held, dest: str) -> int:
    """Copy ``piece`` from the peer into the step directory ``dest``: data and metadata,
    then the marker, by a rename, so that a reader sees a whole piece or none. The
    bytes moved."""
    os.makedirs(dest, mode=0o700, exist_ok=True)
    rank = piece.rank
    client.fetch(piece.where, layout.data_name(rank), os.path.join(dest, layout.data_name(rank)),
                 piece.data_bytes)  # fmt: skip
    client.fetch(piece.where, layout.meta_name(rank), os.path.join(dest, layout.meta_name(rank)),
                 piece.meta_bytes)  # fmt: skip
    marker = layout.Marker(piece.step, rank, piece.world, piece.data_bytes, piece.meta_bytes)
    layout.replace_file(os.path.join(dest, layout.marker_name(rank)), layout.encode_marker(marker))
    return piece.data_bytes + piece.meta_bytes


def _read_versions(where: str) -> dict[int, str]:
    """The versions a copy was made from (empty: none recorded, or unreadable)."""
    try:
        with open(os.path.join(where, _VERSIONS), encoding="utf-8") as fh:
            doc = json.load(fh)
        return {int(rank): str(version) for rank, version in doc.items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _drop_left_behind(directory: str, ranks: set[int], agreed: int | None) -> None:
    """Remove the pieces, in the node's own steps older than ``agreed``, of ranks that
    are no longer this node's (``ranks``: its workers' now): a round that gave the node
    other ranks left them, and no worker of the node removes another rank's files."""
    if agreed is None or not ranks:
        return
    for piece in scan(directory):
        if piece.own and piece.step < agreed and piece.rank not in ranks:
            where = os.path.join(directory, piece.where)
            for name in (
                layout.marker_name(piece.rank),
                layout.data_name(piece.rank),
                layout.meta_name(piece.rank),
            ):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(where, name))
            with contextlib.suppress(OSError):
                os.rmdir(where)


def _drop_foreign(directory: str, source_dir: str | None, agreed: int | None) -> None:
    """Remove the pieces of steps older than ``agreed`` (the newest step the node's own
    ranks agreed on) from ``gathered/`` and from copies of nodes other than the current
    source (``source_dir``): a restart would load ``agreed`` or newer."""
    if agreed is None:
        return
    for base in [os.path.join(directory, b) for b in layout.piece_bases(directory)[1:]]:
        if source_dir is not None and os.path.abspath(base) == os.path.abspath(source_dir):
            continue
        drop_steps(base, [step for step in layout.steps_in(base) if step < agreed])
        with contextlib.suppress(OSError):
            os.rmdir(base)
