"""Freeing process groups only when their threads are idle.

Freeing a gloo process group joins its worker threads while holding the GIL; a worker
thread that is just finishing a collective needs the GIL to drop what it captured, so
the two can wait for each other for ever (torch 2.13). A process that never recovers
frees its group only when it exits; a recovering worker frees one at every failure and
at the end of every call of the training function -- right after a collective, and it
hung there. So a recovering worker *parks* its process groups (an extra reference,
taken at every commit and synchronisation) and releases a healthy one itself, after a
short pause that lets the worker threads finish: the destructor then never waits on a
thread that needs the GIL.

A group broken by a failure, and a synchronisation's group, are not released at once
either: the broken group's collectives may still be failing, and a pause on the
recovery's critical path is what in-process recovery is there to avoid. They are *kept*
and released at the next recovery, when a whole call of the training function ran since
(``next_generation``): by then their collectives have ended and their threads are idle.
A chain of overlapping failures runs no call between its rounds, so a group kept more
than ``IDLE_AFTER`` seconds ago is freed too (a collective with a dead or cut peer fails
within milliseconds): a chain's rounds do not pile their groups up. So what a recovery
leaves (the groups' threads, connections and memory) stays for about one recovery and
does not grow with the number of recoveries.
"""

from __future__ import annotations

import ctypes
import sys
import time

#: Long enough for a worker thread to drop a finished collective's state.
PAUSE = 0.1
#: A kept group is idle this long after it was kept, whether or not a call ran since.
IDLE_AFTER = 2.0

_parked: dict[int, object] = {}
# Kept until idle: the generation and the time they were kept in (each holds its extra
# reference).
_kept: list[tuple[int, float, object]] = []
_generation = 0


def park_process_groups() -> None:
    """Park every process group of this process (cheap when all are parked already)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    for pg in list(dist.distributed_c10d._world.pg_map):
        if id(pg) not in _parked:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
            _parked[id(pg)] = pg


def release_parked(pause: float = PAUSE) -> None:
    """Drop the parked references after ``pause`` seconds (the GIL released)."""
    if not _parked:
        return
    time.sleep(pause)
    groups = list(_parked.values())
    _parked.clear()
    for pg in groups:
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(pg))
    del groups


def keep_parked() -> None:
    """Keep the groups parked now until they are idle (they are broken, or just used:
    their destructors could wait for collectives or threads that need the GIL); their
    connections are cut (``inprocess.cut``). ``release_idle`` frees them once a whole
    call of the training function ran since, or ``IDLE_AFTER`` seconds passed."""
    now = time.monotonic()
    _kept.extend((_generation, now, pg) for pg in _parked.values())
    _parked.clear()


def next_generation() -> None:
    """The training function is called again: every group kept so far will have been
    idle for a whole call by the next recovery."""
    global _generation
    _generation += 1


def release_idle(*, generations: bool = True) -> None:
    """Free the kept groups kept over ``IDLE_AFTER`` seconds ago or, unless
    ``generations`` is false (a commit, in the call right after a recovery), in an
    earlier generation: idle since."""
    if not _kept:  # (at every commit: nothing to look at, nearly always)
        return
    since = time.monotonic() - IDLE_AFTER
    last = _generation if generations else -1

    def idle(gen: int, at: float) -> bool:
        return gen < last or at < since

    freed = [pg for gen, at, pg in _kept if idle(gen, at)]
    _kept[:] = [(gen, at, pg) for gen, at, pg in _kept if not idle(gen, at)]
    for pg in freed:
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(pg))
