"""The agent's pace watch: step metrics per rank, stragglers reported once and cleared,
node summaries exchanged through the store (group rank 0 compares the nodes)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from elastrun.core.errors import ConfigError, ElastrunError
from elastrun.observe.sinks import MemoryEventSink
from elastrun.pace import (
    NodeSummary,
    ProgressRecord,
    StragglerSettings,
    pace_times,
    parse_straggler_factor,
)
from elastrun.pace.agent.board import ProgressBoard
from elastrun.pace.agent.exchange import NodeExchange
from elastrun.pace.agent.stall_watch import ProgressWatch
from elastrun.pace.agent.step_watch import PaceWatch
from elastrun.store.memory import MemoryStore
from elastrun.testing import FakeClock


class Metrics:
    def __init__(self) -> None:
        self.values: list[tuple[str, float]] = []

    def put(self, name: str, value: float) -> None:
        self.values.append((name, value))

    def total(self, name: str) -> float:
        return sum(v for n, v in self.values if n == name)

    def last(self, name: str) -> float | None:
        found = [v for n, v in self.values if n == name]
        return found[-1] if found else None


def record(step: int, at: float, step_time: float, pid: int = 100) -> ProgressRecord:
    return ProgressRecord(step, at, step_time, step_time, step, pid)


def run_workers(
    watch: PaceWatch, clock: FakeClock, step_times: dict[int, float], seconds: float
) -> None:
    """Workers that report at their pace, sampled whenever the watch is due."""
    start = clock.monotonic()
    while clock.monotonic() - start < seconds:
        clock.advance(0.05)
        if watch.due():
            now = clock.monotonic()
            snap = {
                lr: record(int((now - start) / t) + 1, now - (now - start) % t, t, 100 + lr)
                for lr, t in step_times.items()
            }
            watch.sample(snap, step_times)


def test_a_rank_slower_than_twice_its_peers_for_three_windows_is_reported_once() -> None:
    clock, events, metrics = FakeClock(), MemoryEventSink(), Metrics()
    watch = PaceWatch(StragglerSettings(window=1.0), events, metrics, clock)
    watch.start_attempt(0, {0: 4, 1: 5, 2: 6})
    run_workers(watch, clock, {0: 0.1, 1: 0.3, 2: 0.1}, 6.0)
    found = [meta for name, meta in events.events if name == "agent.straggler"]
    assert len(found) == 1
    assert found[0]["rank"] == 5 and found[0]["local_rank"] == 1 and found[0]["scope"] == "rank"
    assert found[0]["windows"] == 3 and 2.5 < float(found[0]["ratio"] or 0) < 3.5
    assert metrics.last("worker.straggler{rank=5,local_rank=1}") == 1
    assert metrics.total("agent.stragglers") == 1
    # It keeps up again: cleared once, the gauge back to 0.
    run_workers(watch, clock, {0: 0.1, 1: 0.1, 2: 0.1}, 3.0)
    assert events.names().count("agent.straggler_cleared") == 1
    assert metrics.last("worker.straggler{rank=5,local_rank=1}") == 0


def test_workers_of_equal_speed_are_never_reported() -> None:
    clock, events = FakeClock(), MemoryEventSink()
    watch = PaceWatch(StragglerSettings(window=1.0), events, Metrics(), clock)
    watch.start_attempt(0, {0: 0, 1: 1, 2: 2, 3: 3})
    run_workers(watch, clock, {0: 0.1, 1: 0.12, 2: 0.1, 3: 0.15}, 20.0)
    assert "agent.straggler" not in events.names()


def test_step_metrics_count_each_workers_reports_and_time_its_steps() -> None:
    clock, metrics = FakeClock(), Metrics()
    watch = PaceWatch(None, MemoryEventSink(), metrics, clock)
    watch.start_attempt(0, {0: 2})
    clock.advance(1.0)
    watch.sample({0: ProgressRecord(5, clock.monotonic(), 0.2, 0.2, 5, 7)}, [0])
    clock.advance(1.0)
    watch.sample({0: ProgressRecord(10, clock.monotonic(), 0.2, 0.2, 10, 7)}, [0])
    assert metrics.total("worker.steps{rank=2,local_rank=0}") == 10
    assert metrics.last("worker.step{rank=2,local_rank=0}") == 10
    assert metrics.last("worker.step.duration_ms{rank=2,local_rank=0}") == pytest.approx(200)
    # A replaced worker (another pid) counts from its own first report.
    clock.advance(1.0)
    watch.sample({0: ProgressRecord(3, clock.monotonic(), 0.2, 0.2, 3, 8)}, [0])
    assert metrics.total("worker.steps{rank=2,local_rank=0}") == 13


def test_the_pace_of_a_worker_is_its_step_time_or_its_silence_if_longer() -> None:
    first_step_only = ProgressRecord(1, 9.0, None, None, 1, 1)
    snap = {0: record(3, 10.0, 0.5), 1: record(3, 11.5, 0.5), 2: first_step_only}
    assert pace_times(snap, 12.0) == {0: 2.0, 1: 0.5}


def test_straggler_settings_refuse_bad_values() -> None:
    assert parse_straggler_factor("off") is None and parse_straggler_factor("0") is None
    assert parse_straggler_factor("2.5") == 2.5
    with pytest.raises(ConfigError, match="--straggler-factor"):
        parse_straggler_factor("0.5")
    with pytest.raises(ConfigError, match="--straggler-window"):
        StragglerSettings(window=0)


def test_node_summaries_round_trip_and_refuse_other_versions() -> None:
    summary = NodeSummary("1", 4, 0.3, 0.1, 7, seq=3)
    assert NodeSummary.from_json(summary.to_json()) == summary
    assert NodeSummary.from_json(b'{"version": 2}') is None
    assert NodeSummary.from_json(b"garbage") is None


def test_nodes_exchange_summaries_and_group_rank_0_reads_only_fresh_ones() -> None:
    store = MemoryStore()
    prefix = "/elastrun/job/rounds/0/pace/"
    nodes = [NodeExchange(store, prefix, str(n), reader=n == 0, every=0.02) for n in range(3)]
    try:
        for node in nodes:
            node.start()
        deadline = time.monotonic() + 10
        seen: set[str] = set()
        while time.monotonic() < deadline and seen != {"0", "1"}:
            for n, node in enumerate(nodes[:2]):  # node 2 published nothing
                node.offer(NodeSummary("", 1, 0.1 * (n + 1), 0.1, n))
            time.sleep(0.02)
            seen |= {s.node for s in nodes[0].take() or []}
        assert seen == {"0", "1"}
        assert nodes[1].take() is None  # only group rank 0 reads
        # Node 1 stops publishing: after a few reads its summary is left out.
        deadline = time.monotonic() + 10
        latest: list[str] = ["1"]
        while time.monotonic() < deadline and "1" in latest:
            nodes[0].offer(NodeSummary("", 1, 0.1, 0.1, 0))
            time.sleep(0.02)
            read = nodes[0].take()
            if read is not None:
                latest = [s.node for s in read]
        assert latest == ["0"]
    finally:
        for node in nodes:
            node.close()


def test_a_progress_board_that_cannot_be_made_means_no_reports_not_a_failed_agent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The board's file is made in a new temporary directory; creating it can fail after
    # the directory was made (no space for the file): the agent runs on without progress
    # reports, and the directory goes.
    def full(cls: type[ProgressBoard], directory: str, size: int) -> ProgressBoard:
        raise ElastrunError(f"cannot create the progress file {directory}/progress: no space")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(ProgressBoard, "create", classmethod(full))
    watch = ProgressWatch(2)
    try:
        assert watch.worker_values([0, 1]) == {}
        assert watch.snapshot() == {}
        assert list(tmp_path.iterdir()) == []
    finally:
        watch.close()
