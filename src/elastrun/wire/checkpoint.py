"""Memory checkpoints: the node's directory, its layout and each rank's marker.

The agent makes one directory per node in shared memory (``/dev/shm``), before its
first workers start, names it to every worker in :data:`CHECKPOINT_DIR_ENV`, and
removes it when the run ends (``elastrun.checkpoint.agent``). Workers
(``elastrun.checkpoint.worker``) write their checkpoints there; the directory outlives
them, so a worker restarted on the same node finds its predecessor's. This module is
what both ends agree on: the variable, the names and the marker.

**Layout**::

    <node directory>/                   elastrun-ckpt-<run id>-<random>, mode 0700
        step-000000000042/              one directory per step
            rank-3.data                 rank 3's tensors and values, one after another
            rank-3.meta.json            rank 3's checkpoint metadata (DCP's, as JSON)
            rank-3.done                 rank 3's marker: written last, by a rename
        spare-rank-3.data               rank 3's data file of a step it removed, kept to
                                        be written over by its next step (no new pages)

Each rank writes only its own files, and a step is complete *for a rank* once that
rank's marker exists: the marker is renamed into place after the data and the metadata
are written, so a rank that died while writing left no marker, and its half-written
files are never read. A step is complete for the job when it is complete for every rank
of the world the marker names; the ranks agree which step that is when they load.

**The marker** is one JSON object::

    {"version": 1, "step": 42, "rank": 3, "world_size": 4,
     "data_bytes": N, "meta_bytes": M}

``data_bytes`` and ``meta_bytes`` are the sizes of the two files the marker vouches
for; a reader that finds either file of another size treats the step as incomplete.

**Version.** :data:`VERSION` is the marker's ``version`` key and the metadata file's
(the metadata's own format is the worker side's, ``checkpoint.worker.metadata``).
:func:`decode_marker` refuses another version with :class:`MarkerError`, naming both;
a reader treats such a step as incomplete (a checkpoint of another elastrun is never
loaded).

Nothing here imports more than the standard library and core: both sides use it.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from elastrun.core.errors import ElastrunError

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "DIR_PREFIX",
    "VERSION",
    "Marker",
    "MarkerError",
    "data_name",
    "decode_marker",
    "encode_marker",
    "marker_name",
    "meta_name",
    "rank_of_file",
    "spare_name",
    "step_dir_name",
    "step_of_dir",
]

#: The node's checkpoint directory (set by an agent that could make one).
CHECKPOINT_DIR_ENV = "ELASTRUN_CHECKPOINT_DIR"
#: How the node directory's name starts (``elastrun-ckpt-<run id>-<random>``).
DIR_PREFIX = "elastrun-ckpt-"
#: The marker's and the metadata file's ``version``.
VERSION = 1

_STEP_DIR = re.compile(r"step-(\d{12,})")
_RANK_FILE = re.compile(r"rank-(\d+)\.(?:data|meta\.json|done)(?:\.tmp)?")


class MarkerError(ElastrunError, ValueError):
    """The text is not a marker of this version."""


class Marker(NamedTuple):
    """What a rank's marker vouches for: its step, rank and world, and its files' sizes."""

    step: int
    rank: int
    world_size: int
    data_bytes: int
    meta_bytes: int


def step_dir_name(step: int) -> str:
    """The directory of ``step`` (zero-padded, so that names sort as steps do)."""
    if step < 0:
        raise ValueError(f"a step is >= 0 (got {step})")
    return f"step-{step:012d}"


def step_of_dir(name: str) -> int | None:
    """The step a directory's name holds, or None when it is not a step directory."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def data_name(rank: int) -> str:
    """Rank ``rank``'s data file in a step directory."""
    return f"rank-{rank}.data"


def meta_name(rank: int) -> str:
    """Rank ``rank``'s metadata file in a step directory."""
    return f"rank-{rank}.meta.json"


def spare_name(rank: int) -> str:
    """Rank ``rank``'s spare data file, in the node directory itself (not a step's)."""
    return f"spare-rank-{rank}.data"


def marker_name(rank: int) -> str:
    """Rank ``rank``'s marker in a step directory (its temporary name adds ``.tmp``)."""
    return f"rank-{rank}.done"


def rank_of_file(name: str) -> int | None:
    """The rank whose file (data, metadata or marker, final or temporary) ``name`` is,
    or None when it is none of them."""
    match = _RANK_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


def encode_marker(marker: Marker) -> str:
    """The marker file's text."""
    return json.dumps({"version": VERSION, **marker._asdict()})


def decode_marker(text: str | bytes) -> Marker:
    """The marker a file's text holds.

    Raises:
        MarkerError: not JSON, not an object, another version, or a field missing or
            not a non-negative integer.
    """
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MarkerError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MarkerError("not a JSON object")
    version = data.get("version")
    if version != VERSION or isinstance(version, bool):
        raise MarkerError(f"version {version!r}, this elastrun reads version {VERSION}")
    values = []
    for name in Marker._fields:
        value = data.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MarkerError(f"{name}: not an integer >= 0 (got {value!r})")
        values.append(value)
    return Marker(*values)
