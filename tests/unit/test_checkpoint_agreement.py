"""The ranks' agreements of a memory checkpoint through the workers' store
(``checkpoint.worker.agreement``): every rank reaches the same answer, a rank that
never votes holds the others a bounded time, the store's keys do not grow, and a
failed vote that the end of the world explains stops the saves without an error."""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest

from elastrun.checkpoint.worker import agreement
from elastrun.checkpoint.worker.agreement import Agreement, ended_with_world, setup_number
from elastrun.core.cancel import Cancelled
from elastrun.testing import FakeClock

if TYPE_CHECKING:
    import torch.distributed as dist
else:
    dist = pytest.importorskip("torch.distributed")

from torch._C._distributed_c10d import HashStore, PrefixStore, TCPStore

from elastrun.checkpoint import MemoryCheckpointError
from elastrun.checkpoint.worker.finishing import Finisher
from elastrun.checkpoint.worker.persisting import PersistScheduler
from elastrun.checkpoint.worker.report import RankReporter
from elastrun.checkpoint.worker.steps import RankSteps
from elastrun.store.torchwire import TorchWireServer

T = TypeVar("T")


def _ranks(world: int, vote: Callable[[Agreement], T], timeout: float = 30.0) -> list[T]:
    """Each rank of a world of ``world`` votes on a thread of its own, through one
    in-memory store: the answers, by rank."""
    store = HashStore()
    votes = [
        Agreement(store, r, world, setup_number(store, r), timeout=timeout) for r in range(world)
    ]
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        return list(pool.map(vote, votes))


class _Silent:
    """A store whose waits never see their key (a rank that never votes): each wait
    ends at its timeout on a fake clock, at once."""

    def __init__(self, clock: FakeClock, fail: BaseException | None = None) -> None:
        self.clock = clock
        self.fail = fail
        self.waits: list[float] = []
        self.on_wait: Callable[[], None] = lambda: None
        self._counts: dict[str, int] = {}

    def add(self, key: str, value: int) -> int:
        self._counts[key] = self._counts.get(key, 0) + value
        return self._counts[key]

    def set(self, key: str, value: str) -> None:
        self._counts[key] = 1

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self.waits.append(timeout.total_seconds())
        self.on_wait()
        if self.fail is not None:
            raise self.fail
        self.clock.advance(timeout.total_seconds())
        raise dist.DistStoreError(f"wait timeout after {timeout}")

    def delete_key(self, key: str) -> bool:
        return self._counts.pop(key, None) is not None


def test_every_rank_agrees_that_a_step_is_complete_only_when_it_is_on_all() -> None:
    assert _ranks(3, lambda a: a.all_hold(True)) == [True, True, True]
    assert _ranks(3, lambda a: a.all_hold(a.rank != 1)) == [False, False, False]


def test_every_rank_loads_the_same_step_the_newest_that_all_hold() -> None:
    held = {0: [5, 6], 1: [6, 7], 2: [4, 5, 6, 7]}
    assert _ranks(3, lambda a: a.newest_common(held[a.rank])) == [6, 6, 6]
    # None in common: nobody loads anything.
    apart = {0: [5], 1: [6]}
    assert _ranks(2, lambda a: a.newest_common(apart[a.rank])) == [None, None]
    assert _ranks(2, lambda a: a.newest_common([])) == [None, None]


def test_votes_in_a_row_stay_in_step_and_leave_the_keys_of_two_at_most() -> None:
    store = HashStore()
    world = 3
    votes = [Agreement(store, r, world, setup_number(store, r)) for r in range(world)]
    sizes: list[int] = []

    def run(a: Agreement) -> list[bool]:
        answers = []
        for step in range(40):
            answers.append(a.all_hold(step % 3 != 0 or a.rank != 2))
            if a.rank == 0:
                sizes.append(store.num_keys())
        return answers

    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        answers = list(pool.map(run, votes))
    assert answers[0] == answers[1] == answers[2] == [s % 3 != 0 for s in range(40)]
    # The setup counters (one per rank), and the keys of a few votes (n, done, yes):
    # at the end the last two; while they run, a third may begin before a slow rank
    # removed the oldest.
    assert max(sizes) <= world + 3 * 3
    assert store.num_keys() <= world + 2 * 3


def test_a_checkpoint_set_up_again_on_the_same_store_never_reads_the_last_ones_keys() -> None:
    store = HashStore()

    def two_setups(rank: int) -> list[bool]:
        first = Agreement(store, rank, 2, setup_number(store, rank))
        answers = [first.all_hold(rank == 0)]  # (False: its keys stay in the store)
        second = Agreement(store, rank, 2, setup_number(store, rank))
        answers.append(second.all_hold(True))
        return answers

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(two_setups, [0, 1])) == [[False, True], [False, True]]


def test_a_rank_that_never_votes_holds_the_others_a_bounded_time_in_short_waits() -> None:
    clock = FakeClock()
    store = _Silent(clock)
    vote = Agreement(store, 0, 2, 1, timeout=12.0, clock=clock)
    started = clock.monotonic()
    with pytest.raises(dist.DistStoreError) as caught:
        vote.all_hold(True)
    assert clock.monotonic() - started == pytest.approx(12.0)
    assert store.waits == [agreement.WAIT_SLICE, agreement.WAIT_SLICE, pytest.approx(2.0)]
    assert "waited 12s for the other ranks' vote" in "".join(caught.value.__notes__)
    assert not ended_with_world(caught.value)


def test_a_real_store_ends_a_lonely_vote_at_the_timeout() -> None:
    store = HashStore()
    vote = Agreement(store, 0, 2, setup_number(store, 0), timeout=0.2)
    with pytest.raises(dist.DistStoreError):
        vote.barrier()


def test_a_stop_request_ends_a_waiting_vote_at_its_next_look() -> None:
    clock = FakeClock()
    store = _Silent(clock)
    vote = Agreement(store, 0, 2, 1, clock=clock)
    store.on_wait = lambda: vote.cancel("the world was rebuilt")
    with pytest.raises(Cancelled) as caught:
        vote.all_hold(True)
    assert len(store.waits) == 1
    assert ended_with_world(caught.value)
    with pytest.raises(Cancelled):  # and every later vote
        vote.barrier()


def test_a_store_that_closes_ends_the_vote_at_once_and_the_end_of_the_world_explains_it() -> None:
    server = TorchWireServer("127.0.0.1", 0)
    port = server.start()
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    vote = Agreement(client, 0, 2, setup_number(client, 0), timeout=60.0)
    closer = threading.Timer(0.2, server.close)
    closer.start()
    try:
        with pytest.raises(RuntimeError) as caught:
            vote.all_hold(True)
    finally:
        closer.join()
        server.close()
    assert isinstance(caught.value, dist.DistNetworkError)
    assert ended_with_world(caught.value)


def test_a_checkpoint_set_up_after_its_worlds_store_closed_fails_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A rank that sets up (its first save or load in a world) after the agent closed
    # that world's store: torch's clone of the store would retry the refused connection
    # for twice the store's timeout (here 10 s; 60 minutes by default), which nothing
    # interrupts. It fails at once instead, with torch's error for a lost store.
    server = TorchWireServer("127.0.0.1", 0)
    port = server.start()
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    default = PrefixStore("default_pg", client)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: default)
    assert not agreement._server_gone(default)  # up: nothing to say
    assert not agreement._server_gone(HashStore())  # not a TCP store: not asked
    server.close()
    started = time.monotonic()
    with pytest.raises(dist.DistNetworkError, match="refuses connections") as caught:
        agreement.for_world(0, 2)
    assert time.monotonic() - started < 3.0
    assert ended_with_world(caught.value)


# -- the background thread's side ----------------------------------------------------------


def _finisher(tmp_path: Path, vote: Agreement) -> Finisher:
    finisher = Finisher(PersistScheduler(None))
    steps = RankSteps(str(tmp_path), vote.rank, vote.world)
    finisher.start(steps, RankReporter(str(tmp_path), vote.rank, 0, 1), vote)
    return finisher


def test_a_vote_cut_by_the_stores_end_is_said_once_at_info_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    store = _Silent(clock, fail=dist.DistNetworkError("Failed to recv: connection closed"))
    finisher = _finisher(tmp_path, Agreement(store, 0, 2, 1, clock=clock))
    caplog.set_level(logging.INFO, "elastrun.checkpoint")
    try:
        for step in range(3):
            finisher.submit(step, None, 0.0, 0.0)
            finisher.wait_idle()
            finisher.raise_failure()  # (nothing: the world's end explains it)
    finally:
        finisher.stop()
    assert finisher.ended()
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(said) == 1 and said[0][0] == logging.INFO, said
    assert "the workers' store went away agreeing on step 0" in said[0][1]
    assert len(store.waits) == 1  # no vote after the first failed


def test_a_rank_that_does_not_vote_in_time_is_a_warning_and_the_next_call_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    finisher = _finisher(tmp_path, Agreement(_Silent(clock), 0, 2, 1, timeout=1.0, clock=clock))
    try:
        finisher.submit(0, None, 0.0, 0.0)
        finisher.wait_idle()
        assert not finisher.ended()
        with pytest.raises(MemoryCheckpointError, match="the ranks lost each other"):
            finisher.raise_failure()
    finally:
        finisher.stop()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
