"""Fakes for unit tests of pure logic: a hand-driven clock and scripted processes.

They implement the same protocols as the real pieces (``Clock``, ``ProcessStarter``,
``WorkerProcess``), so the agent's loop can be exercised without starting processes.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from elastrun.supervise.processes.spawn import ProcessSpec, WorkerProcess, start_each


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0, wall: float = 1.7e9) -> None:
        self._mono = start
        self._wall = wall

    def monotonic(self) -> float:
        return self._mono

    def time(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        self._mono += seconds
        self._wall += seconds

    def __repr__(self) -> str:
        return f"FakeClock(monotonic={self._mono})"


_fake_pids = iter(range(4_000_000, 5_000_000))  # above any real pid_max default


class FakeProcess:
    """A scripted worker: it 'exits' when told to, or when its group is signalled."""

    def __init__(self, spec: ProcessSpec, attempt: int, ignore_signals: bool = False) -> None:
        self.spec = spec
        self.attempt = attempt
        self.local_rank = spec.local_rank
        self.pid = next(_fake_pids)
        self.ignore_signals = ignore_signals
        self.signals: list[int] = []
        self.value: object = None
        self._r, self._w = os.pipe2(os.O_CLOEXEC)
        self._code: int | None = None

    def finish(self, code: int) -> None:
        if self._code is None:
            self._code = code
            os.write(self._w, b"x")

    def exit_fd(self) -> int:
        return self._r

    def exited(self) -> bool:
        return self._code is not None

    def signal_group(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGKILL or not self.ignore_signals:
            self.finish(-sig)

    def poll(self) -> int | None:
        return self._code

    def return_value(self) -> object:
        return self.value

    def release(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._r = self._w = -1

    def __repr__(self) -> str:
        return f"FakeProcess(rank={self.local_rank}, attempt={self.attempt}, exit={self._code})"


@dataclass
class FakeStarter:
    """Starts ``FakeProcess``es; ``script(attempt, local_rank)`` gives an immediate exit
    code (None: keep running until signalled)."""

    script: Callable[[int, int], int | None] = lambda attempt, rank: 0
    started: list[FakeProcess] = field(default_factory=list)
    attempt: int = -1

    def start(self, spec: ProcessSpec) -> FakeProcess:
        if spec.local_rank == 0:
            self.attempt += 1
        proc = FakeProcess(spec, self.attempt)
        self.started.append(proc)
        code = self.script(self.attempt, spec.local_rank)
        if code is not None:
            proc.finish(code)
        return proc

    def start_many(self, specs: Sequence[ProcessSpec]) -> list[WorkerProcess]:
        return start_each(self.start, specs)

    def envs(self, attempt: int) -> list[dict[str, str]]:
        return [dict(p.spec.env) for p in self.started if p.attempt == attempt]


class NullGuard:
    """An orphan guard that guards nothing (no helper process in unit tests)."""

    def start(self) -> None:
        pass

    def watch(self, pgid: int) -> None:
        pass

    def forget(self, pgid: int) -> None:
        pass

    def remove_if_orphaned(self, path: str) -> None:
        pass

    def close(self) -> None:
        pass
