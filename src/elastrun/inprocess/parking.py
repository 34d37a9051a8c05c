"""Freeing process groups only when their threads are idle.

Freeing a gloo process group joins its worker threads while holding the GIL; a worker
thread that is just finishing a collective needs the GIL to drop what it captured, so
the two can wait for each other for ever (torch 2.13). A process that never recovers
frees its group only when it exits; a recovering worker frees one at every failure and
at the end of every call of the training function -- right after a collective, and it
hung there. So a recovering worker *parks* its process groups (an extra reference,
taken at every commit and synchronisation) and releases a healthy one itself, after a
short pause that lets the worker threads finish: the destructor then never waits on a
thread that needs the GIL. A group broken by a failure is never released.
"""

from __future__ import annotations

import ctypes
import sys
import time

#: Long enough for a worker thread to drop a finished collective's state.
PAUSE = 0.1

_parked: dict[int, object] = {}
_broken: list[object] = []  # parked for good (each holds its extra reference)


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
    """Never release the groups parked now (they are broken: their destructors could
    wait for collectives that never end). Their connections are cut (``inprocess.cut``);
    their threads and memory stay until the process exits."""
    _broken.extend(_parked.values())
    _parked.clear()


def parked() -> int:
    """How many groups are parked (for tests and logs)."""
    return len(_parked)
