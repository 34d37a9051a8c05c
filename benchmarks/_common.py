"""Helpers shared by the benchmarks: run a launcher under a deadline, measure it, clean up.

Every launcher runs in a session of its own (``start_new_session=True``). Its workers may
live in sessions of their own too (torchrun puts each worker in a new session), so
cleanup is two-step: stop the launcher's process group (SIGTERM, then SIGKILL), then kill
any process whose command line still carries the run's unique directory. That directory
is passed to every worker in argv, so only processes this benchmark started can match;
nothing is ever killed by name.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil  # type: ignore[import-untyped]  # no stubs in the venv

CLK_TCK = os.sysconf("SC_CLK_TCK")
MB = 1024 * 1024


@dataclass(frozen=True)
class Launcher:
    """One launcher under test: a name, its executable and environment extras."""

    name: str
    exe: Path

    def available(self) -> str | None:
        """None if the executable exists and is runnable, else the reason it is not."""
        if not self.exe.exists():
            return f"{self.exe} does not exist"
        if not os.access(self.exe, os.X_OK):
            return f"{self.exe} is not executable"
        return None

    def command(
        self, nproc: int, script: Path, script_args: Sequence[str], *extra: str
    ) -> list[str]:
        """The command line: identical flags for every launcher."""
        return [
            str(self.exe),
            "--standalone",
            f"--nproc-per-node={nproc}",
            *extra,
            str(script),
            *script_args,
        ]


@dataclass
class RunOutcome:
    """What one launcher invocation did and cost."""

    returncode: int | None
    t_invoke: float  # wall clock (time.time()) just before the launcher was started
    wall_s: float  # monotonic seconds from invoke until the launcher exited
    cpu_s: float | None  # the launcher process's own user+system CPU seconds
    timed_out: bool
    stderr_tail: str
    stdout_tail: str
    probe: dict[str, float] = field(default_factory=dict)
    probe_error: str | None = None
    left_behind: list[int] = field(default_factory=list)

    def failure(self) -> str | None:
        """A one-paragraph description of what went wrong, or None if the run was clean."""
        if self.timed_out:
            return f"timed out after {self.wall_s:.1f} s; stderr tail:\n{self.stderr_tail}"
        if self.returncode != 0:
            tail = self.stderr_tail or self.stdout_tail
            return f"exit code {self.returncode}; output tail:\n{tail}"
        if self.left_behind:
            return f"left processes behind (killed them): {self.left_behind}"
        return None


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _own_cpu_seconds(pid: int) -> float | None:
    """User+system CPU of an exited, not yet reaped process (a zombie), children excluded.

    Read from /proc while the process is a zombie: its counters are final then, and unlike
    wait4's rusage they do not include the workers it reaped.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the ")" closing the command name: state is field 0, utime 11, stime 12.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


BENCH_TAG = "ELASTRUN_BENCH_RUN"


def procs_marked(marker: str) -> list[psutil.Process]:
    """Live processes started by this run: they carry ``ELASTRUN_BENCH_RUN=<marker>`` in
    their environment, which the launcher and every worker inherit from us. (Never a
    match on names or command lines, which could reach processes that are not ours.)"""
    needle = f"{BENCH_TAG}={marker}".encode()
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            if needle in env:
                found.append(psutil.Process(int(entry)))
        except (OSError, psutil.Error):
            continue
    return found


def kill_marked(marker: str) -> list[int]:
    """SIGKILL every live process carrying `marker`; return their pids."""
    killed = []
    for p in procs_marked(marker):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
            killed.append(p.pid)
    return killed


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the launcher's process group, then SIGKILL it after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_launcher(
    cmd: Sequence[str],
    *,
    marker: str,
    log_dir: Path,
    timeout_s: float,
    env_extra: Mapping[str, str] | None = None,
    probe_at_s: float | None = None,
    probe: Callable[[psutil.Process], dict[str, float]] | None = None,
) -> RunOutcome:
    """Start `cmd` in a new session, wait for it with a deadline, measure it, clean up.

    Args:
        cmd: the launcher command line.
        marker: a string unique to this run, put in the launcher's environment (and so
            every worker's); processes still carrying it after the run are killed and
            reported.
        log_dir: where the launcher's stdout and stderr go (files, never pipes, so a
            chatty launcher cannot block on a full pipe).
        timeout_s: after this, the launcher's group is stopped and the run is a failure.
        env_extra: variables added to this process's environment for the launcher.
        probe_at_s: when to call `probe`, in seconds after the launcher was started.
        probe: called once with the live launcher process; returns named measurements.
    """
    env = dict(os.environ)
    env.update(env_extra or {})
    env[BENCH_TAG] = marker
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / "launcher.stdout", log_dir / "launcher.stderr"
    probed: dict[str, float] = {}
    probe_error: str | None = None
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        t_invoke = time.time()
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(
                list(cmd), stdout=out, stderr=err, env=env, start_new_session=True
            )
        except OSError as exc:
            return RunOutcome(None, t_invoke, 0.0, None, False, f"cannot start: {exc}", "")
    # A pidfd turns "has it exited?" into a poll with a timeout: no sleep loop.
    pidfd = os.pidfd_open(proc.pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        deadline = t0 + timeout_s
        probe_due = t0 + probe_at_s if probe is not None and probe_at_s is not None else None
        timed_out = False
        while True:
            wake = deadline if probe_due is None else min(deadline, probe_due)
            if poller.poll(max(0, round((wake - time.monotonic()) * 1000))):
                break
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if probe is not None and probe_due is not None and now >= probe_due:
                probe_due = None
                try:
                    probed = probe(psutil.Process(proc.pid))
                except (psutil.Error, OSError, ValueError) as exc:
                    probe_error = f"{type(exc).__name__}: {exc}"
        wall_s = time.monotonic() - t0
        cpu_s: float | None = None
        if timed_out:
            _stop_group(proc, grace_s=5.0)
        else:
            # Exited but not reaped: read its own CPU counters, then reap it.
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            cpu_s = _own_cpu_seconds(proc.pid)
            proc.wait()
            # Anything left in the launcher's own group is ours; stop it too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        os.close(pidfd)
    left = kill_marked(marker)
    return RunOutcome(
        returncode=proc.returncode,
        t_invoke=t_invoke,
        wall_s=wall_s,
        cpu_s=cpu_s,
        timed_out=timed_out,
        stderr_tail=_tail(err_path),
        stdout_tail=_tail(out_path),
        probe=probed,
        probe_error=probe_error,
        left_behind=left,
    )


def read_float(path: Path) -> float:
    """The first whitespace-separated field of a small file, as a float."""
    return float(path.read_text().split()[0])


@dataclass(frozen=True)
class Summary:
    """Median and range of a list of samples."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def render(self, fmt: str) -> str:
        if not self.samples:
            return "-"
        lo, hi = min(self.samples), max(self.samples)
        return f"{self.median:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, str]:
    """Facts about this machine and environment worth printing next to numbers."""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "host cpus": f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})",
        "cpu model": _cpu_model(),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": _version("torch"),
        "elastrun": _version("elastrun"),
        "psutil": _version("psutil"),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
