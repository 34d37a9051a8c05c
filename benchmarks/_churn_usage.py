"""Descriptors, threads and RSS of a churn job's processes, sampled from /proc.

``sample`` reads the launcher (elastrun's agent, or torchrun), its other children that
are not workers (elastrun's template and guard) and the live workers (the pids the job
wrote, checked to be this run's). ``summarise`` turns the samples into, for the
launcher, each helper and the workers (the largest value of the four ranks), three
points: the first sample (when the killer started, before any kill), and the level
over the first third of the killer's window and over its last third: the 80th
percentile of the samples, what a process holds most of the time when it holds the
most. Growth is the last third against the first, the smallest of the level's, the
floor's (the smallest value) and the last level's over the first third's peak (see
``summarise``): a survivor holds the previous
recovery's process groups for a while (see docs/inprocess.md), so the first recoveries
raise a worker's counts once, and the allocator settles over them. A leak raises the
level with the kills; a transient (a chain of overlapping rounds holds a few groups'
connections for a second or two) does not, where the largest value would count it at
whichever end it fell. A worker's counts alternate between two levels (holding a
recovery's groups, and not), in proportions that vary with the kills' timing: the
median would jump between them, the 80th percentile stays on the upper one.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from _churn_killer import is_ours

KEYS = ("fds", "threads", "rss_mb")


@dataclass(frozen=True)
class Sample:
    t: float
    role: str  # agent, worker, or a helper's module (template, guard)
    pid: int
    rank: int  # -1 for the launcher and helpers
    fds: int
    threads: int
    rss_mb: float

    def value(self, key: str) -> float:
        return float(getattr(self, key))


def _usage(pid: int) -> tuple[int, int, float] | None:
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status") as fh:
            threads = next(int(ln.split()[1]) for ln in fh if ln.startswith("Threads:"))
        with open(f"/proc/{pid}/statm") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, StopIteration, ValueError):
        return None
    return fds, threads, round(rss, 2)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


def _helper_name(pid: int) -> str | None:
    """An elastrun helper's module without its package (``template.worker.serve``,
    ``supervise.processes.guard``); None for anything else (a worker that has not
    written its pid yet: torchrun's, or elastrun's, forked from the template)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    if module.startswith("elastrun.") and not module.startswith("elastrun.worker"):
        return module.removeprefix("elastrun.")
    return None


def sample(launcher: int, marker: str, out: Path, workers: int, t: float) -> list[Sample]:
    tag = f"ELASTRUN_BENCH_RUN={marker}".encode()
    ranks: dict[int, int] = {}
    for rank in range(workers):
        try:
            pid = int((out / f"pid_{rank}").read_text())
        except (OSError, ValueError):
            continue
        if is_ours(pid, launcher, tag):
            ranks[pid] = rank
    roles: list[tuple[int, str, int]] = [(launcher, "agent", -1)]
    roles += [(p, "worker", r) for p, r in ranks.items()]
    helpers = {p: _helper_name(p) for p in _children(launcher) if p not in ranks}
    roles += [(p, name, -1) for p, name in helpers.items() if name is not None]
    rows = []
    for pid, role, rank in roles:
        usage = _usage(pid)
        if usage is not None:
            rows.append(Sample(t, role, pid, rank, *usage))
    return rows


def _largest(rows: Sequence[Sample]) -> dict[str, float]:
    return {k: max(r.value(k) for r in rows) for k in KEYS} if rows else {}


def summarise(samples: Sequence[Sample], w0: float, w1: float) -> dict[str, dict[str, object]]:
    """Per process kind: ``start`` (the first sample), ``early`` and ``end`` (the level
    over the first and the last third of the window of the largest value at each
    sample), and the growth."""
    if not samples:
        return {}
    third = max((w1 - w0) / 3, 1e-3)
    first_t = min(s.t for s in samples)
    out: dict[str, dict[str, object]] = {}
    for role in dict.fromkeys(s.role for s in samples):
        rows = [s for s in samples if s.role == role]
        born = rows[0].t
        start = _largest([s for s in rows if s.t == born])
        first = [s for s in rows if s.t <= first_t + third]
        last = [s for s in rows if s.t >= w1 - third]
        early = _level(first) or start
        end = _level(last) or _largest(rows[-1:])
        # Growth: the smallest of the level's, the floor's, and the last level's over
        # the first third's peak. A leak raises all three; a process whose counts
        # alternate between states (a recovery's groups held or not, a request in flight
        # or not) moves its level and its floor with the states' proportions in each
        # third (a quiet stretch early, a run of young workers), but its last level
        # stays within the peak it already reached.
        low, high, peak = _floor(first), _floor(last), _largest(first)
        growth = {
            k: round(
                min(
                    end[k] - early[k],
                    high.get(k, end[k]) - low.get(k, early[k]),
                    end[k] - peak.get(k, early[k]),
                ),
                2,
            )
            for k in KEYS
            if k in early and k in end
        }
        out[role] = {"start": start, "early": early, "end": end, "growth": growth}
    return out


def _floor(rows: Sequence[Sample]) -> dict[str, float]:
    """The smallest, over the sample times, of the largest value at each."""
    at: dict[float, list[Sample]] = {}
    for r in rows:
        at.setdefault(r.t, []).append(r)
    per_time = [_largest(group) for group in at.values()]
    return {k: min(v[k] for v in per_time) for k in KEYS} if per_time else {}


def _level(rows: Sequence[Sample]) -> dict[str, float]:
    """The 80th percentile over the sample times of the largest value at each."""
    at: dict[float, list[Sample]] = {}
    for r in rows:
        at.setdefault(r.t, []).append(r)
    per_time = [_largest(group) for group in at.values()]
    if len(per_time) < 2:
        return per_time[0] if per_time else {}
    return {
        k: round(statistics.quantiles([v[k] for v in per_time], n=5, method="inclusive")[-1], 2)
        for k in KEYS
    }


def oldest_worker(
    samples: Sequence[Sample], kill_times: Sequence[tuple[float, int]]
) -> dict[str, object]:
    """The worker alive at the last sample that was sampled first: its first and last
    samples, and how many kills of other ranks it lived through."""
    last_t = max((s.t for s in samples), default=0.0)
    alive = {s.pid for s in samples if s.t == last_t and s.role == "worker"}
    if not alive:
        return {}
    born = {p: min(s.t for s in samples if s.pid == p) for p in alive}
    pid = min(born, key=born.__getitem__)
    mine = [s for s in samples if s.pid == pid]
    lived = sum(1 for t, rank in kill_times if t >= born[pid] and rank != mine[0].rank)
    return {
        "rank": mine[0].rank,
        "seconds": round(last_t - born[pid], 1),
        "kills_lived_through": lived,
        "start": _largest(mine[:1]),
        "end": _largest(mine[-1:]),
    }


def series(samples: Sequence[Sample], w0: float, points: int = 60) -> list[list[float]]:
    """A thinned series: seconds since ``w0``, the launcher's fds, threads and RSS, and
    the largest worker's, at most ``points`` rows."""
    times = sorted({s.t for s in samples})
    keep = times[:: max(1, len(times) // points)] + times[-1:]
    rows = []
    for t in dict.fromkeys(keep):
        agent = _largest([s for s in samples if s.t == t and s.role == "agent"])
        worker = _largest([s for s in samples if s.t == t and s.role == "worker"])
        if agent and worker:
            rows.append([round(t - w0, 1), *(agent[k] for k in KEYS), *(worker[k] for k in KEYS)])
    return rows
