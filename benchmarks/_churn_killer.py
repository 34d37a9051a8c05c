"""The churn benchmark's killer: SIGKILLs random workers of one job at random moments.

    _churn_killer.py OUT LAUNCHER_PID MARKER --failures N --interval S [--mix R,B,O] ...

Its only victims are the pids the job's workers wrote to ``OUT/pid_RANK``, and only while
such a pid is a live process (not a zombie) that carries the run's marker in its
environment and descends from the launcher: a stale pid file, whose pid may since have
been given to another process, is never acted on. The signal goes through a pidfd opened
before those checks, so the process checked is the process signalled.

Each kill is one of three moments, drawn with the weights of ``--mix``:

* ``random``: after a wait drawn uniformly from 0.2x-1.8x ``--interval``; on a job that
  spends its steps computing, mostly inside a step;
* ``boundary``: after that wait, at the victim's next step end (its log is polled every
  millisecond): between steps, in the commit or the checkpoint;
* ``overlap``: 20-400 ms after the previous kill (the first kill cannot be one), while
  the job is still recovering from it: a replacement starting, a round synchronising.

With ``--after-progress`` a kill that is not an overlapping one also waits, after its
draw, until every rank completed a step begun after the previous kill: failures then
come no faster than the job recovers from them, and each recovery restores a newer
commit than the one before it, as elastrun's guard against restarts without progress
(``--stalled-restarts``) requires of a job that is to go on.

After the last kill it waits one more draw of the interval, so that N kills are spread
over N+1 intervals; every kill is appended to ``OUT/kills.jsonl`` as it is sent, and
``OUT/killer_done`` holds the moment it stopped. It stops early when the launcher exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import signal
import sys
import time
from pathlib import Path

MOMENTS = ("random", "boundary", "overlap")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    if fields[0] == b"Z":
        raise ProcessLookupError(pid)
    return int(fields[1])


def is_ours(pid: int, launcher: int, marker: bytes) -> bool:
    """Whether ``pid`` is a live process of this run below the launcher."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            if marker not in fh.read().split(b"\0"):
                return False
        up = pid
        for _ in range(64):
            up = _parent(up)
            if up == launcher:
                return True
            if up <= 1:
                return False
    except (OSError, ValueError):
        return False
    return False


class Killer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.out = Path(args.out)
        self.launcher = args.launcher
        self.marker = f"ELASTRUN_BENCH_RUN={args.marker}".encode()
        self.ranks = [r for r in range(args.workers) if r != args.spare]
        # Two generators: the moments and the waits come out the same in every mode of one
        # seed, however often a victim had to be looked for again.
        self.timing = random.Random(args.seed)
        self.choice = random.Random(args.seed + 1)
        self.args = args
        self.kills = 0
        self.last_kill = 0.0
        self.offsets = dict.fromkeys(range(args.workers), 0)
        self.stepped = dict.fromkeys(range(args.workers), False)
        self.log = open(self.out / "kills.jsonl", "a")  # noqa: SIM115  # closed by main
        self._launcher_fd = os.pidfd_open(args.launcher)

    def launcher_exited(self, within_s: float = 0.0) -> bool:
        poller = select.poll()
        poller.register(self._launcher_fd, select.POLLIN)
        return bool(poller.poll(max(0, round(within_s * 1000))))

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds``; False when the launcher exited meanwhile."""
        return not self.launcher_exited(seconds)

    def victim(self) -> tuple[int, int, int] | None:
        """A random rank's live worker: (rank, pid, pidfd), or None when none is."""
        for rank in self.choice.sample(self.ranks, len(self.ranks)):
            try:
                pid = int((self.out / f"pid_{rank}").read_text())
                fd = os.pidfd_open(pid)
            except (OSError, ValueError):
                continue
            if is_ours(pid, self.launcher, self.marker):
                return rank, pid, fd
            os.close(fd)
        return None

    def at_step_end(self, rank: int, pid: int, give_up_s: float = 2.0) -> None:
        """Return just after ``pid`` logs its next step end (or after ``give_up_s``)."""
        path = self.out / f"steps_{rank}.log"
        size = path.stat().st_size
        deadline = time.monotonic() + give_up_s
        needle = f"E {pid} ".encode()
        with open(path, "rb") as fh:
            while time.monotonic() < deadline:
                fh.seek(size)
                new = fh.read()
                size += len(new)
                if needle in new:
                    return
                time.sleep(0.001)

    def progressed(self) -> bool:
        """Whether every rank completed a step that began after the last kill."""
        for rank, done in self.stepped.items():
            if done:
                continue
            try:
                with open(self.out / f"steps_{rank}.log", "rb") as fh:
                    fh.seek(self.offsets[rank])
                    new = fh.read()
            except OSError:
                return False
            complete = new[: new.rfind(b"\n") + 1]
            self.offsets[rank] += len(complete)
            for line in complete.split(b"\n"):
                f = line.split()
                if len(f) == 5 and f[0] == b"E" and float(f[3]) > self.last_kill:
                    self.stepped[rank] = True
                    break
        return all(self.stepped.values())

    def kill_one(self, moment: str) -> bool:
        """Kill a random live worker; False if the launcher exited first."""
        while True:
            found = self.victim()
            if found is not None:
                break
            if not self.wait(0.01):
                return False
        rank, pid, fd = found
        try:
            if moment == "boundary":
                self.at_step_end(rank, pid)
            t = time.time()
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            return True  # it died meanwhile (the agent stopped it): no kill, try again
        finally:
            os.close(fd)
        self.kills += 1
        self.last_kill = t
        self.stepped = dict.fromkeys(self.stepped, False)
        record = {"n": self.kills, "t": t, "rank": rank, "pid": pid, "moment": moment}
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()
        return True

    def pause(self) -> float:
        interval: float = self.args.interval
        return interval * self.timing.uniform(0.2, 1.8)

    def run(self) -> None:
        weights = [float(w) for w in self.args.mix.split(",")]
        while self.kills < self.args.failures:
            moment = self.timing.choices(MOMENTS, weights)[0]
            if moment == "overlap" and self.kills == 0:
                moment = "random"
            pause = self.timing.uniform(0.02, 0.4) if moment == "overlap" else self.pause()
            if not self.wait(pause):
                return
            while moment != "overlap" and self.args.after_progress and not self.progressed():
                if not self.wait(0.005):
                    return
            if not self.kill_one(moment):
                return
        self.wait(self.pause())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    p.add_argument("out")
    p.add_argument("launcher", type=int)
    p.add_argument("marker")
    p.add_argument("--failures", type=int, required=True)
    p.add_argument("--interval", type=float, required=True, help="mean seconds between kills")
    p.add_argument("--mix", default="1,0,0", help="weights of random,boundary,overlap")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--spare", type=int, default=-1, help="a rank never killed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--after-progress",
        action="store_true",
        help="a kill that is not an overlapping one also waits until every rank completed "
        "a step begun after the previous kill",
    )
    args = p.parse_args(argv)
    killer = Killer(args)
    try:
        killer.run()
    finally:
        killer.log.close()
        with contextlib.suppress(OSError):
            (Path(args.out) / "killer_done").write_text(f"{time.time():.6f} {killer.kills}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
