"""Memory checkpoints' events and metrics: the report each rank keeps in the node
directory (the wire format and its writer), and the agent's reading of it (no torch on
that side), with a fake clock and sinks that keep what they are given."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from elastrun.agent.ladder import Failure, Move
from elastrun.agent.rungs import GroupRestartRung
from elastrun.checkpoint.agent.reports import CheckpointReports
from elastrun.checkpoint.worker.report import RankReporter
from elastrun.observe.sinks import MemoryEventSink
from elastrun.supervise.processes.procset import Exit
from elastrun.testing import FakeClock
from elastrun.wire import checkpoint as layout
from elastrun.wire.checkpoint import RankReport


class _Metrics:
    def __init__(self) -> None:
        self.puts: list[tuple[str, float]] = []

    def put(self, name: str, value: float) -> None:
        self.puts.append((name, value))

    def last(self) -> dict[str, float]:
        return dict(self.puts)


def _write(directory: Path, report: RankReport) -> None:
    (directory / layout.report_name(report.rank)).write_text(layout.encode_report(report))


def _reports(
    directory: Path | None,
) -> tuple[CheckpointReports, MemoryEventSink, _Metrics, FakeClock]:
    events, metrics, clock = MemoryEventSink(), _Metrics(), FakeClock()
    path = None if directory is None else str(directory)
    return CheckpointReports(lambda: path, events, metrics, clock), events, metrics, clock


# -- the wire format ---------------------------------------------------------------------


def test_a_report_round_trips_and_carries_the_version() -> None:
    report = RankReport(rank=3, local_rank=1, pid=42, saves=5, complete=4, blocked_s=0.5,
                        save_s=0.75, lag_s=1.0, newest=9, loads=1, restored=4,
                        restore_s=0.2)  # fmt: skip
    text = layout.encode_report(report)
    assert json.loads(text)["version"] == layout.VERSION
    assert layout.decode_report(text) == report
    assert layout.rank_of_report(layout.report_name(3)) == 3
    assert layout.rank_of_report(layout.report_name(3) + ".tmp") is None
    assert layout.rank_of_report(layout.data_name(3)) is None


@pytest.mark.parametrize(
    "change",
    [{"version": layout.VERSION + 1}, {"version": True}, {"saves": -1}, {"saves": 1.5},
     {"blocked_s": "1"}, {"blocked_s": float("nan")}, {"newest": -2}, {"pid": None}],
)  # fmt: skip
def test_a_report_of_another_version_or_with_a_bad_field_is_refused(
    change: dict[str, object],
) -> None:
    data = json.loads(layout.encode_report(RankReport(rank=0, local_rank=0, pid=1)))
    data.update(change)
    with pytest.raises(layout.ReportError):
        layout.decode_report(json.dumps(data))


# -- the worker's writer -----------------------------------------------------------------


def test_the_writer_keeps_totals_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    reporter = RankReporter(str(tmp_path), rank=2, local_rank=0, pid=77)
    reporter.loaded(None, 0.1)
    reporter.saved(blocked=0.01, written=0.02, agreed=0.03, newest=0)
    reporter.saved(blocked=0.002, written=None, agreed=None, newest=0)  # not kept
    reporter.saved(blocked=0.03, written=0.04, agreed=0.05, newest=2)
    assert os.listdir(tmp_path) == [layout.report_name(2)]
    got = layout.decode_report((tmp_path / layout.report_name(2)).read_bytes())
    assert got == reporter.report
    assert (got.rank, got.pid, got.saves, got.complete, got.newest) == (2, 77, 3, 2, 2)
    assert (got.loads, got.restored) == (1, None)
    assert got.blocked_s == pytest.approx(0.042)
    assert (got.save_s, got.lag_s) == pytest.approx((0.06, 0.08))


def test_a_report_that_cannot_be_written_never_fails_a_save(tmp_path: Path) -> None:
    reporter = RankReporter(str(tmp_path / "gone"), rank=0, local_rank=0, pid=1)
    reporter.saved(blocked=0.01, written=0.02, agreed=0.03, newest=0)
    assert reporter.report.saves == 1


# -- the agent's reading -----------------------------------------------------------------


def test_a_restore_is_an_event_and_metrics_labelled_with_the_rank(tmp_path: Path) -> None:
    reports, events, metrics, _ = _reports(tmp_path)
    _write(tmp_path, RankReport(rank=5, local_rank=1, pid=10, loads=1, restored=41,
                                restore_s=0.25, newest=41))  # fmt: skip
    reports.collect()
    assert events.events == [
        ("agent.checkpoint_restored",
         {"rank": 5, "local_rank": 1, "pid": 10, "step": 41, "duration_ms": 250.0}),
    ]  # fmt: skip
    assert metrics.last() == {
        "checkpoint.restored_step{rank=5,local_rank=1}": 41,
        "checkpoint.restore.duration_ms{rank=5,local_rank=1}": 250.0,
    }
    reports.collect()  # nothing new: nothing recorded again
    assert len(events.events) == 1 and len(metrics.puts) == 2


def test_a_load_that_found_nothing_records_no_restore(tmp_path: Path) -> None:
    reports, events, metrics, _ = _reports(tmp_path)
    _write(tmp_path, RankReport(rank=0, local_rank=0, pid=10, loads=1, restored=None))
    reports.collect()
    assert events.events == [] and metrics.puts == []


def test_saves_are_counted_and_their_times_are_the_means_since_the_last_look(
    tmp_path: Path,
) -> None:
    reports, events, metrics, _ = _reports(tmp_path)
    first = RankReport(rank=1, local_rank=1, pid=10, saves=2, complete=2, blocked_s=0.2,
                       save_s=0.4, lag_s=0.6, newest=1)  # fmt: skip
    _write(tmp_path, first)
    reports.collect()
    # Three more saves, one of them not kept (skipped: no write, no agreement).
    _write(tmp_path, first._replace(saves=5, complete=4, blocked_s=0.5, save_s=0.6, lag_s=1.0,
                                    newest=4))  # fmt: skip
    metrics.puts.clear()
    reports.collect()
    label = "{rank=1,local_rank=1}"
    assert metrics.last() == {
        f"checkpoint.saves{label}": 3,
        f"checkpoint.blocked.duration_ms{label}": pytest.approx(100.0),
        f"checkpoint.save.duration_ms{label}": pytest.approx(100.0),
        f"checkpoint.lag.duration_ms{label}": pytest.approx(200.0),
        f"checkpoint.step{label}": 4,
    }
    assert events.events == []  # a worker's summary waits for its last report


def test_a_restarted_workers_report_closes_its_predecessors_with_a_summary(
    tmp_path: Path,
) -> None:
    reports, events, metrics, _ = _reports(tmp_path)
    old = RankReport(rank=0, local_rank=0, pid=10, saves=4, complete=4, blocked_s=0.04,
                     save_s=0.08, lag_s=0.12, newest=3)  # fmt: skip
    _write(tmp_path, old)
    reports.collect()
    new = RankReport(rank=0, local_rank=0, pid=11, loads=1, restored=3, restore_s=0.1, newest=3)
    _write(tmp_path, new)
    reports.collect()
    assert [name for name, _ in events.events] == ["agent.checkpoint_saves",
                                                   "agent.checkpoint_restored"]  # fmt: skip
    assert events.events[0][1] == {
        "rank": 0, "local_rank": 0, "pid": 10, "saves": 4, "complete": 4,
        "blocked_ms": 10.0, "save_ms": 20.0, "lag_ms": 30.0, "newest": 3,
    }  # fmt: skip
    # The new worker's counts start from its own zero, not from its predecessor's.
    _write(tmp_path, new._replace(saves=1, complete=1, blocked_s=0.005, save_s=0.01,
                                  lag_s=0.02, newest=4))  # fmt: skip
    metrics.puts.clear()
    reports.collect()
    assert metrics.last()["checkpoint.saves{rank=0,local_rank=0}"] == 1
    assert metrics.last()["checkpoint.blocked.duration_ms{rank=0,local_rank=0}"] == (
        pytest.approx(5.0)
    )
    reports.finish()
    reports.finish()  # once per worker
    assert [name for name, _ in events.events].count("agent.checkpoint_saves") == 2


def test_a_worker_that_never_saved_has_no_summary(tmp_path: Path) -> None:
    reports, events, _, _ = _reports(tmp_path)
    _write(tmp_path, RankReport(rank=0, local_rank=0, pid=10, loads=1))
    reports.finish()
    assert events.events == []


def test_the_newest_step_counts_only_the_workers_asked_about(tmp_path: Path) -> None:
    reports, _, _, _ = _reports(tmp_path)
    # Rank 3 of an earlier, larger world, which had got further than the job now has.
    _write(tmp_path, RankReport(rank=3, local_rank=1, pid=9, saves=50, newest=49))
    _write(tmp_path, RankReport(rank=0, local_rank=0, pid=20, saves=3, newest=2))
    _write(tmp_path, RankReport(rank=1, local_rank=1, pid=21, saves=4, newest=3))
    reports.collect()
    assert reports.newest({20, 21}) == 3
    assert reports.newest({20}) == 2
    assert reports.newest({99}) is None


def test_unreadable_reports_and_a_missing_directory_are_skipped(tmp_path: Path) -> None:
    reports, events, metrics, _ = _reports(tmp_path)
    (tmp_path / layout.report_name(0)).write_text('{"version": 99}')
    (tmp_path / layout.report_name(1)).write_text("not json")
    (tmp_path / "step-000000000001").mkdir()
    reports.collect()
    reports.finish()
    assert events.events == [] and metrics.puts == []
    for directory in (None, tmp_path / "removed"):
        nothing, events, metrics, _ = _reports(directory)
        nothing.finish()
        assert events.events == [] and metrics.puts == []


def test_it_is_due_about_once_a_second(tmp_path: Path) -> None:
    reports, _, _, clock = _reports(tmp_path)
    assert not reports.due()
    clock.advance(1.0)
    assert reports.due()
    reports.collect()
    assert not reports.due()
    clock.advance(0.5)
    assert not reports.due()


# -- the group restart says where the state comes from -----------------------------------


class _NodeCheck:
    def own_failure(self) -> None:
        pass


def _failure_of(*pids: int) -> Failure:
    processes = {lr: SimpleNamespace(pid=pid) for lr, pid in enumerate(pids)}
    attempt = SimpleNamespace(procs=SimpleNamespace(processes=processes))
    exits = [Exit(local_rank=0, pid=pids[0], exitcode=-9, observed_at=0.0)]
    return Failure(attempt, exits, "rank 0", False, "off")  # type: ignore[arg-type]  # what it reads


def test_a_group_restart_names_the_step_in_memory_its_workers_reported(tmp_path: Path) -> None:
    reports, _, _, _ = _reports(tmp_path)
    _write(tmp_path, RankReport(rank=3, local_rank=1, pid=9, saves=50, newest=49))  # stale
    _write(tmp_path, RankReport(rank=0, local_rank=0, pid=20, saves=8, newest=7))
    _write(tmp_path, RankReport(rank=1, local_rank=1, pid=21, saves=9, newest=8))
    reports.collect()
    rung = GroupRestartRung(_NodeCheck(), reports)  # type: ignore[arg-type]  # what it calls
    reaction = rung.decide(_failure_of(20, 21))
    assert reaction.move is Move.RESTART and reaction.from_memory == 8
    # Workers that never saved: a plain restart, as before.
    assert rung.decide(_failure_of(30, 31)).from_memory is None
    assert GroupRestartRung(_NodeCheck()).decide(_failure_of(20)).from_memory is None  # type: ignore[arg-type]  # what it calls
