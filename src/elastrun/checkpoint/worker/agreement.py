"""The ranks' agreements of a memory checkpoint, through the workers' store.

The ranks of a ``MemoryCheckpoint`` settle three things together: whether a step is
complete on every rank (after each save, and before a persist), which step to load (the
newest that every rank holds complete), and that every rank is past a point (after a
load). Each is one *vote* in the workers' store, the one ``init_process_group`` connected
to (torch's default store, on a connection of the checkpoint's own): every rank adds one
to a counter of each token it votes for (``yes``; the steps it holds), then one to the
count of ranks here; the rank that makes that count the world's size sets ``done``,
which the others wait for. Each rank then reads the counts of its own tokens: a token
that every rank voted for has the world's size. So every rank reaches the same answer
from what it holds, and the store's work per vote is O(ranks), not O(ranks²) as with a
key per rank that every rank reads.

**Keys.** Under ``elastrun/checkpoint/<setup>/<vote>/``: ``<setup>`` is this rank's
count of checkpoints set up on this store (the same on every rank: they set up at the
same calls), so that a checkpoint set up again on the same store (another object, or
after its world was rebuilt) never reads an earlier one's keys; ``<vote>`` counts the
votes, which every rank casts in the same order (as collectives). A vote's keys go once
every rank has cast the next one (by then each has read them): the rank that created a
token's counter removes it, the rank that set ``done`` removes the count and ``done``.
So the keys of at most two votes are in the store at any time.

**Bounded.** A rank that died never comes: a vote waits at most ``timeout`` seconds for
the others. elastrun's agent closes a round's store when the round ends (a restart of
the group, an in-process round): the wait is cut at once then
(``torch.distributed.DistNetworkError``). A stop request (the world was rebuilt under
the checkpoint) is seen between two waits of at most ``WAIT_SLICE`` seconds: torch's
store client cannot be woken from another thread (the wait holds the client's lock, on
a socket that is not ours). What fails raises torch's own error, a ``RuntimeError``:
in-process recovery takes it for the failed collective it stands for.

Rejected: a gloo group of the checkpoint's own (made by every rank over the default
group, so made again after every in-process round at a point every rank reaches, a full
mesh of connections per rank, and one more group for a recovery to tear down); a key
per rank that every rank reads (O(ranks²) reads per vote); polling the store (a request
every few milliseconds per rank while a vote waits).
"""

from __future__ import annotations

import datetime
import logging
import socket
from collections.abc import Sequence
from typing import Protocol

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.clock import SYSTEM_CLOCK, Clock, Deadline

__all__ = [
    "AGREE_TIMEOUT",
    "REPORTED",
    "WAIT_SLICE",
    "Agreement",
    "VoteStore",
    "ended_with_world",
    "for_world",
    "setup_number",
]

log = logging.getLogger("elastrun.checkpoint")

#: The longest a vote waits for the other ranks. A backstop: elastrun's agent ends the
#: round (and closes its store) within seconds of a rank's death; it only bounds a rank
#: that is stuck, or a store that another launcher keeps open.
AGREE_TIMEOUT = 300.0
#: The longest one wait in the store takes before the stop request is looked at again.
#: (torch logs two lines when a wait times out: a slice ends only in a wait already
#: long.)
WAIT_SLICE = 5.0

#: The longest the check that the world's store is still there waits for its answer.
PROBE_TIMEOUT = 2.0
#: The steps of a rank that count in the vote on the step to load, the newest (a rank
#: holds at most two complete, more only if left by a writer other than
#: ``MemoryCheckpoint``).
REPORTED = 4

_ROOT = "elastrun/checkpoint/"


class VoteStore(Protocol):
    """What a vote uses of torch's ``Store`` (``torch.distributed.Store``)."""

    def add(self, key: str, value: int) -> int: ...

    def set(self, key: str, value: str) -> None: ...

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...

    def delete_key(self, key: str) -> bool: ...


def for_world(rank: int, world: int) -> Agreement:
    """The votes of this rank of the world that ``init_process_group`` made, on a
    connection of its own to that world's store (torch's default store, cloned).

    Raises:
        ValueError: the default process group is not initialized.
        RuntimeError: the store cannot be reached.
    """
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_store()
    if _server_gone(default):
        raise dist.DistNetworkError(
            "the world's store refuses connections: its server closed (the world ended)"
        )
    try:
        # attr-defined: torch's stubs lack ``clone`` (a new client of the same store)
        store: VoteStore = default.clone()  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # a store that cannot be cloned: share it
        store = default
    return Agreement(store, rank, world, setup_number(store, rank))


def _server_gone(store: object) -> bool:
    """Whether the TCP store server behind ``store`` refuses connections: it closed, as
    elastrun's agent closes a round's store when the round ends. torch's client, and
    so ``clone``, takes a refused connection for a server not up yet and tries again
    for twice the store's timeout (30 minutes each by default), which nothing can
    interrupt. False for other stores, and when the answer is not a refusal."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if not isinstance(store, TCPStore):
        return False
    try:
        socket.create_connection((store.host, store.port), timeout=PROBE_TIMEOUT).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # (no answer in time: the clone's own tries decide)
    return False


def ended_with_world(exc: BaseException) -> bool:
    """Whether a vote failed because its world ended: a stop request (the world was
    rebuilt under the checkpoint) or the store gone (elastrun's agent closes a round's
    store when the round ends: a restart of the group, an in-process round). Else a rank
    did not vote in time, or the store failed otherwise."""
    import torch.distributed as dist

    return isinstance(exc, (Cancelled, dist.DistNetworkError))


def setup_number(store: VoteStore, rank: int) -> int:
    """This rank's count of checkpoints set up on ``store``, this one included: the
    same on every rank of a world whose ranks set up at the same calls."""
    return store.add(f"{_ROOT}setups/{rank}", 1)


class Agreement:
    """The votes of one rank of a checkpoint's world (see the module).

    Args:
        store: the workers' store, on a connection of this rank's own (the votes wait
            on it from the checkpoint's background thread).
        rank, world: this rank and the world's size.
        setup: :func:`setup_number` of this checkpoint on ``store``.
        timeout: the longest a vote waits for the other ranks, in seconds.
        clock: for the votes' deadlines.

    One vote at a time: the votes of every rank come in the same order, from whichever
    of the checkpoint's threads holds them (the training thread's only while the
    background thread is idle).
    """

    def __init__(
        self,
        store: VoteStore,
        rank: int,
        world: int,
        setup: int,
        *,
        timeout: float = AGREE_TIMEOUT,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._store = store
        self.rank = rank
        self.world = world
        self._prefix = f"{_ROOT}{setup}/"
        self._timeout = timeout
        self._clock = clock
        self._stop = CancelScope(clock=clock)
        self._votes = 0
        # What this rank removes of the previous vote once every rank cast the next.
        self._leftover: list[str] = []

    def all_hold(self, here: bool) -> bool:
        """Whether every rank says ``here``.

        Raises:
            Cancelled: :meth:`cancel` was called (the world was rebuilt).
            RuntimeError: torch's ``DistError``: the store went away, or a rank did not
                vote within the timeout.
        """
        counts = self._vote(["yes"] if here else [])
        return here and counts["yes"] == self.world

    def newest_common(self, complete: Sequence[int]) -> int | None:
        """The newest of ``complete`` (this rank's complete steps, oldest first; the
        newest ``REPORTED`` count) that every rank holds complete (None: there is none).
        Raises as :meth:`all_hold`."""
        complete = complete[-REPORTED:]
        counts = self._vote([str(step) for step in complete])
        common = [step for step in complete if counts[str(step)] == self.world]
        if not common and complete:
            log.warning(
                "memory checkpoint: no step is complete on every rank (rank %d holds %s, "
                "on so many of %d ranks); starting without one",
                self.rank,
                {step: counts[str(step)] for step in complete},
                self.world,
            )
        return max(common, default=None)

    def barrier(self) -> None:
        """Until every rank is here. Raises as :meth:`all_hold`."""
        self._vote([])

    def cancel(self, reason: str) -> None:
        """Stop the vote in flight (at its next look, see the module) and every later
        one: they raise ``Cancelled``. Thread-safe."""
        self._stop.cancel(reason)

    def _vote(self, tokens: list[str]) -> dict[str, int]:
        """Cast a vote for ``tokens``: each one's count of ranks that voted for it,
        once every rank voted."""
        self._stop.raise_if_cancelled()
        store, key = self._store, f"{self._prefix}{self._votes}/"
        self._votes += 1
        created = [key + f"v/{t}" for t in tokens if store.add(key + f"v/{t}", 1) == 1]
        last = store.add(key + "n", 1) == self.world
        if last:
            store.set(key + "done", "1")
        else:
            self._wait(key + "done")
        counts = {t: store.add(key + f"v/{t}", 0) for t in tokens}
        # Every rank cast this vote: each is past reading the previous one.
        for old in self._leftover:
            store.delete_key(old)
        self._leftover = created + ([key + "n", key + "done"] if last else [])
        return counts

    def _wait(self, key: str) -> None:
        """Until ``key`` is set: in slices, looking at the stop request between them."""
        deadline = Deadline.after(self._timeout, self._clock)
        while True:
            self._stop.raise_if_cancelled()
            wait = min(WAIT_SLICE, max(deadline.remaining(), 0.001))
            try:
                self._store.wait([key], datetime.timedelta(seconds=wait))
            except RuntimeError as exc:
                if _timed_out(exc) and not deadline.expired():
                    continue
                if _timed_out(exc):
                    exc.add_note(
                        f"memory checkpoint: rank {self.rank} waited {self._timeout:.0f}s "
                        f"for the other ranks' vote"
                    )
                raise
            return

    def __repr__(self) -> str:
        return (
            f"Agreement(rank={self.rank}, world={self.world}, prefix={self._prefix!r}, "
            f"votes={self._votes}, stopped={self._stop.cancelled})"
        )


def _timed_out(exc: RuntimeError) -> bool:
    """Whether a store's wait ended at its timeout (torch's ``DistStoreError``), not
    because the store went away (``DistNetworkError``) or failed otherwise."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistStoreError)
