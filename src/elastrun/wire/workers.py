"""``<attempt>/workers.json``: which process serves each local rank, for ``elastrun stacks``.

The agent writes it once an attempt's workers run (``elastrun.agent.workers``);
``elastrun stacks`` reads the newest one under a log directory and signals the workers
it lists. One JSON object::

    {"version": 1,
     "workers": {"<local rank>": {"pid": N, "stacks": PATH, "start_time": T | null}}}

``stacks`` is the file the worker dumps its stacks into on SIGUSR1; ``start_time`` the
process's start time (clock ticks since boot, ``core.procinfo``; null when it could not
be read), so that a reader never signals a stranger that reused the pid.

**Version.** :data:`VERSION` is the object's ``version`` key. :func:`decode` refuses a
file of another version, or one that is not this format, with :class:`WorkersFileError`
naming what it found.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import NamedTuple

from elastrun.core.errors import ElastrunError
from elastrun.core.versioned import load_versioned

__all__ = ["FILE_NAME", "VERSION", "WorkerEntry", "WorkersFileError", "decode", "encode"]

#: The file's name in an attempt's log directory.
FILE_NAME = "workers.json"
#: The ``version`` key of the file.
VERSION = 1


class WorkerEntry(NamedTuple):
    """One local rank's worker: its pid, its stacks file and its start time."""

    pid: int
    stacks: str
    start_time: int | None


class WorkersFileError(ElastrunError, ValueError):
    """The text is not a ``workers.json`` of this version."""


def encode(workers: Mapping[int, WorkerEntry]) -> str:
    """The file's text for ``workers`` (by local rank)."""
    data = {str(lr): w._asdict() for lr, w in sorted(workers.items())}
    return json.dumps({"version": VERSION, "workers": data})


def decode(text: str | bytes) -> dict[int, WorkerEntry]:
    """The workers listed in a file's text, by local rank.

    Raises:
        WorkersFileError: not JSON, not an object, another version, or a malformed entry.
    """
    data = load_versioned(text, VERSION, WorkersFileError)
    workers = data.get("workers")
    if not isinstance(workers, dict):
        raise WorkersFileError("no object of workers")
    return {_local_rank(lr): _entry(lr, w) for lr, w in workers.items()}


def _local_rank(key: str) -> int:
    if not key.isdigit():
        raise WorkersFileError(f"{key!r} is not a local rank")
    return int(key)


def _entry(key: str, value: object) -> WorkerEntry:
    bad = WorkersFileError(f"local rank {key}: bad entry {value!r}")
    if not isinstance(value, dict):
        raise bad
    pid, stacks, start = value.get("pid"), value.get("stacks"), value.get("start_time")
    if isinstance(pid, bool) or isinstance(start, bool):
        raise bad
    if not isinstance(pid, int) or not isinstance(stacks, str) or not isinstance(start, int | None):
        raise bad
    return WorkerEntry(pid, stacks, start)
