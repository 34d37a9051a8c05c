"""One attempt: one start of the worker group, its processes and its output wiring
(``AttemptSetup``, computed once before the first worker starts, serves a replacement's
start as well)."""

from __future__ import annotations

from dataclasses import dataclass

from elastrun.agent.plan import LaunchPlan
from elastrun.supervise.processes.logs import LogsDest
from elastrun.supervise.processes.procset import ProcessSet
from elastrun.supervise.processes.relay import OutputRelay
from elastrun.supervise.processes.spawn import ProcessStarter
from elastrun.wire.env import STACKS_FILE_ENV


@dataclass(frozen=True)
class AttemptSetup:
    """How the workers of one attempt are started (the same for each local rank).

    Attributes:
        number: the attempt's number (0 for the first start of this agent).
        plan: the round's launch plan.
        envs: each local rank's complete environment.
        cpus: each local rank's CPUs (NUMA binding), None for no binding.
        dest: where each local rank's output goes.
        relay: relays the attempt's tee'd output; closed when the attempt ends.
        starter: starts the processes.
    """

    number: int
    plan: LaunchPlan
    envs: dict[int, dict[str, str]]
    cpus: dict[int, frozenset[int] | None]
    dest: LogsDest
    relay: OutputRelay
    starter: ProcessStarter


@dataclass
class Attempt:
    """One start of the worker group: its setup, processes and what the watches noted."""

    setup: AttemptSetup
    procs: ProcessSet
    #: Monotonic time since which every exited worker succeeded and some still run.
    lonely_since: float | None = None
    lonely_reported: bool = False
    hang_handled: bool = False

    @property
    def number(self) -> int:
        return self.setup.number

    @property
    def plan(self) -> LaunchPlan:
        return self.setup.plan

    def global_rank(self, local_rank: int) -> int:
        return self.setup.plan.workers[local_rank].ranks.global_rank

    def stack_requests(self, local_ranks: list[int]) -> dict[int, tuple[int, str]]:
        """``{local_rank: (pid, stacks file)}`` of these workers that can dump their
        stacks, for ``request_stacks``."""
        pids, envs = self.procs.pids(), self.setup.envs
        return {
            lr: (pids[lr], envs[lr][STACKS_FILE_ENV])
            for lr in local_ranks
            if STACKS_FILE_ENV in envs.get(lr, {})
        }

    def __repr__(self) -> str:
        return (
            f"Attempt(number={self.number}, running={self.procs.running()}, "
            f"exits={len(self.procs.exits)}, hang_handled={self.hang_handled})"
        )
