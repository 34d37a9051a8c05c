"""Helpers shared by the benchmarks: start a launcher, measure it under a deadline, clean up.

Every process a benchmark starts carries ``ELASTRUN_BENCH_RUN=<marker>`` in its
environment, with a marker unique to one run. Launchers and workers inherit it (both
launchers pass their environment on), so whatever a run leaves behind -- even a worker
that escaped into a session of its own, as torchrun's workers do -- is found through
``/proc/<pid>/environ`` and killed by pid. Nothing is ever matched by process name or
command line, which could reach processes that are not ours.
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
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PYTHON = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
MB = 1024 * 1024
BENCH_TAG = "ELASTRUN_BENCH_RUN"
# --max-restarts of the one-failure scenarios, every launcher alike. One failure needs one
# restart, but gloo now and then leaves a survivor of an in-place recovery blocked for
# good in a collective, and elastrun replaces it in a second round, which is charged as
# another restart (tests/e2e/test_inprocess.py; the HSDP churn soak saw 6 in 300 rounds):
# with a budget of one, such a run failed instead of being measured.
ONE_FAILURE_RESTARTS = "3"


def new_marker() -> str:
    """A string unique to one run, for its processes' environment."""
    return uuid.uuid4().hex


def tagged_env(marker: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``extra`` and the run's tag."""
    env = dict(os.environ)
    env.update(extra or {})
    env[BENCH_TAG] = marker
    return env


def raise_fd_limit(wanted: int = 1 << 17) -> None:
    """This process's descriptor limit up to ``wanted`` where it may raise the hard limit
    (a large run holds more connections than a common hard limit), else to the hard one."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return
        except (ValueError, OSError):
            pass
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --------------------------------------------------------------------------- launchers


@dataclass(frozen=True)
class Launcher:
    """One launcher under test: a display name, its executable, extra flags and variables."""

    name: str
    exe: Path
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

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
        """The command line: the same standalone flags for every launcher."""
        return [
            str(self.exe),
            "--standalone",
            f"--nproc-per-node={nproc}",
            *self.flags,
            *extra,
            str(script),
            *script_args,
        ]


def elastrun(bin_dir: Path = BIN) -> Launcher:
    return Launcher("elastrun", bin_dir / "elastrun")


def elastrun_no_template(bin_dir: Path = BIN) -> Launcher:
    return Launcher("elastrun --no-template", bin_dir / "elastrun", ("--no-template",))


def torchrun(bin_dir: Path = BIN) -> Launcher:
    return Launcher("torchrun", bin_dir / "torchrun")


def display_command(argv: Sequence[str], env: Mapping[str, str], work: Path | None) -> str:
    """A command as a reader would type it: added variables first, paths shortened."""
    import shlex

    text = shlex.join(argv)
    if work is not None:
        text = text.replace(str(work), "<tmp>")
    text = text.replace(str(BIN) + "/", ".venv/bin/").replace(str(REPO) + "/", "")
    prefix = " ".join(f"{k}={v}" for k, v in env.items())
    return f"{prefix} {text}".strip()


# --------------------------------------------------------------------------- processes


def procs_marked(marker: str) -> list[psutil.Process]:
    """Live processes started by this run: they carry ``ELASTRUN_BENCH_RUN=<marker>``."""
    needle = f"{BENCH_TAG}={marker}".encode()
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state == b"Z":
            continue  # a zombie is gone already; its parent reaps it
        if needle in env:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(int(entry)))
    return found


def kill_marked(marker: str) -> list[int]:
    """SIGKILL every live process carrying `marker`; return their pids."""
    killed = []
    for p in procs_marked(marker):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
            killed.append(p.pid)
    return killed


def own_cpu_seconds(pid: int) -> float | None:
    """User+system CPU seconds of one process, its children excluded (None if gone).

    Read while the process lives, or after it exited but before it is reaped (a
    zombie): then its counters are final and, unlike wait4's rusage, do not include the
    workers it reaped.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the ")" closing the command name: state is field 0, utime 11, stime 12.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mb(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).memory_info().rss) / MB
    except psutil.Error:
        return None


def _tail(path: Path, lines: int = 120) -> str:
    # (torchrun's own report of a failed worker takes about 35 lines: the worker's last
    # words, an abort's reason among them, come before it.)
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


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


class Running:
    """A launcher started in a session of its own; :meth:`finish` waits and cleans up.

    Between the two, a scenario may act on the running job (kill a worker, sample the
    launcher's CPU and memory). Exit is noticed through a pidfd: no polling loop.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        marker: str,
        log_dir: Path,
        env_extra: Mapping[str, str] | None = None,
        name: str = "",
    ) -> None:
        self.name = name
        self.marker = marker
        log_dir.mkdir(parents=True, exist_ok=True)
        self._out_path, self._err_path = log_dir / "launcher.stdout", log_dir / "launcher.stderr"
        env = tagged_env(marker, env_extra)
        # Files, never pipes: a chatty launcher cannot block on a full pipe.
        with open(self._out_path, "wb") as out, open(self._err_path, "wb") as err:
            self.t_invoke = time.time()
            self.t0 = time.monotonic()
            self.proc = subprocess.Popen(
                list(cmd), stdout=out, stderr=err, env=env, start_new_session=True
            )
        self._pidfd = os.pidfd_open(self.proc.pid)
        self._outcome: RunOutcome | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_exit(self, timeout_s: float) -> bool:
        """Whether the launcher exited within `timeout_s` (it is not reaped)."""
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(max(0, round(timeout_s * 1000))))

    def finish(self, timeout_s: float) -> RunOutcome:
        """Wait (up to `timeout_s` after the start) for the launcher to exit, then clean up.

        On timeout its process group gets SIGTERM, then SIGKILL. Either way every process
        still carrying the run's marker is killed afterwards and reported.
        """
        if self._outcome is not None:
            return self._outcome
        left = self.t0 + timeout_s - time.monotonic()
        exited = self.wait_exit(left)
        wall_s = time.monotonic() - self.t0
        cpu_s: float | None = None
        try:
            if exited:
                # Exited but not reaped: read its own CPU counters, then reap it.
                os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
                cpu_s = own_cpu_seconds(self.proc.pid)
                self.proc.wait()
                # Anything left in the launcher's own group is ours; stop it too.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            else:
                self._stop_group(grace_s=5.0)
        finally:
            os.close(self._pidfd)
        left_behind = kill_marked(self.marker)
        self._outcome = RunOutcome(
            returncode=self.proc.returncode,
            t_invoke=self.t_invoke,
            wall_s=wall_s,
            cpu_s=cpu_s,
            timed_out=not exited,
            stderr_tail=_tail(self._err_path),
            stdout_tail=_tail(self._out_path),
            left_behind=left_behind,
        )
        return self._outcome

    def _stop_group(self, grace_s: float) -> None:
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def __repr__(self) -> str:
        state = "finished" if self._outcome is not None else "running"
        return f"Running(pid={self.proc.pid}, {state})"


def run_launcher(
    cmd: Sequence[str],
    *,
    marker: str,
    log_dir: Path,
    timeout_s: float,
    env_extra: Mapping[str, str] | None = None,
) -> RunOutcome:
    """Start `cmd`, wait for it with a deadline, measure it, clean up."""
    try:
        running = Running(cmd, marker=marker, log_dir=log_dir, env_extra=env_extra)
    except OSError as exc:
        return RunOutcome(None, time.time(), 0.0, None, False, f"cannot start: {exc}", "")
    return running.finish(timeout_s)


class ScenarioFailure(Exception):
    """A run that did not produce its measurement (with the reason)."""


def require_clean(outcome: RunOutcome) -> None:
    failure = outcome.failure()
    if failure:
        raise ScenarioFailure(failure)


def read_float(path: Path) -> float:
    """The first whitespace-separated field of a small file, as a float."""
    return float(path.read_text().split()[0])


def wait_until(predicate: Callable[[], object], timeout_s: float, step_s: float = 0.01) -> bool:
    """Poll `predicate` until true or `timeout_s` passes (for the benchmark's own waits)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step_s)


# --------------------------------------------------------------------------- statistics


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
        if len(self.samples) == 1:
            return f"{self.median:{fmt}}"
        return f"{self.median:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"


# --------------------------------------------------------------------------- machine


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


def _git_revision() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' + uncommitted changes' if dirty else ''}"


def machine_info() -> dict[str, str]:
    """Facts about this machine and environment worth printing next to numbers."""
    mem = psutil.virtual_memory()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "host cpus": f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})",
        "cpu model": _cpu_model(),
        "memory": f"{mem.total / 1024**3:.1f} GiB",
        "kernel": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": _version("torch"),
        "elastrun": f"{_version('elastrun')} (git {_git_revision()})",
        "psutil": _version("psutil"),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
