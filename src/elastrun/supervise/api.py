"""``start_processes``: torch's process-context API over elastrun's supervision.

For code written against ``torch.distributed.elastic.multiprocessing``: start N
workers (a function, or an executable), wait for them, close them. The workers start as
the agent's do (``supervise.processes.group``: all or none), under the same supervision
(starters, ``ProcessSet``, the output relay).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from elastrun.core.clock import Deadline
from elastrun.supervise.failures.failure import ProcessFailure
from elastrun.supervise.processes.group import GroupMember, start_group
from elastrun.supervise.processes.logs import LogsDest, LogsSpecs, reify_or_console
from elastrun.supervise.processes.numa import binding_cpus, numa_options_from
from elastrun.supervise.processes.procset import ProcessSet
from elastrun.supervise.processes.relay import PYTHON_CONSOLE, OutputRelay, WorkerStdio
from elastrun.supervise.processes.spawn import (
    ForkStarter,
    FunctionCall,
    ProcessSpec,
    ProcessStarter,
    SubprocessStarter,
)


@dataclass
class RunProcsResult:
    """Results by local rank: return values of successful runs, failures otherwise."""

    return_values: dict[int, object] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return len(self.failures) > 0


class PContext:
    """A started group of processes (see ``start_processes``)."""

    def __init__(
        self,
        name: str,
        entrypoint: Callable[..., object] | str,
        args: Mapping[int, tuple[object, ...]],
        envs: Mapping[int, Mapping[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: Mapping[int, str] | None = None,
        start_method: str = "spawn",
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
        numa_options: object | None = None,
    ) -> None:
        nprocs = len(args)
        if set(args) != set(range(nprocs)) or set(envs) != set(range(nprocs)):
            # RuntimeError, not ValueError: torch's check raises it, and callers catch it.
            raise RuntimeError(
                f"args and envs must both have keys 0..{nprocs - 1}; "
                f"got {sorted(args)} and {sorted(envs)}"
            )
        self.name = name
        self.entrypoint = entrypoint
        self.args = dict(args)
        self.envs = {lr: dict(e) for lr, e in envs.items()}
        self.nprocs = nprocs
        self._logs_specs = logs_specs
        self._prefixes = dict(log_line_prefixes or {})
        self._start_method = start_method
        self._filters = (duplicate_stdout_filters or [], duplicate_stderr_filters or [])
        self._numa = numa_options_from(numa_options)
        self._dest: LogsDest | None = None
        self._relay: OutputRelay | None = None
        self._procs: ProcessSet | None = None
        self._return_dir: str | None = None
        self._result: RunProcsResult | None = None

    @property
    def stdouts(self) -> dict[int, str]:
        return dict(self._dest.stdouts) if self._dest else {}

    @property
    def stderrs(self) -> dict[int, str]:
        return dict(self._dest.stderrs) if self._dest else {}

    @property
    def error_files(self) -> dict[int, str]:
        return dict(self._dest.error_files) if self._dest else {}

    def start(self) -> None:
        # A binding that cannot be made fails here, before anything started or any log
        # file was made.
        cpus = {lr: binding_cpus(self._numa, lr, self.nprocs) for lr in range(self.nprocs)}
        full_envs = {lr: {**os.environ, **e} for lr, e in self.envs.items()}
        dest = self._dest = reify_or_console(self._logs_specs, full_envs)
        # Tee'd lines go to the caller's sys.stdout/sys.stderr, as they are now (torch's
        # behaviour): a redirect_stdout, capsys or notebook cell around us sees them.
        relay = self._relay = OutputRelay(
            console=PYTHON_CONSOLE,
            filtered_stdout=dest.filtered_stdout,
            filtered_stderr=dest.filtered_stderr,
            stdout_filters=self._filters[0],
            stderr_filters=self._filters[1],
        )
        shown = self._logs_specs.local_ranks_filter
        fork = callable(self.entrypoint) and self._start_method == "fork"
        starter: ProcessStarter = ForkStarter() if fork else SubprocessStarter(sys.executable)

        members = [
            GroupMember(
                lr,
                prefix=self._prefixes.get(lr, f"[{self.name}{lr}]:"),
                show_on_console=shown is None or lr in shown,
                make_spec=functools.partial(self._spec, lr, full_envs[lr], cpus[lr]),
            )
            for lr in range(self.nprocs)
        ]
        self._procs = ProcessSet(start_group(starter, relay, dest, members))

    def _spec(
        self, lr: int, env: dict[str, str], cpus: frozenset[int] | None, stdio: WorkerStdio
    ) -> ProcessSpec:
        out, err = stdio.stdout_fd, stdio.stderr_fd
        if isinstance(self.entrypoint, str):
            argv = (self.entrypoint, *(str(a) for a in self.args[lr]))
            return ProcessSpec(lr, env, argv=argv, stdout_fd=out, stderr_fd=err, cpus=cpus)
        if self._return_dir is None:
            self._return_dir = tempfile.mkdtemp(prefix="elastrun-ret-")
        call = FunctionCall(
            self.entrypoint, self.args[lr], os.path.join(self._return_dir, f"{lr}.pkl")
        )
        return ProcessSpec(lr, env, call=call, stdout_fd=out, stderr_fd=err, cpus=cpus)

    def pids(self) -> dict[int, int]:
        return self._procs.pids() if self._procs else {}

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Wait until all processes succeed or any fails (then the rest are stopped).

        ``timeout`` 0 checks once, a negative value waits forever. ``period`` is accepted
        for compatibility; exits are observed as events, not by polling.
        """
        if self._result is not None:
            return self._result
        assert self._procs is not None, "start() first"
        deadline = Deadline.never() if timeout < 0 else Deadline.after(timeout)
        while True:
            self._procs.wait_for_exits(deadline)
            failed = any(e.exitcode != 0 for e in self._procs.exits.values())
            if failed or not self._procs.running():
                if failed:
                    self._procs.stop(signal.SIGTERM, 30.0)
                self._result = self._collect()
                self.close()
                return self._result
            if deadline.expired():
                return None

    def _collect(self) -> RunProcsResult:
        assert self._procs is not None and self._dest is not None
        result = RunProcsResult(stdouts=self.stdouts, stderrs=self.stderrs)
        procs = self._procs.processes
        for lr, ex in sorted(self._procs.exits.items()):
            if ex.exitcode == 0:
                result.return_values[lr] = procs[lr].return_value()
                continue
            result.failures[lr] = ProcessFailure(
                local_rank=lr,
                pid=ex.pid,
                exitcode=ex.exitcode,
                error_file=self._dest.error_files.get(lr, ""),
                observed_at=ex.observed_at,
                terminated_by_agent=ex.by_agent,
                stderr_file=self._dest.stderrs.get(lr) or None,
            )
        if result.failures:
            result.return_values = {}
        return result

    def close(self, death_sig: signal.Signals | None = None, timeout: float = 30) -> None:
        """Stop every process (``death_sig``, default SIGTERM; SIGKILL after ``timeout``)."""
        if self._procs is not None:
            self._procs.stop(death_sig or signal.SIGTERM, timeout)
            self._procs.close()
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        if self._return_dir:
            shutil.rmtree(self._return_dir, ignore_errors=True)
            self._return_dir = None

    def __repr__(self) -> str:
        return f"PContext(name={self.name!r}, nprocs={self.nprocs}, procs={self._procs!r})"


def start_processes(
    name: str,
    entrypoint: Callable[..., object] | str,
    args: Mapping[int, tuple[object, ...]],
    envs: Mapping[int, Mapping[str, str]],
    logs_specs: LogsSpecs,
    log_line_prefixes: Mapping[int, str] | None = None,
    start_method: str = "spawn",
    numa_options: object | None = None,
    duplicate_stdout_filters: list[str] | None = None,
    duplicate_stderr_filters: list[str] | None = None,
) -> PContext:
    """Start ``len(args)`` copies of ``entrypoint``; returns the running context.

    Raises:
        RuntimeError: ``args``/``envs`` keys are not exactly ``0..n-1`` (torch's type).
        FileNotFoundError: the executable does not exist (an
            ``ExecutableNotFoundError``, also a ``ProcessStartError``).
        ProcessStartError: a worker could not be started otherwise.
        ConfigError: ``numa_options`` names an unknown mode, or asks for a binding this
            machine cannot give (without its fallback); nothing is started then.
    """
    ctx = PContext(
        name,
        entrypoint,
        args,
        envs,
        logs_specs,
        log_line_prefixes,
        start_method,
        duplicate_stdout_filters,
        duplicate_stderr_filters,
        numa_options,
    )
    try:
        ctx.start()
    except BaseException:
        ctx.close()
        raise
    return ctx
