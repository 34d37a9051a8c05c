"""What the churn benchmark reads back from one job: its workers' step logs and its kills.

Pure functions over the files ``_churn_job.py`` and ``_churn_killer.py`` write (see
their docstrings), so that every number in the report can be recomputed from a run's
directory:

* each kill's **recovery**: from the kill until every rank completed a step in a call of
  the training function (or a process) that started after the kill (and, on the way,
  until every rank had begun that call); a kill that comes before an earlier kill's
  recovery ended is one *during a recovery*, else the victim's own log says what it was
  doing (``PHASES``);
* **effective training time** over the killer's window: per rank, the steps that count
  are each step's last completion (a step done again after a rollback counts once, the
  last time); ``ettr`` is their number times their median duration over the window (time
  the job would have needed without failures, at its own pace), ``ettr_in_steps`` the
  time spent inside them (a rank waiting in a step's all-reduce for a peer that saves a
  checkpoint is inside a step: this one credits part of a checkpoint's cost);
* the **rebuild steps**, for the reference run: each step whose last completion (the one
  the final parameters descend from) was the first step of its call or process (a new
  DDP wrapper, whose first step buckets the gradients in another order). A call that
  began at a step later rolled back over (a group restart from the checkpoint, or a
  commit whose only holder died) is not one: the steps done again ran in a wrapper that
  had stepped before; and the largest **rollback** (a call or process that resumed
  behind the newest completed step).
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RankLog:
    """One rank's events, every process of that rank together (``index`` sorts them)."""

    calls: list[tuple[int, int, float]] = field(default_factory=list)  # pid, step, t
    ends: list[tuple[int, int, float, float]] = field(default_factory=list)  # pid, step, t0, t1
    # Each step end's time and the start of the call (or process) it belongs to, by time.
    stepped: list[tuple[float, float]] = field(default_factory=list)
    # Each step end's time, its step, and whether it was its call's (or process's) first.
    firsts: list[tuple[float, int, bool]] = field(default_factory=list)
    stepped_t: list[float] = field(default_factory=list)
    # Per pid, its events' times and kinds (C, S, A, E), in order.
    times: dict[int, list[float]] = field(default_factory=dict)
    kinds: dict[int, list[str]] = field(default_factory=dict)

    def index(self) -> None:
        self.stepped.sort()
        self.stepped_t = [t for t, _ in self.stepped]


@dataclass(frozen=True)
class Kill:
    n: int
    t: float
    rank: int
    pid: int
    moment: str  # what the killer aimed at: random, boundary, overlap


def read_ranks(out: Path, workers: int) -> list[RankLog]:
    logs = []
    for rank in range(workers):
        log = RankLog()
        path = out / f"steps_{rank}.log"
        text = path.read_text() if path.exists() else ""
        began: dict[int, int] = {}  # each pid's current call's first step
        call: dict[int, float] = {}  # each pid's current call began at (a process's lines
        for line in text.splitlines():  # are in its own order)
            f = line.split()
            if len(f) < 4 or f[0] not in ("C", "S", "A", "E") or (f[0] == "E" and len(f) != 5):
                continue  # a line cut by the kill
            pid, step, t = int(f[1]), int(f[2]), float(f[-1])
            if f[0] == "C":
                log.calls.append((pid, step, t))
                call[pid], began[pid] = t, step
            elif f[0] == "E":
                log.ends.append((pid, step, float(f[3]), t))
                log.stepped.append((t, call.get(pid, 0.0)))
                log.firsts.append((t, step, began.get(pid) == step))
            log.times.setdefault(pid, []).append(t)
            log.kinds.setdefault(pid, []).append(f[0])
        log.index()
        logs.append(log)
    return logs


def read_kills(out: Path) -> list[Kill]:
    path = out / "kills.jsonl"
    if not path.exists():
        return []
    kills = []
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            kills.append(Kill(d["n"], d["t"], d["rank"], d["pid"], d["moment"]))
    return kills


def max_step(logs: Sequence[RankLog]) -> int:
    return max((e[1] for log in logs for e in log.ends), default=-1)


def rebuild_steps(logs: Sequence[RankLog]) -> list[int]:
    """The steps whose last completion, on any rank, was its call's first step."""
    last: dict[int, tuple[float, bool]] = {}
    for log in logs:
        for t, step, first in log.firsts:
            if step not in last or t > last[step][0]:
                last[step] = (t, first)
    return sorted(step for step, (_, first) in last.items() if first)


def largest_rollback(logs: Sequence[RankLog]) -> int:
    """The most steps a call (or process) resumed behind the newest step any rank had
    completed before it began: up to a checkpoint's interval for a group restart; in
    place, 0 (or 1: a step whose only holder died right after it, before its commit)."""
    done = sorted((t1, step) for log in logs for _, step, _, t1 in log.ends)
    times, newest, top = [t for t, _ in done], [], -1
    for _, step in done:
        top = max(top, step)
        newest.append(top)
    worst = 0
    for log in logs:
        for _, step, t in log.calls:
            i = bisect.bisect_left(times, t)
            if i:
                worst = max(worst, newest[i - 1] + 1 - step)
    return worst


def recovered_at(logs: Sequence[RankLog], t_kill: float) -> tuple[float, float] | None:
    """When every rank had begun a call (or process) after ``t_kill`` in which it then
    completed a step, and when every rank had completed that step; None if one never did.
    """
    called, done = [], []
    for log in logs:
        i = bisect.bisect_right(log.stepped_t, t_kill)
        while i < len(log.stepped) and log.stepped[i][1] <= t_kill:
            i += 1  # a step of a call begun before the kill
        if i == len(log.stepped):
            return None
        done.append(log.stepped[i][0])
        called.append(log.stepped[i][1])
    return max(called), max(done)


PHASES = {
    "C": "starting (no step begun)",
    "S": "in a step's compute (its sleep)",
    "A": "in a step's forward, backward (all-reduce) or optimizer step",
    "E": "between steps (the commit or the checkpoint)",
}
RECOVERING = "during a recovery"


def _victim_phase(log: RankLog, pid: int, t: float) -> str:
    i = bisect.bisect_right(log.times.get(pid, []), t)
    return PHASES[log.kinds[pid][i - 1] if i else "C"]


@dataclass
class KillOutcome:
    kill: Kill
    phase: str  # what the logs say the job was doing
    called_s: float | None  # kill -> every rank began a call or process after it
    recovered_s: float | None  # kill -> every rank stepped again (None: never)


def kill_outcomes(logs: Sequence[RankLog], kills: Sequence[Kill]) -> list[KillOutcome]:
    outcomes: list[KillOutcome] = []
    recovering_until = 0.0
    for k in kills:
        at = recovered_at(logs, k.t)
        during = k.t < recovering_until
        phase = RECOVERING if during else _victim_phase(logs[k.rank], k.pid, k.t)
        if at is None:
            outcomes.append(KillOutcome(k, phase, None, None))
            continue
        outcomes.append(KillOutcome(k, phase, at[0] - k.t, at[1] - k.t))
        recovering_until = max(recovering_until, at[1])
    return outcomes


@dataclass(frozen=True)
class Effective:
    window_s: float
    ettr: float
    ettr_in_steps: float
    counted_steps: float  # per rank, the mean over ranks
    redone_steps: float  # per rank: completions that did not count
    step_s: float  # the median duration of a counted step


def effective_time(logs: Sequence[RankLog], w0: float, w1: float) -> Effective:
    window = w1 - w0
    by_rank = []
    for log in logs:
        last: dict[int, tuple[float, float]] = {}
        for _, step, t0, t1 in sorted(log.ends, key=lambda e: e[3]):
            last[step] = (t0, t1)
        counted = [(t0, t1) for t0, t1 in last.values() if w0 <= t1 <= w1]
        inside = sum(max(0.0, min(t1, w1) - max(t0, w0)) for t0, t1 in last.values())
        done = sum(1 for _, _, _, t1 in log.ends if w0 <= t1 <= w1)
        median = statistics.median(t1 - t0 for t0, t1 in counted) if counted else 0.0
        by_rank.append((len(counted), median, inside, done - len(counted)))
    n = len(by_rank)
    return Effective(
        window_s=window,
        ettr=sum(c * m for c, m, _, _ in by_rank) / n / window,
        ettr_in_steps=sum(i for _, _, i, _ in by_rank) / n / window,
        counted_steps=sum(c for c, _, _, _ in by_rank) / n,
        redone_steps=sum(r for _, _, _, r in by_rank) / n,
        step_s=statistics.median(m for _, m, _, _ in by_rank),
    )
