"""Where worker output goes: the ``--redirects``/``--tee`` syntax and the log directory layout.

The names follow ``torch.distributed.elastic.multiprocessing`` (``Std``, ``to_map``,
``LogsDest``, ``LogsSpecs``, ``DefaultLogsSpecs``) so that code written against torch
keeps working. Differences from torch, each deliberate:

* per-rank maps such as ``"12:3"`` may address any local rank, not only 0-9;
* ``DefaultLogsSpecs`` does no I/O in its constructor; directories appear at the first
  :meth:`~DefaultLogsSpecs.reify`;
* every ``reify`` gets a fresh ``attempt_<k>`` directory; an existing one is never wiped
  or reused, so the logs from before a membership change survive it;
* with ``log_dir=/dev/null`` the filtered-output paths are empty (no file), instead of
  the impossible ``/dev/null/filtered_stdout.log``;
* a run directory removed during the run is made again at the next ``reify``, and
  :func:`reify_or_console` turns a log directory that cannot be made (a full disk, no
  inodes left, no permission) into console output for that attempt instead of an error
  that would end the agent and lose its failure report.
"""

from __future__ import annotations

import abc
import enum
import errno
import logging
import os
import re
import string
import tempfile
from dataclasses import dataclass, field
from typing import Any

from elastrun.wire.env import ERROR_FILE_ENV, RUN_ID_ENV

logger = logging.getLogger(__name__)

_DIGITS = re.compile(r"[0-9]+")
_STD_VALUES = "0 (none), 1 (stdout), 2 (stderr) or 3 (both)"


class Std(enum.IntFlag):
    """Which standard streams of a worker a setting applies to (a bit mask)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, vm: str) -> Std | dict[int, Std]:
        """Parse a ``--redirects``/``--tee`` value.

        ``"3"`` applies to every local rank; ``"0:3,12:1"`` maps local ranks to values
        (ranks missing from the map get ``NONE``, see :func:`to_map`). Whitespace around
        the value and around items is ignored.

        Raises:
            ValueError: the text is neither form; the message names the bad part.
        """
        text = vm.strip()
        if not text:
            raise ValueError(f"empty stream setting {vm!r}: expected a digit 0-3 or rank:value,...")
        if ":" not in text:
            return cls._parse_value(text, vm)
        result: dict[int, Std] = {}
        for raw_item in text.split(","):
            item = raw_item.strip()
            if not item:
                raise ValueError(f"empty item in stream map {vm!r}")
            rank_text, sep, value_text = item.partition(":")
            rank_text = rank_text.strip()
            if not sep or not _DIGITS.fullmatch(rank_text):
                raise ValueError(
                    f"bad item {item!r} in stream map {vm!r}: expected <local_rank>:<value>"
                )
            rank = int(rank_text)
            if rank in result:
                raise ValueError(f"local rank {rank} appears twice in stream map {vm!r}")
            result[rank] = cls._parse_value(value_text.strip(), vm)
        return result

    @classmethod
    def _parse_value(cls, text: str, whole: str) -> Std:
        if len(text) == 1 and text in "0123":
            return cls(int(text))
        raise ValueError(f"bad stream value {text!r} in {whole!r}: expected {_STD_VALUES}")


def to_map(val_or_map: Std | dict[int, Std], local_world_size: int) -> dict[int, Std]:
    """Expand a setting to one value per local rank ``0..local_world_size-1``.

    A single value applies to every rank; a map gives ``NONE`` to the ranks it does not
    name, and its entries for ranks outside the range are ignored (as torch does).
    """
    return {lr: _std_for(val_or_map, lr) for lr in range(local_world_size)}


def _std_for(val_or_map: Std | dict[int, Std], local_rank: int) -> Std:
    return val_or_map if isinstance(val_or_map, Std) else val_or_map.get(local_rank, Std.NONE)


def parse_local_ranks_filter(s: str) -> set[int] | None:
    """Parse ``--local-ranks-filter``: ``""`` means no filter, ``"0,2"`` gives ``{0, 2}``.

    Raises:
        ValueError: an item is not a non-negative integer.
    """
    if not s.strip():
        return None
    ranks: set[int] = set()
    for raw_item in s.split(","):
        item = raw_item.strip()
        if not _DIGITS.fullmatch(item):
            raise ValueError(
                f"bad local rank {item!r} in {s!r}: expected a comma-separated list of "
                "non-negative integers such as 0,1,2"
            )
        ranks.add(int(item))
    return ranks


def parse_duplicate_filters(s: str) -> list[str]:
    """Parse ``--duplicate-std{out,err}-filters``: comma-separated substrings.

    A doubled comma stands for a literal comma (``"from 1,,x,from 2"`` gives
    ``["from 1,x", "from 2"]``), read left to right as torch does.

    Empty items are dropped (torch keeps them, and an empty needle then matches every
    line, although torch's help says an empty list duplicates nothing); so ``""`` gives
    ``[]``.
    """
    items = [""]
    # split() takes ",," left to right, as torch's scan does; each piece's single commas
    # separate items, and the item at a piece's end goes on across the literal comma.
    for i, piece in enumerate(s.split(",,")):
        first, *rest = piece.split(",")
        items[-1] += ("," if i else "") + first
        items.extend(rest)
    return [item for item in items if item]


@dataclass
class LogsDest:
    """Where each local rank's streams go, as computed by :meth:`LogsSpecs.reify`.

    ``stdouts``/``stderrs`` hold the file each stream is written to, ``""`` meaning "not
    to a file" (the console). ``tee_stdouts``/``tee_stderrs`` name the ranks whose file
    is also shown on the console (the same path). ``error_files`` holds the path each
    rank's ``TORCHELASTIC_ERROR_FILE`` points at. ``filtered_stdout``/``filtered_stderr``
    are the files for ``--duplicate-*-filters`` (``""``: none).

    ``problem`` is empty unless the attempt's log directory could not be made (see
    :func:`reify_or_console`); it then says why, in one line naming the path and the OS
    error, and ``to_console`` holds, per local rank, the streams that were meant for
    files and are shown on the console with the rank's prefix instead.
    """

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = ""
    filtered_stderr: str = ""
    problem: str = ""
    to_console: dict[int, Std] = field(default_factory=dict)

    def streams(self) -> tuple[tuple[str, Std, dict[int, str], dict[int, str]], ...]:
        """Each stream of a worker: its name, its bit, its files and its tee files."""
        return (
            ("stdout", Std.OUT, self.stdouts, self.tee_stdouts),
            ("stderr", Std.ERR, self.stderrs, self.tee_stderrs),
        )


def reify_or_console(specs: LogsSpecs, envs: dict[int, dict[str, str]]) -> LogsDest:
    """``specs.reify(envs)``, or console output when the log directory cannot be made.

    A log directory can fail at any restart (a full disk, no inodes left, a cleanup job
    removed or locked it), which must not end the agent and lose the failure report. On
    an ``OSError`` this logs one warning naming the path and the OS error, and returns
    destinations that send each stream meant for a file to the console with the rank's
    prefix, and give the workers an empty ``TORCHELASTIC_ERROR_FILE`` (the report says
    why, from ``LogsDest.problem``). The next attempt tries the log directory again.
    Other exceptions (a bug in a custom ``LogsSpecs``) propagate.
    """
    try:
        return specs.reify(envs)
    except OSError as exc:
        problem = f"cannot write worker logs to {describe_os_error(exc, specs.root_log_dir)}"
        logger.warning(
            "%s; this attempt's output goes to the agent's console and its workers "
            "write no error files",
            problem,
        )
        dest = _no_files(envs, "", problem)
        # getattr: a subclass ported from torch may not have called our __init__.
        redirects: Std | dict[int, Std] = getattr(specs, "redirects", Std.NONE)
        tee: Std | dict[int, Std] = getattr(specs, "tee", Std.NONE)
        meant_for_files = {lr: _std_for(redirects, lr) | _std_for(tee, lr) for lr in sorted(envs)}
        dest.to_console = {lr: std for lr, std in meant_for_files.items() if std}
        return dest


def describe_os_error(exc: OSError, path: str = "") -> str:
    """``"<path>: <reason>"`` for an ``OSError``, e.g. ``"/logs/x: No space left on device"``.

    ``path`` stands in when the error names no file of its own.
    """
    where = exc.filename if exc.filename is not None else path
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"{os.fsdecode(where)}: {reason}" if where else reason


def _no_files(envs: dict[int, dict[str, str]], error_file: str, problem: str = "") -> LogsDest:
    """Every stream of ``envs``' ranks to the console, and no error file for the workers."""
    dest = LogsDest(problem=problem)
    for lr in sorted(envs):
        dest.stdouts[lr] = ""
        dest.stderrs[lr] = ""
        dest.error_files[lr] = error_file
        # Set, not removed: the agent's own variable (it may run under another
        # launcher) must not leak into its workers.
        envs[lr][ERROR_FILE_ENV] = ""
    return dest


def _alias(public: str) -> Any:
    """A read-write property that stands for the attribute ``public``."""
    return property(
        lambda self: getattr(self, public), lambda self, value: setattr(self, public, value)
    )


class LogsSpecs(abc.ABC):
    """Policy deciding where worker output and error files go.

    Subclasses (loaded by name through ``--logs-specs``) implement :meth:`reify` and
    :attr:`root_log_dir`.

    Args:
        log_dir: base directory of the logs (meaning is up to the subclass).
        redirects: streams written to files instead of the console, for all local
            ranks or per local rank.
        tee: streams written to files *and* shown on the console (implies redirect).
        local_ranks_filter: only these local ranks are shown on the console; ``None``
            shows all. Files are written regardless.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.redirects = redirects
        self.tee = tee
        self.local_ranks_filter = local_ranks_filter

    @abc.abstractmethod
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Decide the destinations for one start of the workers in ``envs``.

        ``envs`` maps local rank to that worker's environment; implementations may add
        variables to it (``TORCHELASTIC_ERROR_FILE``).
        """

    @property
    @abc.abstractmethod
    def root_log_dir(self) -> str:
        """The base directory of the logs."""

    # torch's base class keeps its arguments in these private names, and subclasses
    # ported from torch use them; they are aliases of the public attributes.
    _root_log_dir = _alias("log_dir")
    _redirects = _alias("redirects")
    _tee = _alias("tee")
    _local_ranks_filter = _alias("local_ranks_filter")


def _safe_dir_part(text: str) -> str:
    # A run id is user-chosen; a path separator in it must not move the directory.
    for sep in filter(None, (os.sep, os.altsep, "\0")):
        text = text.replace(sep, "_")
    return text


class DefaultLogsSpecs(LogsSpecs):
    """The standard layout ``<log_dir>/<run_id>_<random>/attempt_<k>/<local_rank>/``.

    Each rank directory holds ``stdout.log`` and ``stderr.log`` (for redirected or tee'd
    streams) and ``error.json`` (written by the worker on failure); each attempt
    directory holds ``filtered_stdout.log``/``filtered_stderr.log``.

    ``log_dir`` None or empty: a new temporary directory ``elastrun_*`` is made at the
    first :meth:`reify` (:attr:`is_temporary` is then True). ``log_dir == os.devnull``:
    no directory is made, nothing goes to files and workers record no error file.

    The constructor does no I/O; errors about ``log_dir`` surface at the first
    :meth:`reify`.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        self._temp_root: str | None = None
        self._run_log_dir: str | None = None
        self._attempt_dirs: list[str] = []
        self._next_attempt = 0

    @property
    def is_devnull(self) -> bool:
        """True when ``log_dir`` is ``os.devnull``: logs and error files are discarded."""
        return self.log_dir == os.devnull

    @property
    def is_temporary(self) -> bool:
        """True when no ``log_dir`` was given and a temporary directory is (to be) used."""
        return not self.log_dir

    @property
    def root_log_dir(self) -> str:
        """The base log directory; ``""`` while a temporary one is not yet made."""
        return (self._temp_root or "") if self.is_temporary else str(self.log_dir)

    @property
    def run_log_dir(self) -> str | None:
        """``<log_dir>/<run_id>_<random>``, or None before the first :meth:`reify`."""
        return self._run_log_dir

    @property
    def attempt_dirs(self) -> list[str]:
        """The attempt directories made so far, oldest first."""
        return list(self._attempt_dirs)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Make a new attempt directory and compute the destinations of ``envs``' ranks.

        Sets ``TORCHELASTIC_ERROR_FILE`` in every ``envs[local_rank]``.

        A run directory that was removed during the run is made again (with a warning),
        so the logs of the attempts after it are kept.

        Raises:
            NotADirectoryError: ``log_dir`` exists and is not a directory.
            OSError: a directory could not be made (see :func:`reify_or_console`).
        """
        if self.is_devnull:
            return _no_files(envs, os.devnull)
        attempt_dir = self._new_attempt_dir(envs)
        dest = LogsDest(
            filtered_stdout=os.path.join(attempt_dir, "filtered_stdout.log"),
            filtered_stderr=os.path.join(attempt_dir, "filtered_stderr.log"),
        )
        for lr in sorted(envs):
            rank_dir = os.path.join(attempt_dir, str(lr))
            os.mkdir(rank_dir)
            tee = _std_for(self.tee, lr)
            effective = _std_for(self.redirects, lr) | tee
            for name, bit, files, tees in dest.streams():
                path = os.path.join(rank_dir, f"{name}.log")
                files[lr] = path if effective & bit else ""
                if tee & bit:
                    tees[lr] = path
            error_file = os.path.join(rank_dir, "error.json")
            dest.error_files[lr] = error_file
            envs[lr][ERROR_FILE_ENV] = error_file
        return dest

    def _new_attempt_dir(self, envs: dict[int, dict[str, str]]) -> str:
        if self._run_log_dir is None:
            root = self._ensure_root()
            first_env = envs[min(envs)] if envs else {}
            run_id = _safe_dir_part(first_env.get(RUN_ID_ENV, "none") or "none")
            self._run_log_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=root)
            logger.info("log directory set to: %s", self._run_log_dir)
        k = self._next_attempt
        remade = False
        while True:
            attempt_dir = os.path.join(self._run_log_dir, f"attempt_{k}")
            try:
                os.mkdir(attempt_dir)
                break
            except FileExistsError:
                # Someone else made it: never reuse (and never wipe) a directory.
                k += 1
            except FileNotFoundError:
                if remade:
                    raise
                # Removed during the run (a cleanup job, a user freeing space): the
                # user asked for logs there, so keep writing them rather than failing.
                os.makedirs(self._run_log_dir, exist_ok=True)
                logger.warning(
                    "log directory %s was removed during the run; made it again for attempt %d",
                    self._run_log_dir,
                    k,
                )
                remade = True
        self._next_attempt = k + 1
        self._attempt_dirs.append(attempt_dir)
        return attempt_dir

    def _ensure_root(self) -> str:
        if self.is_temporary:
            if self._temp_root is None:
                self._temp_root = tempfile.mkdtemp(prefix="elastrun_")
            return self._temp_root
        root = str(self.log_dir)
        if os.path.exists(root) and not os.path.isdir(root):
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", root)
        os.makedirs(root, exist_ok=True)
        return root

    def __repr__(self) -> str:
        return (
            f"DefaultLogsSpecs(log_dir={self.log_dir!r}, redirects={self.redirects!r}, "
            f"tee={self.tee!r}, local_ranks_filter={self.local_ranks_filter!r}, "
            f"run_log_dir={self._run_log_dir!r}, attempts={len(self._attempt_dirs)})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DefaultLogsSpecs):
            return NotImplemented
        mine = (self.log_dir, self.redirects, self.tee, self.local_ranks_filter)
        return mine == (other.log_dir, other.redirects, other.tee, other.local_ranks_filter)

    __hash__ = None  # type: ignore[assignment]  # mutable state; equality is by settings


def format_line_prefix(template: str | None, role: str, rank: int, local_rank: int) -> str:
    """The prefix put before each console line of a tee'd stream.

    ``None`` gives torchrun's ``[<role><local_rank>]:`` (no trailing space). Otherwise
    ``template`` is a :class:`string.Template` over ``${role_name}``, ``${rank}`` (the
    global rank) and ``${local_rank}``; unknown placeholders are left as they are.
    """
    if template is None:
        return f"[{role}{local_rank}]:"
    return string.Template(template).safe_substitute(
        role_name=role, rank=rank, local_rank=local_rank
    )
