"""Starting workers by forking them from a pre-imported template process (a "zygote").

A fresh Python worker that imports torch spends seconds importing it, on the first start
and on every restart. ``TemplateStarter`` pays that once per agent: it starts one
template interpreter (:mod:`elastrun.template.worker.serve`) that imports the modules the
workers need and then waits; every worker is forked from it in milliseconds and then runs
exactly as ``python -m elastrun.worker.bootstrap`` would have run it.

The workers stay the agent's children (the agent is a child subreaper while a worker is
handed over, see :mod:`elastrun.template.worker.serve`), so everything the agent does
with a worker -- its pidfd, ``waitid`` without reaping, ``killpg``, ``waitpid`` for the
real exit status, the parent-death signal, the orphan guard -- works as with
``SubprocessStarter``.

Only Python script workers go through the template (:mod:`~elastrun.template.agent.preload`
says which). Anything else (other executables, function workers) goes to the fallback
starter, and so does every worker when the template is unusable -- a preloaded module
started a thread or initialised CUDA, the template could not start, or a fork failed --
with one warning line saying why. A template that died is started again on the next
start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterable, Sequence

from elastrun.core.cancel import Cancelled, CancelScope
from elastrun.core.errors import ShutdownRequested
from elastrun.core.procinfo import is_open, parent_pid
from elastrun.core.shutdown import ShutdownRequest
from elastrun.supervise.processes.spawn import (
    ProcessSpec,
    ProcessStarter,
    SubprocessStarter,
    WorkerProcess,
    adopt_child,
    kill_started,
)
from elastrun.template.agent.key import (
    PER_WORKER_VARIABLES,
    TemplateKey,
    describe_change,
    is_per_worker_variable,
)
from elastrun.template.agent.preload import (
    AUTO_PRELOAD_ROOTS,
    LAZY_TORCH_IMPORTS,
    BootstrapCommand,
    default_preload,
    parse_bootstrap_command,
)
from elastrun.template.agent.process import (
    Template,
    TemplateBroken,
    TemplateUnavailable,
)
from elastrun.wire.bootstrap import BOOTSTRAP_MODULE
from elastrun.wire.template import BATCH_MAX, VERSION

__all__ = [
    "AUTO_PRELOAD_ROOTS",
    "BOOTSTRAP_MODULE",
    "LAZY_TORCH_IMPORTS",
    "PER_WORKER_VARIABLES",
    "BootstrapCommand",
    "TemplateStarter",
    "default_preload",
    "is_per_worker_variable",
    "parse_bootstrap_command",
]

log = logging.getLogger(__name__)

# Preloading torch takes seconds; on a loaded 2-core machine many more.
_READY_TIMEOUT = 300.0
# A fork of a large template takes milliseconds; this only ends a wedged template.
_SPAWN_TIMEOUT = 30.0

#: A worker the template would serve: its index, spec, command and working directory.
_Forkable = tuple[int, ProcessSpec, BootstrapCommand, str]


def _umask() -> int:
    # /proc says it without the set-and-restore dance of os.umask, which would race
    # with other threads creating files.
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _ignored_signals() -> list[int]:
    """Signals this process ignores, which ``exec`` passes on to a fresh worker."""
    out = []
    for sig in signal.valid_signals():
        # Popen resets these to the default before exec; python then ignores them.
        if sig in (signal.SIGPIPE, signal.SIGXFSZ):
            continue
        with contextlib.suppress(ValueError):
            if signal.getsignal(sig) == signal.SIG_IGN:
                out.append(int(sig))
    return out


def _advice(reason: str) -> str:
    """What the user can change, for a reason the template gave (its wording: worker/serve.py's
    ``_fork_hazard`` and ``_preload``, the spawn check in worker/fork.py)."""
    if "thread" in reason:
        return (
            ". A module that starts threads when imported cannot be preloaded (a forked "
            "worker could inherit a lock held forever): take it out of --preload, or set "
            "the variable that sizes its thread pool to 1 for the launcher"
        )
    if "CUDA" in reason:
        return (
            ". A process that has initialised CUDA cannot fork workers that use it: take "
            "the module out of --preload, or move its CUDA calls out of import time"
        )
    if reason.startswith("cannot preload"):
        return ". Check the names given to --preload"
    if reason.startswith("cannot start") or "protocol version" in reason:
        return (
            ". The workers' interpreter (PYTHON_EXEC) must have this elastrun installed: "
            "the same version as the launcher"
        )
    return ""


def _spawn_request(
    spec: ProcessSpec, cmd: BootstrapCommand, cwd: str
) -> tuple[dict[str, object], list[int]]:
    """The spawn request for ``spec``'s worker and the descriptors to send with it:
    what a fresh process started by this agent now would inherit."""
    assert spec.argv is not None
    wanted = (
        0,
        spec.stdout_fd if spec.stdout_fd is not None else 1,
        spec.stderr_fd if spec.stderr_fd is not None else 2,
    )
    # The agent's own stdin/stdout/stderr stand in for "inherit", as with Popen;
    # a closed one stays closed in the worker.
    present = [is_open(fd) for fd in wanted]
    request: dict[str, object] = {
        "version": VERSION,
        "argv": list(spec.argv),
        "bootstrap_args": list(cmd.args),
        "env": dict(spec.env),
        "cwd": cwd,
        "umask": _umask(),
        "agent_pid": os.getpid(),
        "death_signal": int(spec.death_signal),
        "ignored_signals": _ignored_signals(),
        "blocked_signals": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "stdio": present,
        # Its NUMA binding, else what a fresh process would inherit from the agent now.
        "cpus": sorted(spec.cpus or os.sched_getaffinity(0)),
    }
    return request, [fd for fd, ok in zip(wanted, present, strict=True) if ok]


class TemplateStarter:
    """A ``ProcessStarter`` that forks Python workers from a pre-imported template.

    Args:
        python: the interpreter of the template; only workers started with this
            interpreter go through it.
        preload: modules the template imports (``--preload``), in order.
        fallback: the starter for everything the template does not start (default: a
            ``SubprocessStarter`` for ``python``).
        auto_preload: also preload what :func:`default_preload` finds in the script.
        per_worker_variables: more variables (beyond ``PER_WORKER_VARIABLES``) that
            differ between workers or restarts and must not start a new template.
        ready_timeout: how long the template may take to start and preload.
        spawn_timeout: how long one fork may take before the template counts as wedged.
        shutdown: the launcher's stop request: its scope ends the waits for the
            template's start-up and answers at once (``ShutdownRequested``). Without
            one they end with the calling thread's current scope (``Cancelled``).

    The template is started by the first ``start`` that needs it (constructing the
    starter does nothing) and stopped by ``close``.
    """

    def __init__(
        self,
        python: str = sys.executable,
        preload: Sequence[str] = (),
        fallback: ProcessStarter | None = None,
        *,
        auto_preload: bool = True,
        per_worker_variables: Iterable[str] = (),
        ready_timeout: float = _READY_TIMEOUT,
        spawn_timeout: float = _SPAWN_TIMEOUT,
        shutdown: ShutdownRequest | None = None,
    ) -> None:
        self._shutdown = shutdown
        self._python = python
        self._preload = list(dict.fromkeys(preload))
        self._fallback: ProcessStarter = (
            fallback if fallback is not None else SubprocessStarter(python)
        )
        self._auto = auto_preload
        self._per_worker = frozenset(per_worker_variables)
        self._ready_timeout = ready_timeout
        self._spawn_timeout = spawn_timeout
        self._template: Template | None = None
        self._unusable: dict[TemplateKey, str] = {}
        self._closed = False
        #: How many workers were forked from a template / handed to the fallback.
        self.forked = 0
        self.fell_back = 0
        #: How many templates were started (the first, and one per recreation).
        self.templates_started = 0

    @property
    def template_pid(self) -> int | None:
        """The running template's pid, if one is running."""
        tpl = self._template
        return tpl.pid if tpl is not None and tpl.alive() else None

    @property
    def unusable_reason(self) -> str | None:
        """Why the last template could not be used, if it could not."""
        return next(reversed(self._unusable.values()), None)

    def start(self, spec: ProcessSpec) -> WorkerProcess:
        """Start one worker: forked from the template when it can be, else the fallback.

        Raises:
            ProcessStartError: from the fallback starter, as it would raise it.
        """
        return self.start_many([spec])[0]

    def start_many(self, specs: Sequence[ProcessSpec]) -> list[WorkerProcess]:
        """Start the workers of ``specs`` (all or none), in order: those the template
        serves in one batch (their forks overlap), the others with the fallback.

        Raises:
            ProcessStartError: from the fallback starter, as it would raise it, after
                the workers already started were killed.
        """
        started: dict[int, WorkerProcess] = {}
        try:
            forkable = self._forkable(specs)
            if forkable:
                started.update(self._fork_batch(forkable))
            for i, spec in enumerate(specs):
                if i not in started:
                    self.fell_back += 1
                    started[i] = self._fallback.start(spec)
        except BaseException:
            kill_started(list(started.values()))
            raise
        return [started[i] for i in range(len(specs))]

    def _forkable(self, specs: Sequence[ProcessSpec]) -> list[_Forkable]:
        """The specs the template would serve: Python scripts of the starter's
        interpreter whose shared environment is the first one's (workers of one group
        always share it)."""
        out = []
        key = None
        for i, spec in enumerate(specs):
            if spec.argv is None or self._closed:
                continue
            cmd = parse_bootstrap_command(spec.argv, self._python)
            if cmd is None:
                continue
            own = TemplateKey.of(cmd, spec.env, self._per_worker)
            if key is not None and own != key:
                continue
            key = own
            out.append((i, spec, cmd, spec.cwd if spec.cwd is not None else os.getcwd()))
        return out

    def _fork_batch(self, batch: list[_Forkable]) -> dict[int, WorkerProcess]:
        """Fork what ``batch`` asks for; returns the started workers by index (those
        missing go to the fallback)."""
        _, first, cmd, cwd = batch[0]
        tpl = self._ready_template(first, cmd, cwd)
        if tpl is None:
            return {}
        started: dict[int, WorkerProcess] = {}
        # Batches of at most BATCH_MAX: the workers of each batch are adopted before the
        # next is asked for, so a template breaking midway loses none that runs.
        for at in range(0, len(batch), BATCH_MAX):
            part = batch[at : at + BATCH_MAX]
            answers = self._ask(tpl, part)
            if answers is None:
                break  # the template is gone: the rest start fresh
            for (i, spec, _, _), answer in zip(part, answers, strict=True):
                proc = self._adopt(spec, answer)
                if proc is not None:
                    started[i] = proc
        return started

    def _ask(self, tpl: Template, part: list[_Forkable]) -> list[int | str] | None:
        """The template's answer to one batch, or None (logged, the template discarded)
        when it broke or became unusable."""
        wire = [_spawn_request(spec, cmd, cwd) for _, spec, cmd, cwd in part]
        requests, fds = [r for r, _ in wire], [f for _, f in wire]
        try:
            answers = tpl.spawn_batch(requests, fds, self._spawn_timeout, self._scope())
        except Cancelled as exc:
            self._discard()  # killed by spawn_batch
            raise self._stopped(exc) from None
        except TemplateBroken as exc:
            log.warning(
                "worker template (pid %d) failed while starting local rank(s) %s (%s; %s); "
                "starting them as fresh processes",
                tpl.pid,
                ", ".join(str(spec.local_rank) for _, spec, _, _ in part),
                exc,
                tpl.exit_description(),
            )
            self._discard()
        except TemplateUnavailable as exc:
            self._disable(tpl.key, str(exc))
            self._discard()
        else:
            if not tpl.alive():
                self._discard()  # killed by spawn_batch after a signal
            return answers
        return None

    def _adopt(self, spec: ProcessSpec, answer: int | str) -> WorkerProcess | None:
        """The handle of a forked worker, or None (logged) when it was not started."""
        if isinstance(answer, str):
            reason = answer
        elif parent_pid(answer) != os.getpid():
            # Not handed to us (no subreaper support?): it exits by itself on seeing
            # that, and cannot be supervised.
            reason = f"worker pid {answer} was not adopted by the agent"
        else:
            self.forked += 1
            return adopt_child(spec.local_rank, answer)
        log.warning(
            "worker template could not start local rank %d (%s); starting it as a fresh process",
            spec.local_rank,
            reason,
        )
        return None

    def prepare(self, spec: ProcessSpec) -> None:
        """Start the template ``spec``'s worker would use, without waiting for it.

        Optional: calling it early (before the rendezvous) overlaps the template's
        imports with the wait for other nodes. Never raises for template problems;
        the next ``start`` reports them.
        """
        for _, _, cmd, cwd in self._forkable([spec]):
            self._template_for(spec, cmd, cwd)

    def _ready_template(
        self, spec: ProcessSpec, cmd: BootstrapCommand, cwd: str
    ) -> Template | None:
        tpl = self._template_for(spec, cmd, cwd)
        if tpl is None or tpl.ready:
            return tpl
        try:
            tpl.await_ready(self._ready_timeout, self._scope())
        except Cancelled as exc:
            raise self._stopped(exc) from None
        except TemplateUnavailable as exc:
            self._disable(tpl.key, str(exc))
            self._discard()
            return None
        log.info(
            "worker template pid %d ready in %.2fs (preloaded: %s)",
            tpl.pid,
            tpl.ready_seconds,
            ", ".join(tpl.preloaded) or "nothing",
        )
        return tpl

    def _scope(self) -> CancelScope | None:
        """The scope of the waits for the template (None: the thread's current one)."""
        return self._shutdown.scope if self._shutdown is not None else None

    def _stopped(self, exc: Cancelled) -> Exception:
        """What a start ended by ``exc`` raises: ``ShutdownRequested`` for the stop
        request's signal, else the cancellation itself."""
        signum = self._shutdown.signum if self._shutdown is not None else None
        return exc if signum is None else ShutdownRequested(signum)

    def _disable(self, key: TemplateKey, reason: str) -> None:
        self._unusable[key] = reason
        log.warning(
            "worker template disabled (%s); starting workers as fresh processes, so every "
            "start and restart pays the imports again%s",
            reason,
            _advice(reason),
        )

    def _template_for(self, spec: ProcessSpec, cmd: BootstrapCommand, cwd: str) -> Template | None:
        """The live template for ``spec``'s worker, launched (not awaited) when there is
        none."""
        key, argv = TemplateKey.of(cmd, spec.env, self._per_worker), spec.argv
        assert argv is not None
        if key in self._unusable:
            return None
        tpl = self._template
        if tpl is not None:
            if tpl.key != key:
                log.info(
                    "the workers' shared environment changed (%s); replacing the worker "
                    "template", describe_change(tpl.key, key),
                )  # fmt: skip
            elif tpl.ready and not tpl.alive():
                log.warning(
                    "worker template (pid %d) died (%s); starting a new one",
                    tpl.pid, tpl.exit_description(),
                )  # fmt: skip
            else:
                return tpl
            self._discard()
        optional = default_preload(argv, cwd) if self._auto else []
        try:
            tpl = Template.launch(self._python, key, self._preload, optional, argv)
        except TemplateUnavailable as exc:
            self._disable(key, str(exc))
            return None
        self._template = tpl
        self.templates_started += 1
        return tpl

    def _discard(self) -> None:
        tpl, self._template = self._template, None
        if tpl is not None:
            tpl.close()

    def close(self) -> None:
        """Stop the template. Idempotent; workers already started are not affected."""
        self._closed = True
        self._discard()

    def __enter__(self) -> TemplateStarter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        tpl = self._template
        state = "closed" if self._closed else (repr(tpl) if tpl is not None else "no template")
        return (
            f"TemplateStarter(python={self._python!r}, preload={self._preload}, {state}, "
            f"forked={self.forked}, fell_back={self.fell_back})"
        )
