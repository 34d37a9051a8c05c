"""Progress reports from a worker to its agent: a shared-memory record per worker.

The agent creates one small file (``elastrun.pace.ProgressBoard``) and
gives each worker two variables: :data:`PROGRESS_FILE_ENV` (the file) and
:data:`PROGRESS_SLOT_ENV` (its record in it). The worker maps the file and each report
is a handful of stores into its record -- no store round trip, no system call, no lock
shared with another process. Reports come from two places:

* automatically, without code changes: :func:`install` (called by the bootstrap before
  the script runs, only when the agent asked for reports) registers a global
  optimizer-step post hook as soon as ``torch.optim`` is imported -- at once when it
  already is (a worker forked from a template that preloaded torch), otherwise from an
  import hook, so a script that never imports torch never gets it imported;
* explicitly, with :func:`progress` (``elastrun.progress``): the step given, or the
  previous one plus one. Once a script calls it, the automatic reports stop: the
  script knows its steps better than the optimizer count does.

Outside elastrun (plain python, torchrun: no variable) :func:`progress` does nothing.

**Counting optimizer steps.** A script may step several optimizers per iteration (a
GAN's generator and discriminator, one optimizer per parameter group kind). One step is
counted per *iteration*: an optimizer stepping again -- or the first step ever -- starts
a new iteration; the other optimizers stepping before that belong to the same one. So
one optimizer counts its steps; two that alternate count pairs; an optimizer used once
at the start (a learning-rate probe) and never again does not freeze the count, as
"count the first optimizer seen" would. Optimizers are remembered by ``id`` only, never
referenced, so none is kept alive. Each process counts from 1: a script that resumes
from a checkpoint and wants its global step seen should call :func:`progress` with it.

**The record** and the file's layout are :mod:`elastrun.wire.progress`'s: a sequence
lock and a check word, so that the agent never reads a half-written record.

Processes forked from the worker (``DataLoader`` workers, ``os.fork``) do not report
(an ``os.register_at_fork`` hook forgets the record in the child), and the variables are
taken out of ``os.environ`` once read, so processes the worker starts do not write into
its record either.
"""

from __future__ import annotations

import mmap
import operator
import os
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from time import monotonic_ns
from types import ModuleType

from elastrun.core.errors import ConfigError
from elastrun.wire.progress import (
    MAX_STEP,
    PROGRESS_FILE_ENV,
    PROGRESS_SLOT_ENV,
    ProgressFileError,
    file_size,
    header_problem,
    record_check,
    slot_offset,
)

__all__ = [
    "PROGRESS_FILE_ENV",
    "PROGRESS_SLOT_ENV",
    "ProgressFileError",
    "install",
    "progress",
]

# --- the writer ------------------------------------------------------------------------


class Reporter:
    """Writes one worker's record. Made by :meth:`open`; one per process."""

    __slots__ = (
        "_base",
        "_last_ns",
        "_longest_ns",
        "_map",
        "_pid",
        "_reports",
        "_seq",
        "_step",
        "_step_ns",
        "_view",
        "path",
        "slot",
    )

    def __init__(self, mapping: mmap.mmap, path: str, slot: int) -> None:
        self._map = mapping
        self._view = memoryview(mapping).cast("q")
        self._base = slot_offset(slot)
        self._pid = os.getpid()
        self._seq = self._step = self._reports = 0
        self._last_ns = self._step_ns = self._longest_ns = 0
        self.path, self.slot = path, slot

    @classmethod
    def open(cls, path: str, slot: int) -> Reporter:
        """Map ``path`` and return the writer of record ``slot``.

        Raises:
            ProgressFileError: the file cannot be opened or mapped, is not a progress
                file of this version, or has no record ``slot``.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ProgressFileError(f"cannot open {path}: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < file_size(0):
                raise ProgressFileError(f"{path} is not a progress file ({size} bytes)")
            try:
                mapping = mmap.mmap(fd, size)
            except (OSError, ValueError) as exc:
                raise ProgressFileError(f"cannot map {path}: {exc}") from exc
        finally:
            os.close(fd)  # the mapping keeps what it needs
        words = memoryview(mapping).cast("q")
        try:
            problem = header_problem(words[:4].tolist(), size, slot)
        finally:
            words.release()
        if problem is not None:
            mapping.close()
            raise ProgressFileError(f"{path} {problem}")
        return cls(mapping, path, slot)

    def report(self, step: int | None) -> None:
        """Record a step (``None``: the previous one plus one) reached now."""
        # No lock, on purpose: two threads of one worker reporting at the same instant
        # may leave a record that readers reject (they keep the previous one) until the
        # next report rewrites it whole. A lock would cost every report more than this
        # rare, harmless case is worth (about 10 us of a 10 ms step, caches cold).
        now = monotonic_ns()
        prev = self._step
        if step is None:
            step = prev + 1
        reports = self._reports + 1
        step_ns, longest = self._step_ns, self._longest_ns
        if reports > 1:
            interval = now - self._last_ns
            if interval > longest:  # noqa: PLR1730 - a branch is cheaper than max()
                longest = interval
            advanced = step - prev
            per_step = interval // advanced if advanced > 1 else interval
            step_ns = per_step if reports == 2 else step_ns + ((per_step - step_ns) >> 3)
        self._step, self._reports, self._last_ns = step, reports, now
        self._step_ns, self._longest_ns = step_ns, longest
        seq = self._seq + 2
        self._seq = seq
        pid = self._pid
        v, b = self._view, self._base
        v[b] = seq - 1  # odd: a write is under way
        v[b + 1] = pid
        v[b + 2] = step
        v[b + 3] = reports
        v[b + 4] = now
        v[b + 5] = step_ns
        v[b + 6] = longest
        v[b + 7] = record_check(seq, pid, step, reports, now, step_ns, longest)
        v[b] = seq

    @property
    def step(self) -> int:
        return self._step

    def close(self) -> None:
        self._view.release()
        self._map.close()

    def __repr__(self) -> str:
        return (
            f"Reporter(path={self.path!r}, slot={self.slot}, step={self._step}, "
            f"reports={self._reports})"
        )


# --- process-wide state ----------------------------------------------------------------

_reporter: Reporter | None = None
_checked = False  # the variables were looked at (a reporter may or may not exist)
_explicit = False  # the script called progress(): automatic reports stop
_seen: set[int] = set()  # ids of the optimizers that stepped in this iteration
_hook_handle: object = None  # torch's handle of the registered hook (None: not registered)
_fork_hook_registered = False


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) must not write into its parent's record.
    global _reporter, _checked
    _reporter, _checked = None, True


def _bind_from_env() -> Reporter | None:
    """The reporter the environment asks for, made once per process (None: none)."""
    global _reporter, _checked, _fork_hook_registered
    if _checked:
        return _reporter
    _checked = True
    path = os.environ.pop(PROGRESS_FILE_ENV, None)
    slot_text = os.environ.pop(PROGRESS_SLOT_ENV, None)
    if not path:
        return None
    try:
        slot = int(slot_text or "")
    except ValueError:
        _warn(f"{PROGRESS_SLOT_ENV}={slot_text!r} is not a record number")
        return None
    try:
        _reporter = Reporter.open(path, slot)
    except ProgressFileError as exc:
        _warn(str(exc))
        return None
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_forget_in_child)
        _fork_hook_registered = True
    return _reporter


def _warn(message: str) -> None:
    # The worker runs on without reports; its log says why (once, at start).
    sys.stderr.write(f"elastrun: progress reports are off: {message}\n")


def _check_step(step: object) -> int:
    try:
        value = None if isinstance(step, bool) else operator.index(step)  # type: ignore[arg-type]  # TypeError is the check
    except TypeError:
        value = None
    if value is None or not 0 <= value <= MAX_STEP:
        raise ConfigError("step", step, f"must be an integer from 0 to {MAX_STEP}")
    return int(value)


def progress(step: int | None = None) -> None:
    """Tell the agent that this worker made progress: it reached ``step``.

    Args:
        step: the step reached (a non-negative integer); ``None`` (default): the
            previously reported step plus one (the first call reports 1).

    Once called, the automatic reports from optimizer steps stop for this process.
    Outside elastrun -- plain ``python``, ``torchrun`` -- it does nothing (the step is
    still checked, so a script behaves the same everywhere).

    Raises:
        ConfigError: ``step`` is not an integer from 0 to 2**63-1 (also a ValueError).
    """
    global _explicit
    checked = None if step is None else _check_step(step)
    reporter = _reporter if _checked else _bind_from_env()
    if reporter is None:
        return
    _explicit = True
    reporter.report(checked)


# --- automatic reports from torch's optimizer steps --------------------------------------

_OPTIMIZER_MODULE = "torch.optim.optimizer"


def _on_optimizer_step(optimizer: object, args: object, kwargs: object) -> None:
    """torch's global optimizer-step post hook: one report per training iteration."""
    reporter = _reporter
    if reporter is None or _explicit:
        return
    oid = id(optimizer)
    if _seen and oid not in _seen:
        _seen.add(oid)  # another optimizer of the same iteration
        return
    # A new iteration (this optimizer steps again), or the very first step.
    _seen.clear()
    _seen.add(oid)
    reporter.report(None)


def _register_hook(module: ModuleType) -> None:
    global _hook_handle
    if _hook_handle is not None:
        return
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is None:
        _warn(f"{module.__name__} has no register_optimizer_step_post_hook")
        return
    handle = register(_on_optimizer_step)
    _hook_handle = True if handle is None else handle  # torch returns a RemovableHandle


class _ChainedLoader:
    """Runs the real loader of one module, then a callback with the module.

    Visible only while the module executes: its ``__loader__`` and
    ``__spec__.loader`` are the real loader again before any of its code runs.
    """

    def __init__(self, loader: object, then: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader  # type: ignore[assignment]  # the real one
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader  # type: ignore[assignment]  # the real one
        self._loader.exec_module(module)  # type: ignore[attr-defined]  # checked when wrapped
        self._then(module)

    def __repr__(self) -> str:
        return f"_ChainedLoader({self._loader!r})"


class _OptimizerImportWatcher:
    """A meta path finder that hooks ``torch.optim.optimizer`` when it is imported.

    It finds nothing itself: for that one module it asks the finders after it and
    wraps the loader they return; then it leaves ``sys.meta_path``. Every other import
    costs one string comparison.
    """

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _OPTIMIZER_MODULE:
            return None
        self.remove()
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec: ModuleSpec | None = find(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                # Duck-typed: importlib.abc.Loader would cost every worker its import.
                spec.loader = _ChainedLoader(spec.loader, _register_hook)  # type: ignore[assignment]  # duck-typed
            return spec
        return None

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass

    def __repr__(self) -> str:
        return "_OptimizerImportWatcher()"


def install() -> bool:
    """Start reporting, if the agent asked for it: the bootstrap calls this first.

    Maps this worker's record (the variables are then removed from ``os.environ``) and
    hooks torch's optimizer steps: at once if ``torch.optim`` is already imported,
    otherwise when the script imports it. Never imports torch. Idempotent; a file that
    cannot be used leaves the worker running without reports (one line on stderr).

    Returns:
        Whether reports are on.
    """
    if _bind_from_env() is None:
        return False
    module = sys.modules.get(_OPTIMIZER_MODULE)
    if module is not None:
        _register_hook(module)
    elif _hook_handle is None and not any(
        isinstance(f, _OptimizerImportWatcher) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _OptimizerImportWatcher())
    return True
