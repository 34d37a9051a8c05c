"""Memory checkpoints that outlive the node: a buddy's copy, and the pieces a round needs.

``NodeCopies`` is the agent's part for it, told of each round before the round's workers
start (``start_round``). It

1. serves the node directory to the other agents (``serve.NodeServer``, on the node's
   address, a token only the rendezvous store carries, published there bound to the
   node's lease: a lost node's entry goes with it);
2. writes ``buddy.json`` for the node's ranks: the node that copies their steps (the
   next in the round's group-rank order, ``holdings.buddy_roles``), so that each save
   waits for the copy before the step it replaces is removed;
3. makes sure the node holds what its ranks will load: it lists every live node's
   pieces, finds the newest step complete in the job (``holdings.newest_complete``) and
   pulls the pieces its ranks need and lack -- their own (a world of the same size: a
   spare that takes a lost node's place) or every rank's (another size: DCP reshards)
   -- into ``gathered/``;
4. starts its ``copier``: a thread that copies each newly complete step of its source
   node (the previous one) into ``copies/<source>/``, tells the source, and removes the
   copies and pieces the node no longer needs.

**Memory.** A node holds its ranks' steps (the newest complete, one in progress), its
source's copy (the newest complete, one arriving) and, after a node was lost, the
pieces it kept or gathered for the round until its ranks agree on a newer step.

The agent never imports torch: pieces are files, moved as bytes.

The listing and the pulls before a round run on the loop's thread, each request bounded
by ``serve.TIMEOUT``; a stop request (the thread's current cancel scope) ends them
between two requests, and the loop sees it at its next wait.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from elastrun.checkpoint.agent.copier import LIST_HOLD, Copier, pull_piece
from elastrun.checkpoint.agent.holdings import (
    Held,
    Listing,
    PeerError,
    buddy_roles,
    drop_steps,
    newest_complete,
    pieces_to_pull,
    scan,
)
from elastrun.checkpoint.agent.node_dir import NodeCheckpointDir
from elastrun.core import cancel
from elastrun.core.errors import ElastrunError, StoreError
from elastrun.observe.sinks import EventSink, MetricSink
from elastrun.rendezvous.api import RendezvousInfo
from elastrun.rendezvous.elastic import StoreSeat
from elastrun.wire import checkpoint as layout

if TYPE_CHECKING:  # (loaded when a round has several nodes: the server's module loads http)
    from elastrun.checkpoint.agent.serve import NodeClient, NodeServer

__all__ = ["NodeCopies", "serve_key"]

log = logging.getLogger("elastrun.agent")

#: A node's published server: its address, port and token.
_Server = tuple[str, int, str]


def serve_key(prefix: str, node: str) -> str:
    """Where ``node`` publishes its checkpoint server in the run's store."""
    return f"{prefix}ckpt/serve/{node}"


class NodeCopies:
    """The node's part in the job's copies of its memory checkpoints (see the module).

    Args:
        node_dir: the node directory (made before the first round).
        seat: this node's place in the run's store (None: no store of ours, so no
            copies: a torch-style rendezvous).
        events, metrics: where what was copied and gathered is recorded.
        hold: the longest the source holds the copier's listing while none of its
            steps changes (seconds).
    """

    def __init__(
        self,
        node_dir: NodeCheckpointDir,
        seat: Callable[[], StoreSeat | None],
        events: EventSink,
        metrics: MetricSink,
        hold: float = LIST_HOLD,
    ) -> None:
        self._node_dir = node_dir
        self._seat = seat
        self._events = events
        self._metrics = metrics
        self._hold = hold
        self._token = secrets.token_hex(16)
        self._server: NodeServer | None = None
        self._copier: Copier | None = None
        self._shape: tuple[tuple[str, ...], tuple[int, ...], int] | None = None  # (gathered for)
        self._closed = False
        node_dir.on_close(self.close)

    def start_round(self, info: RendezvousInfo, ranks: Sequence[int], world_size: int) -> None:
        """A round is formed and its workers are about to start (``ranks``: their global
        ranks, of ``world_size``): serve, name the copier, gather, copy. Never raises:
        what fails is logged (the round goes on; its ranks load what their node holds)."""
        directory = self._node_dir.path
        if directory is None or self._closed:
            return
        self._stop_copier()
        try:
            self._start_round(directory, info, ranks, world_size)
        except (ElastrunError, OSError) as exc:
            log.warning("memory checkpoints are not copied to another node this round: %s", exc)

    def _start_round(
        self, directory: str, info: RendezvousInfo, ranks: Sequence[int], world_size: int
    ) -> None:
        seat = self._seat()
        if seat is None:
            return  # (no store of ours to meet the other nodes in)
        order = [m.node_id for m in info.members]
        alone = len(order) < 2  # (nobody to serve, nobody to copy: no server yet)
        if not alone:
            self._serve(directory, seat, ranks)
        copier, source = buddy_roles(order, seat.node)
        buddy = layout.encode_buddy(layout.Buddy(info.round, copier, source))
        layout.replace_file(os.path.join(directory, layout.BUDDY_FILE), buddy)
        # Only the round's members: a node that left it (partitioned, or lost with its
        # lease not yet expired) may still have its address in the store, and would
        # hold this round up by a listing's timeout.
        peers = {} if alone else {n: a for n, a in self._peers(seat).items() if n in order}
        # The same nodes in the same order, with the same ranks here: a plain restart,
        # after which every rank's pieces are where they were (its own node).
        shape = (tuple(order), tuple(ranks), world_size)
        if shape != self._shape and self._gather(directory, peers, ranks, world_size):
            self._shape = shape
        self._copier = Copier(
            directory,
            ranks,
            source,
            (lambda: self._client_of(seat, source)) if source is not None else None,
            self._hold,
            self._metrics,
        )
        self._copier.start()

    def close(self) -> None:
        """Stop copying and serving (idempotent; never raises, never waits on the store).

        The address stays in the store until the node's lease goes, when the node leaves
        the rendezvous (or it expires): deleting it here could wait on a store that is
        gone, and a peer that finds no server meanwhile only fails to list it."""
        self._closed = True
        self._stop_copier()
        server, self._server = self._server, None
        if server is not None:
            server.close()

    # -- serving ---------------------------------------------------------------------------

    def _serve(self, directory: str, seat: StoreSeat, ranks: Sequence[int]) -> None:
        from elastrun.checkpoint.agent.serve import NodeServer

        if self._server is None:
            self._server = NodeServer(directory, seat.node, seat.addr, self._token)
        self._server.set_ranks(ranks)
        port = self._server.start()
        # (An earlier round's word on copies stays: it names the versions it copied, and
        # a rank waits for its own piece's; workers kept in place may be waiting now.)
        doc = {"addr": seat.addr, "port": port, "token": self._token}
        seat.store.set(
            serve_key(seat.prefix, seat.node), json.dumps(doc).encode(), lease=seat.lease
        )

    def _peers(self, seat: StoreSeat) -> dict[str, _Server]:
        """Every other live node's server, by node id."""
        prefix = serve_key(seat.prefix, "")
        try:
            entries, _rev = seat.store.get_prefix(prefix)
        except StoreError as exc:
            log.warning("memory checkpoints: the other nodes' servers cannot be read: %s", exc)
            return {}
        peers = {}
        for key, raw in entries.items():
            node, server = key[len(prefix) :], _server(raw)
            if node != seat.node and server is not None:
                peers[node] = server
        return peers

    def _client_of(self, seat: StoreSeat, node: str) -> NodeClient | None:
        """A client of ``node``'s server (None: it has not published one yet)."""
        from elastrun.checkpoint.agent.serve import NodeClient

        try:
            raw = seat.store.get(serve_key(seat.prefix, node))
        except StoreError:
            return None
        server = None if raw is None else _server(raw)
        return None if server is None else NodeClient(*server)

    # -- gathering -------------------------------------------------------------------------

    def _gather(
        self,
        directory: str,
        peers: dict[str, _Server],
        ranks: Sequence[int],
        world_size: int,
    ) -> bool:
        """Pull the pieces of the job's newest complete step that the node's ranks need
        and its directory lacks (see the module); whether every one is here now."""
        local = scan(directory)
        scope = cancel.current()
        listings = self._listings(peers)
        target = newest_complete(
            [local, *(li.pieces for li in listings.values())], prefer=world_size
        )
        if target is None:
            return True
        step, world = target
        needed = set(ranks) if world == world_size else set(range(world))
        pulls = pieces_to_pull(
            step, world, needed, local, {n: li.pieces for n, li in listings.items()}
        )
        gathered = os.path.join(directory, layout.GATHERED_DIR)
        drop_steps(gathered, [s for s in layout.steps_in(gathered) if s != step])
        if not pulls:
            return True
        from elastrun.checkpoint.agent.serve import NodeClient

        t0 = time.monotonic()
        moved = 0
        done: list[tuple[str, Held]] = []
        dest = os.path.join(gathered, layout.step_dir_name(step))
        for peer, piece in pulls:
            if scope.cancelled:
                return False
            try:
                with contextlib.closing(NodeClient(*peers[peer])) as client:
                    moved += pull_piece(client, piece, dest)
                done.append((peer, piece))
            except (PeerError, OSError) as exc:
                log.warning(
                    "memory checkpoint: rank %d's piece of step %d could not be pulled from "
                    "node %s: %s", piece.rank, step, peer, exc,
                )  # fmt: skip
        took = time.monotonic() - t0
        log.info(
            "memory checkpoint: pulled rank(s) %s of step %d from node(s) %s (%.1f MiB in "
            "%.0f ms) for this node's ranks",
            ", ".join(str(p.rank) for _, p in done), step,
            ", ".join(sorted({n for n, _ in done})), moved / 2**20, took * 1000,
        )  # fmt: skip
        self._events.record(
            "agent.checkpoint_gathered",
            {"step": step, "ranks": ",".join(str(p.rank) for _, p in done), "bytes": moved,
             "duration_ms": round(took * 1000, 3)},
        )  # fmt: skip
        self._metrics.put("checkpoint.gather.duration_ms", took * 1000)
        return len(done) == len(pulls)

    def _listings(self, peers: dict[str, _Server]) -> dict[str, Listing]:
        """What each peer that answers holds (a lost node's stale entry does not)."""
        if not peers:
            return {}
        from elastrun.checkpoint.agent.serve import NodeClient

        listings: dict[str, Listing] = {}
        scope = cancel.current()
        for peer, server in sorted(peers.items()):
            if scope.cancelled:
                break
            try:
                with contextlib.closing(NodeClient(*server)) as client:
                    listings[peer] = client.listing()
            except PeerError as exc:
                log.debug("memory checkpoints: node %s not listed: %s", peer, exc)
        return listings

    def _stop_copier(self) -> None:
        copier, self._copier = self._copier, None
        if copier is not None:
            copier.close()

    def __repr__(self) -> str:
        return (
            f"NodeCopies(server={self._server!r}, copier={self._copier!r}, closed={self._closed})"
        )


def _server(raw: bytes) -> _Server | None:
    """The address, port and token a node published for its server (None: nonsense)."""
    try:
        doc = json.loads(raw)
        return str(doc["addr"]), int(doc["port"]), str(doc["token"])
    except (ValueError, KeyError, TypeError):
        return None
