"""Leading a node's workers into an agreed in-process round: what the round's message
names for the workers to cut, and the round it begins (the agent's side, with the
workers, the hub and the attempt stood in for)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from elastrun.inprocess.agent import recovery as recovery_module
from elastrun.inprocess.agent.agree import Agreement
from elastrun.inprocess.agent.bounds import RecoveryBounds
from elastrun.inprocess.agent.recovery import InprocessRecovery
from elastrun.observe.sinks import MemoryEventSink, NullMetricSink
from elastrun.testing import FakeClock


@dataclass
class _Setup:
    plan: Any
    envs: dict[int, dict[str, str]]


@dataclass
class _Procs:
    alive: dict[int, int]
    dead: dict[int, int] = field(default_factory=dict)

    def pids(self) -> dict[int, int]:
        return {**self.alive, **self.dead}

    def running(self) -> list[int]:
        return sorted(self.alive)


class _Attempt:
    def __init__(self, plan: Any, procs: _Procs) -> None:
        self.setup = _Setup(plan, {lr: {"RANK": str(lr)} for lr in procs.pids()})
        self.procs = procs

    def global_rank(self, local_rank: int) -> int:
        return local_rank


class _Hub:
    def __init__(self) -> None:
        self.announced: list[tuple[int, list[str]]] = []

    def announce(
        self, round_no: int, envs: Any, pids: dict[int, int], cut: list[str] | None = None
    ) -> None:
        self.announced.append((round_no, list(cut or [])))


class _Workers:
    def __init__(self) -> None:
        self.replaced: list[int] = []

    def replace_worker(self, attempt: Any, setup: Any, local_rank: int) -> int:
        self.replaced.append(local_rank)
        return 900 + local_rank

    def update_ranks(self, plan: Any) -> None:
        pass


def _plan(world: int, local_ranks: list[int]) -> Any:
    workers = tuple(
        SimpleNamespace(local_rank=lr, env={}, ranks=SimpleNamespace(world_size=world))
        for lr in local_ranks
    )
    return SimpleNamespace(workers=workers)


def _recovery(workers: _Workers, hub: _Hub) -> InprocessRecovery:
    rec = InprocessRecovery(
        workers=workers,  # type: ignore[arg-type]  # (stands in for WorkerProcesses)
        store=SimpleNamespace(serving=True),  # type: ignore[arg-type]  # (not used here)
        events=MemoryEventSink(),
        metrics=NullMetricSink(),
        clock=FakeClock(),
        wake=lambda: None,
        bounds=RecoveryBounds(timeout=30, join_timeout=10, answer_hold=1, loss_bound=1),
    )
    rec._hub = hub  # type: ignore[assignment]  # (a hub that records what it is told)
    return rec


def test_a_round_across_nodes_cuts_the_listeners_agreed_and_this_nodes_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The agreement holds the listeners each node read for its offer; a group this
    # node's workers made since listens on a port the agreement lacks.
    monkeypatch.setattr(
        recovery_module,
        "listening_endpoints",
        lambda pids: ["127.0.0.1:4000", "127.0.0.1:4999"],
    )
    hub, workers = _Hub(), _Workers()
    rec = _recovery(workers, hub)
    # (stands in for an Attempt: the setup, processes and ranks that leading reads)
    attempt: Any = _Attempt(_plan(4, [0, 1]), _Procs(alive={0: 100}, dead={1: 101}))
    agreement = Agreement(3, ("127.0.0.1:4000", "127.0.0.2:5000"))
    rec.recover_round(attempt, _plan(4, [0, 1]), agreement, 1, after_failure=True)
    assert hub.announced == [(3, ["127.0.0.1:4000", "127.0.0.1:4999", "127.0.0.2:5000"])]
    assert workers.replaced == [1]
    assert rec.round.under_way
