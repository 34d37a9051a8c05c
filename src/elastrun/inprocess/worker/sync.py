"""Synchronising the state of a round's ranks: the newest commit goes to every rank
whose commit is older (a replacement's is 0) or whose state moved on since its commit
(see ``inprocess.transfer``).

It runs on a process group of its own (gloo, on the round's bootstrap store under a
prefix of its own), made and destroyed around the exchange, so the training function's
``init_process_group`` finds the default group free and the store's keys untouched.
Before joining that group, the ranks that hold their commit publish its shapes, and a
rank about to receive allocates from them ahead (``inprocess.early``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from elastrun.inprocess.worker import early
from elastrun.inprocess.worker.parking import keep_parked, park_process_groups
from elastrun.inprocess.worker.state import State
from elastrun.inprocess.worker.transfer import move_commit

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store, TCPStore

log = logging.getLogger("elastrun.inprocess")

#: Bounds the exchange (a rank that never comes makes the others fail, and the agent
#: restarts the group).
SYNC_TIMEOUT = datetime.timedelta(seconds=120)
#: How long the first try to form the synchronisation's group may take; each further
#: try doubles it (see ``_form``).
FORM_TIMEOUT = datetime.timedelta(seconds=1)
#: Tries before the formation fails for good (1 + 2 + ... + 32 s: a minute).
FORM_TRIES = 6
#: How long one try of torch's store client may take to connect: it retries a refused
#: port until then, deaf to a newer round, so tries are short and the round is checked
#: between them (see ``_connect``).
CONNECT_TIMEOUT = datetime.timedelta(seconds=1)
#: Pause between two tries to reach a store that does not answer yet.
_RETRY = 0.02


class Superseded(RuntimeError):
    """A newer round was announced while this worker synchronised in an older one."""


def synchronise(state: State, round_no: int, superseded: Callable[[], bool]) -> None:
    """Exchange commits with the round's other ranks; the newest wins.

    Args:
        superseded: whether a newer round was announced (then the round's store is gone
            and this one is abandoned).

    Raises:
        Superseded: a newer round was announced before the store answered.
        RuntimeError: a collective failed (a rank of the round is gone).
    """
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = _connect(addr, port, round_no, superseded)
    store.set_timeout(SYNC_TIMEOUT)  # the store's waits end when it stops
    prefixed = PrefixStore(f"elastrun/inprocess/{round_no}/", store)
    fresh = state.commit_id == 0 or state.held_commit() is None  # about to receive
    if not fresh:
        early.publish(state, prefixed)
    ahead: contextlib.AbstractContextManager[early.Pool]
    ahead = early.ahead(state, prefixed) if fresh else contextlib.nullcontext({})
    with ahead as pool:
        _all_here(prefixed, rank, world, round_no, superseded)
        _form(prefixed, rank, world, round_no, superseded)
        try:
            move_commit(state, rank, world, pool)
        finally:
            dist.destroy_process_group()
            # Kept: releasing it now would need a pause (see inprocess.parking) on the
            # recovery's critical path; the next recovery releases it, idle by then.
            keep_parked()


def _all_here(
    store: Store, rank: int, world: int, round_no: int, superseded: Callable[[], bool]
) -> None:
    """Until every rank of the round has reached its synchronisation, or
    :class:`Superseded` once a newer round is announced.

    A peer that dies before every rank is here (a replacement still starting, a
    survivor killed as it enters) only ever holds the others in this loop, which asks
    the channel between two looks at the store; ``_form`` covers the rest."""
    store.set(f"here/{rank}", "1")
    _await(store, [f"here/{r}" for r in range(world)], round_no, superseded, "the synchronisation")


def _form(
    store: Store, rank: int, world: int, round_no: int, superseded: Callable[[], bool]
) -> None:
    """Form the synchronisation's process group (parked, see ``inprocess.parking``), or
    :class:`Superseded` once a newer round is announced.

    Nothing interrupts gloo while it connects the full mesh, and a peer killed after
    it published its address holds the others for five times the group's timeout: the
    rank that was to wait for that peer's connection waits so long (with the exchange's
    120 s, ten minutes, deaf to the next round; the agent would replace the waiting
    survivors as stuck after its join bound). So the group forms in tries of a short
    timeout, each doubling the last. After each try every rank says whether it formed,
    and all go on only when all did: a rank never enters the exchange with a group that
    a peer gave up on. A dead peer's word never comes, and the channel says when the
    next round is announced. Once formed, the exchange (GBs of state) gets the long
    timeout."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore

    timeout = FORM_TIMEOUT
    for attempt in range(FORM_TRIES):
        tried = PrefixStore(f"form/{attempt}/", store)
        try:
            dist.init_process_group(
                _backend(), store=tried, rank=rank, world_size=world, timeout=timeout
            )
        except RuntimeError as exc:  # torch's errors derive from it
            formed, what = False, (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            # The failed init counted a group it never made: the next try's group must
            # be named as every other rank's is (see recovery._teardown).
            dist.distributed_c10d._world.group_count = 0
        else:
            formed, what = True, "a peer's try failed"
        tried.set(f"formed/{rank}", "1" if formed else "0")
        keys = [f"formed/{r}" for r in range(world)]
        try:
            _await(tried, keys, round_no, superseded, "the end of the group's formation")
            everyone = all(v == b"1" for v in tried.multi_get(keys))
        except BaseException:
            if formed:
                park_process_groups()  # the caller's teardown keeps it (inprocess.parking)
            raise
        if everyone:
            park_process_groups()  # see inprocess.parking
            dist.distributed_c10d._set_pg_timeout(SYNC_TIMEOUT)
            return
        if formed:
            # No collective ever ran on it, so its threads are idle: freed at once
            # rather than kept (see inprocess.parking).
            dist.destroy_process_group()
        if attempt + 1 < FORM_TRIES:
            log.info(
                "in-process round %d: the synchronisation's group did not form within "
                "%.0fs (%s); trying again", round_no, timeout.total_seconds(), what[:160],
            )  # fmt: skip
        timeout *= 2
    raise RuntimeError(
        f"in-process round {round_no}: the synchronisation's group did not form in "
        f"{FORM_TRIES} tries (the last: {what[:160]})"
    )


def _await(
    store: Store, keys: list[str], round_no: int, superseded: Callable[[], bool], what: str
) -> None:
    """Until every one of ``keys`` is set, or :class:`Superseded` once a newer round is
    announced; a ``RuntimeError`` after ``SYNC_TIMEOUT``."""
    deadline = time.monotonic() + SYNC_TIMEOUT.total_seconds()
    # ``check`` asks once and never blocks (a ``wait`` with a short timeout logs two
    # lines of torch's each time it ends); a stopped store raises, and the caller
    # handles that as any failed collective.
    while not store.check(keys):
        if superseded():
            raise Superseded(f"in-process round {round_no} was superseded")
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"in-process round {round_no}: not every rank reached {what} within "
                f"{SYNC_TIMEOUT.total_seconds():.0f}s"
            )
        time.sleep(_RETRY)


def _backend() -> str:
    """gloo for CPU tensors; NCCL for CUDA ones where this machine has GPUs (every rank
    of a round runs the same kind of machine, so all choose alike)."""
    import torch

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _connect(addr: str, port: int, round_no: int, superseded: Callable[[], bool]) -> TCPStore:
    """A client of the round's store, or :class:`Superseded` once a newer round is
    announced.

    The agent stops a round's store as soon as it abandons the round. torch's client
    retries a dead port for its whole timeout and nothing can interrupt it, so each try
    is short (a plain connect first, which fails at once on a closed port, then torch's
    own handshake under ``CONNECT_TIMEOUT``) and the channel is asked between tries."""
    from torch._C._distributed_c10d import TCPStore

    deadline = time.monotonic() + SYNC_TIMEOUT.total_seconds()
    while True:
        if superseded():
            raise Superseded(f"tcpstore: in-process round {round_no} was superseded")
        try:
            socket.create_connection((addr, port), timeout=1.0).close()
            return TCPStore(addr, port, is_master=False, timeout=CONNECT_TIMEOUT)
        except (OSError, RuntimeError) as exc:  # torch's errors derive from RuntimeError
            if time.monotonic() >= deadline:
                raise Superseded(
                    f"tcpstore: the store of in-process round {round_no} at {addr}:{port} "
                    f"did not answer: {exc}"
                ) from exc
        time.sleep(_RETRY)
