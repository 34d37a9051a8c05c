"""Applying a binding: ``numactl`` for command workers, ``sched_setaffinity`` for functions."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Sequence

from elastrun.core.errors import ConfigError
from elastrun.supervise.processes.numa.topology import FIELD, format_cpu_list

__all__ = ["apply_affinity", "wrap_command"]

log = logging.getLogger(__name__)


def wrap_command(
    argv: Sequence[str],
    cpus: Iterable[int],
    *,
    fallback: bool = False,
    which: Callable[[str], str | None] = shutil.which,
) -> tuple[str, ...]:
    """Prefix ``argv`` with ``numactl --physcpubind=<cpus>``.

    ``numactl`` replaces itself with the command (exec), so the worker keeps the pid
    the agent started, and every thread it creates inherits the binding.

    Args:
        argv: the worker's command line.
        cpus: the CPUs to bind to (non-empty).
        fallback: when ``numactl`` is not installed, log a warning and return ``argv``
            unchanged instead of raising.
        which: how to look an executable up on PATH (injected by tests).

    Raises:
        ConfigError: ``numactl`` is missing (without ``fallback``) or ``cpus`` is empty.
    """
    cpu_list = format_cpu_list(cpus)
    if not cpu_list:
        raise ConfigError(FIELD, cpu_list, "cannot bind a worker to an empty set of CPUs")
    if which("numactl") is None:
        reason = "binding a command needs the numactl executable, which is not on PATH"
        if fallback:
            log.warning("NUMA binding skipped: %s", reason)
            return tuple(argv)
        raise ConfigError(FIELD, "numactl", f"{reason} (install the numactl package)")
    return ("numactl", f"--physcpubind={cpu_list}", *argv)


def apply_affinity(cpus: Iterable[int], *, task_dir: str = "/proc/self/task") -> None:
    """Bind the calling process to ``cpus`` (for function workers, before the function).

    The calling thread is bound, then every other thread of the process whose affinity
    is still the calling thread's original one; a thread that some library already
    pinned elsewhere is left alone on purpose.

    Args:
        cpus: the CPUs to bind to (non-empty).
        task_dir: where the process's threads are listed (``/proc/self/task``).

    Raises:
        ConfigError: ``cpus`` is empty or the kernel refused the calling thread's new
            affinity (CPUs outside this process's cpuset).
    """
    wanted = set(cpus)
    if not wanted:
        raise ConfigError(FIELD, "", "cannot bind a worker to an empty set of CPUs")
    original = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, wanted)
    except OSError as exc:
        raise ConfigError(
            FIELD, format_cpu_list(wanted), f"the kernel refused the binding: {exc.strerror}"
        ) from exc
    own_tid = threading.get_native_id()
    for name in os.listdir(task_dir):
        if not name.isdecimal() or int(name) == own_tid:
            continue
        tid = int(name)
        try:
            if os.sched_getaffinity(tid) == original:
                os.sched_setaffinity(tid, wanted)
        except (ProcessLookupError, PermissionError) as exc:
            # The thread ended between listing and binding (or belongs to a sandboxed
            # helper we may not touch): nothing of ours runs there any more.
            log.debug("thread %d not bound: %s", tid, exc)
