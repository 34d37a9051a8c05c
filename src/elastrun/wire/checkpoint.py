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
        report-rank-3.json              rank 3's report to the agent: its saves' times and
                                        the step it restored from (see below)
        buddy.json                      the agent's word on this round's copies (below)
        copied-000000000042             step 42 of this node's ranks is copied to the buddy
                                        (rank -> the version copied: ``piece_version``)
        copies/<node>/step-.../rank-5.* another node's pieces, copied here by the agent
        gathered/step-.../rank-5.*      pieces pulled here before a round's workers start

**Copies on another node.** Each agent copies the complete steps of the node before it
in the round's group-rank order (its *source*) into ``copies/<source>/`` (the same
files, marker last), keeping the newest copy complete on every rank and the one
arriving, and tells the source, whose agent then writes ``copied-<step>`` in its own
directory. A rank's save waits for that file after its marker when ``buddy.json`` names
a copier, so a step is complete only once its copy is in: the step it replaces is
removed only then. Before a round's workers start, an agent pulls the pieces its ranks
will need and do not find in its directory (a lost node's, from its buddy's copy) into
``gathered/``. A reader takes a rank's piece of a step from the step's directory, from
``gathered/`` or from any ``copies/<node>/``, whichever holds a valid marker for it.

**buddy.json** (written by the agent, by a rename, at each round)::

    {"version": 1, "round": 3, "copier": "<node id>", "source": "<node id>"}

``copier`` is the node that copies this node's steps (null: none, the node is alone);
``source`` the node whose steps this one copies (null: none).

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

**The report** is what a rank tells its agent, which never imports torch and so never
reads a checkpoint itself: one JSON object, rewritten (to a temporary name, then by a
rename) after each save is finished in the background and after each load::

    {"version": 1, "rank": 3, "local_rank": 1, "pid": 4242,
     "saves": 120, "complete": 119, "blocked_s": 9.1, "save_s": 14.0, "lag_s": 15.2,
     "newest": 119, "loads": 1, "restored": 41, "restore_s": 0.42}

The counts and the times are the writing process's totals since it started (``pid``
tells a restarted worker's report from its predecessor's), so a reader that looks now
and then takes the mean of the saves between two looks: ``saves`` finished (kept,
dropped or skipped) and ``blocked_s``, the time the training thread spent in them;
``complete``, those complete on every rank, with ``save_s`` (from the call until this
rank's marker) and ``lag_s`` (the copy lag: from the call until the ranks agreed that
the step is complete on all of them, the moment it becomes the one a restart loads).
``newest`` is that step (null: none yet); ``restored`` is the step the last of
``loads`` loads restored (null: none), taking ``restore_s``.

**Version.** :data:`VERSION` is the marker's ``version`` key, the report's and the
metadata file's (the metadata's own format is the worker side's,
``checkpoint.worker.metadata``). :func:`decode_marker` refuses another version with
:class:`MarkerError`, naming both; a reader treats such a step as incomplete (a
checkpoint of another elastrun is never loaded). :func:`decode_report` refuses one
with :class:`ReportError`; the agent then skips the report.

Nothing here imports more than the standard library and core: both sides use it.
"""

from __future__ import annotations

import json
import os
import re
from typing import NamedTuple

from elastrun.core.errors import ElastrunError
from elastrun.core.versioned import load_versioned

__all__ = [
    "BUDDY_FILE",
    "CHECKPOINT_DIR_ENV",
    "COPIES_DIR",
    "COPIES_HELD",
    "DIR_PREFIX",
    "GATHERED_DIR",
    "STEPS_HELD",
    "VERSION",
    "Buddy",
    "Marker",
    "MarkerError",
    "RankReport",
    "ReportError",
    "copied_name",
    "data_name",
    "decode_buddy",
    "decode_marker",
    "decode_report",
    "encode_buddy",
    "encode_marker",
    "encode_report",
    "marker_name",
    "meta_name",
    "piece_bases",
    "piece_version",
    "rank_of_file",
    "rank_of_report",
    "replace_file",
    "report_name",
    "spare_name",
    "step_dir_name",
    "step_of_copied",
    "step_of_dir",
    "steps_in",
]

#: The node's checkpoint directory (set by an agent that could make one).
CHECKPOINT_DIR_ENV = "ELASTRUN_CHECKPOINT_DIR"
#: How the node directory's name starts (``elastrun-ckpt-<run id>-<random>``).
DIR_PREFIX = "elastrun-ckpt-"
#: The marker's, the report's and the metadata file's ``version``.
VERSION = 1
#: Steps a node holds of each of its ranks: the newest complete one and the one in
#: progress (or the spare data file the next one writes over).
STEPS_HELD = 2
#: Copies a node holds of its source node's steps: the newest complete on every rank and
#: the one arriving (each as large as the source node's state).
COPIES_HELD = 2
#: The agent's word on the round's copies, in the node directory.
BUDDY_FILE = "buddy.json"
#: Where another node's pieces are copied: ``copies/<node>/step-.../``.
COPIES_DIR = "copies"
#: Where pieces pulled before a round's workers start go: ``gathered/step-.../``.
GATHERED_DIR = "gathered"

_STEP_DIR = re.compile(r"step-(\d{12,})")
_RANK_FILE = re.compile(r"rank-(\d+)\.(?:data|meta\.json|done)(?:\.tmp)?")
_REPORT = re.compile(r"report-rank-(\d+)\.json")
_COPIED = re.compile(r"copied-(\d{12,})")


class MarkerError(ElastrunError, ValueError):
    """The text is not a marker of this version."""


class ReportError(ElastrunError, ValueError):
    """The text is not a rank's report of this version."""


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


def steps_in(directory: str) -> list[int]:
    """The steps of the step directories in ``directory``, oldest first (none: it cannot
    be read)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(s for s in map(step_of_dir, names) if s is not None)


def piece_bases(directory: str) -> list[str]:
    """Where step directories with pieces lie in the node directory ``directory``,
    relative to it: the node directory itself (``""``), ``gathered``, then each
    ``copies/<node>`` (sorted)."""
    try:
        nodes = sorted(os.listdir(os.path.join(directory, COPIES_DIR)))
    except OSError:
        nodes = []
    return ["", GATHERED_DIR, *(f"{COPIES_DIR}/{node}" for node in nodes)]


def copied_name(step: int) -> str:
    """The file (in the node directory) that says ``step`` of the node's ranks is copied
    to the node's copier."""
    return "copied-" + step_dir_name(step).removeprefix("step-")


def step_of_copied(name: str) -> int | None:
    """The step a ``copied-<step>`` file's name holds (None: not such a name)."""
    match = _COPIED.fullmatch(name)
    return int(match.group(1)) if match else None


def piece_version(marker: os.stat_result, data: os.stat_result) -> str:
    """What tells one writing of a rank's piece from another (a step saved again after a
    restart loaded an older one): its marker's and its data file's identity. The copier
    sends it with its word that a step is copied (``copied-<step>`` holds a JSON object
    of rank -> version), and a rank waits for its own piece's version there."""
    return f"{marker.st_ino}.{marker.st_mtime_ns}.{data.st_ino}"


class Buddy(NamedTuple):
    """The round's copies as the agent wrote them in ``buddy.json``."""

    round: int
    copier: str | None  # the node that copies this one's steps (None: none)
    source: str | None  # the node whose steps this one copies (None: none)


def decode_buddy(text: str | bytes) -> Buddy:
    """The ``Buddy`` a ``buddy.json`` holds.

    Raises:
        MarkerError: not such a document, or of another version.
    """
    data = load_versioned(text, VERSION, MarkerError)
    number = data.get("round")
    if not isinstance(number, int) or isinstance(number, bool) or number < 0:
        raise MarkerError(f"round: not an integer >= 0 (got {number!r})")
    nodes = []
    for name in ("copier", "source"):
        value = data.get(name)
        if value is not None and not isinstance(value, str):
            raise MarkerError(f"{name}: not a node id or null (got {value!r})")
        nodes.append(value)
    return Buddy(number, *nodes)


def replace_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` under its temporary name (``.tmp`` added), then rename
    it into place, so that a reader sees the whole file or the one before: how every
    file here is written but a step's data and metadata, which its marker vouches for."""
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)


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


def decode_marker(text: str | bytes) -> Marker:
    """The marker a file's text holds.

    Raises:
        MarkerError: not JSON, not an object, another version, or a field missing or
            not a non-negative integer.
    """
    data = load_versioned(text, VERSION, MarkerError)
    values = []
    for name in Marker._fields:
        value = data.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MarkerError(f"{name}: not an integer >= 0 (got {value!r})")
        values.append(value)
    return Marker(*values)


class RankReport(NamedTuple):
    """What one rank's process reports of its memory checkpoints (totals since it
    started; see the module's docstring for each field)."""

    rank: int
    local_rank: int
    pid: int
    saves: int = 0
    complete: int = 0
    blocked_s: float = 0.0
    save_s: float = 0.0
    lag_s: float = 0.0
    newest: int | None = None
    loads: int = 0
    restored: int | None = None
    restore_s: float = 0.0


_REPORT_TIMES = ("blocked_s", "save_s", "lag_s", "restore_s")
_REPORT_STEPS = ("newest", "restored")


def report_name(rank: int) -> str:
    """Rank ``rank``'s report, in the node directory itself (its temporary name adds
    ``.tmp``)."""
    return f"report-rank-{rank}.json"


def rank_of_report(name: str) -> int | None:
    """The rank whose report ``name`` is (None: not a report's final name)."""
    match = _REPORT.fullmatch(name)
    return int(match.group(1)) if match else None


def _encode(record: Buddy | Marker | RankReport) -> str:
    """The text of ``buddy.json``, of a marker or of a report: the record's fields and
    the version."""
    return json.dumps({"version": VERSION, **record._asdict()})


encode_buddy = encode_marker = encode_report = _encode


def decode_report(text: str | bytes) -> RankReport:
    """The report a file's text holds.

    Raises:
        ReportError: not JSON, not an object, another version, or a field missing or
            of the wrong kind (counts and steps are integers >= 0, a step may be null,
            times are numbers >= 0).
    """
    data = load_versioned(text, VERSION, ReportError)
    values: dict[str, int | float | None] = {}
    for name in RankReport._fields:
        value = data.get(name)
        if name in _REPORT_STEPS and value is None:
            values[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ReportError(f"{name}: not a number >= 0 (got {value!r})")
        if name in _REPORT_TIMES:
            values[name] = float(value)
        elif isinstance(value, int):
            values[name] = value
        else:
            raise ReportError(f"{name}: not an integer (got {value!r})")
    return RankReport._make(values[name] for name in RankReport._fields)
