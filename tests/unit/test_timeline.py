"""Unit tests of the event-log timeline: text, summary, the HTML/SVG chart and the command."""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from elastrun.launch.commands.timeline import timeline_main
from elastrun.observe.eventlog import JsonLinesEventSink
from elastrun.observe.sinks import EventValue
from elastrun.observe.timeline import (
    build_timeline,
    load_timeline,
    parse_events,
    render_html,
    render_text,
)
from elastrun.testing import FakeClock

SVG = "{http://www.w3.org/2000/svg}"


class Job:
    """Writes an agent's events through the real sink, with time under the test's control."""

    def __init__(self, path: Path, context: dict[str, EventValue] | None = None) -> None:
        self.clock = FakeClock(wall=1_700_000_000.0)
        self.sink = JsonLinesEventSink(path, clock=self.clock, context=context)

    def at(self, seconds: float, name: str, **metadata: EventValue) -> None:
        self.clock.advance(seconds)
        self.sink.record(name, dict(metadata))


def write_restarting_job(path: Path) -> None:
    """Two failures (exit code 3, then SIGKILL), two restarts, then success."""
    job = Job(path)
    job.at(0.0, "agent.rendezvous", round=1, group_rank=0, group_world_size=1, duration_ms=20)
    job.at(0.1, "agent.workers_started", attempt=0, restart_count=0, duration_ms=50, pids="1,2")
    job.at(0.0, "agent.state", **{"from": "INIT", "to": "HEALTHY"})
    job.at(2.0, "agent.restart", attempt=0, rank=1, exitcode=3, restart_count=1)
    job.at(0.05, "agent.state", **{"from": "HEALTHY", "to": "STOPPED"})
    job.at(0.05, "agent.rendezvous", round=2, group_rank=0, group_world_size=1, duration_ms=30)
    job.at(0.05, "agent.workers_started", attempt=1, restart_count=1, duration_ms=40)
    job.at(1.0, "trainer.checkpoint", step=100)
    job.at(1.0, "agent.restart", attempt=1, rank=0, exitcode=-9, restart_count=2)
    job.at(0.2, "agent.rendezvous", round=3, group_rank=0, group_world_size=1, duration_ms=10)
    job.at(0.1, "agent.workers_started", attempt=2, restart_count=2, duration_ms=40)
    job.at(3.0, "agent.state", **{"from": "HEALTHY", "to": "SUCCEEDED"})
    job.at(0.0, "agent.succeeded", restarts=2)


def summary_of(text: str) -> list[str]:
    return text.split("summary:\n", 1)[1].splitlines()


def test_every_event_is_listed_in_time_order_with_time_since_the_first(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    write_restarting_job(path)
    text = render_text(load_timeline(str(path)))
    lines = text.splitlines()
    assert lines[0].startswith(f"{path}: 13 event(s) from 2023-11-14 22:13:20.000 UTC")
    assert "over 7.550 s" in lines[0]
    event_lines = lines[2:15]
    assert event_lines[0].split()[:2] == ["+0.000s", "agent.rendezvous"]
    assert "round=1" in event_lines[0] and "duration_ms=20" in event_lines[0]
    assert event_lines[3].split()[:2] == ["+2.100s", "agent.restart"]
    assert event_lines[-1].split()[:2] == ["+7.550s", "agent.succeeded"]


def test_summary_gives_attempts_failures_and_restart_durations_in_order(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    write_restarting_job(path)
    summary = summary_of(render_text(load_timeline(str(path))))
    assert summary == [
        "  rendezvous: 3 round(s), 0.060 s in total "
        "(longest 0.030 s: round 2, group rank 0, 1 node(s))",
        "  attempt 0: +0.050s .. +2.100s (2.050 s), restarted: rank 1 exit code 3",
        "    restart 1 took 0.150 s (workers running again at +2.250s)",
        "  attempt 1: +2.210s .. +4.250s (2.040 s), restarted: rank 0 killed by SIGKILL",
        "    restart 2 took 0.300 s (workers running again at +4.550s)",
        "  attempt 2: +4.510s .. +7.550s (3.040 s), succeeded",
        "  outcome: succeeded after 2 restarts",
    ]


def test_a_job_that_runs_out_of_restarts_names_the_failed_ranks(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    job = Job(path)
    job.at(0.0, "agent.rendezvous", round=1, duration_ms=5)
    job.at(0.1, "agent.workers_started", attempt=0, duration_ms=5)
    job.at(1.0, "agent.worker_failed", attempt=0, rank=2, exitcode=1)
    job.at(0.0, "agent.worker_failed", attempt=0, rank=3, exitcode=-15)
    job.at(0.1, "agent.state", **{"from": "HEALTHY", "to": "FAILED"})
    job.at(0.0, "agent.failed", failures=2, restarts=0)
    summary = summary_of(render_text(load_timeline(str(path))))
    assert summary[1] == (
        "  attempt 0: +0.095s .. +1.200s (1.105 s), failed: "
        "rank 2 exit code 1, rank 3 killed by SIGTERM"
    )
    assert summary[-1] == "  outcome: failed: 2 worker(s) failed"


def test_membership_change_and_signal_end_attempts_with_their_reason(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    job = Job(path)
    job.at(0.0, "agent.workers_started", attempt=0)
    job.at(1.0, "agent.state", **{"from": "HEALTHY", "to": "STOPPED"})
    job.at(0.5, "agent.rendezvous", round=2, duration_ms=400)
    job.at(0.1, "agent.workers_started", attempt=0)
    job.at(1.0, "agent.signal", signal="SIGTERM")
    summary = summary_of(render_text(load_timeline(str(path))))
    assert "re-formed (the group was re-formed)" in summary[1]
    assert summary[2].endswith("stopped (stopped by SIGTERM)")
    assert summary[-1] == "  outcome: stopped by SIGTERM"


def test_an_attempt_with_no_end_event_is_shown_as_still_running(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    job = Job(path)
    job.at(0.0, "agent.workers_started", attempt=0)
    job.at(5.0, "trainer.progress", step=10)
    summary = summary_of(render_text(load_timeline(str(path))))
    assert summary[0] == (
        "  attempt 0: +0.000s .. +5.000s (5.000 s), running (still running at the last event)"
    )
    assert summary[-1] == "  outcome: unknown (no final event)"


def test_agents_sharing_one_file_get_one_lane_each(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    a = Job(path, context={"hostname": "node-a", "agent_pid": 11})
    b = Job(path, context={"hostname": "node-b", "agent_pid": 22})
    a.at(0.0, "agent.workers_started", attempt=0)
    b.at(0.2, "agent.workers_started", attempt=0)
    a.at(1.0, "agent.succeeded", restarts=0)
    b.at(1.0, "agent.failed", failures=1, restarts=0)
    tl = load_timeline(str(path))
    assert list(tl.lanes) == ["node-a (pid 11)", "node-b (pid 22)"]
    text = render_text(tl)
    assert "[node-b (pid 22)] agent.workers_started" in text
    summary = summary_of(text)
    assert summary.index("  node-a (pid 11):") < summary.index("    outcome: succeeded")
    assert summary.index("  node-b (pid 22):") < summary.index(
        "    outcome: failed: 1 worker(s) failed"
    )


def test_torn_and_foreign_lines_are_skipped_and_counted() -> None:
    lines = [
        json.dumps({"name": "a", "source": "AGENT", "timestamp": 2_000, "metadata": {}}),
        "",
        "[1, 2]",
        '{"no_name": 1}',
        json.dumps({"name": "b", "timestamp": 1_000}),
        '{"name": "agent.resta',  # the writer died mid-line
    ]
    events, skipped = parse_events(lines)
    assert [e.name for e in events] == ["b", "a"]  # sorted by time
    assert skipped == 3
    text = render_text(build_timeline(events, skipped=skipped))
    assert "(3 line(s) that are not events were skipped)" in text


def test_timestamps_in_seconds_are_understood() -> None:
    lines = [
        json.dumps({"name": "a", "source": "AGENT", "timestamp": 1_700_000_000, "metadata": {}}),
        json.dumps({"name": "b", "source": "AGENT", "timestamp": 1_700_000_001.5}),
    ]
    events, _ = parse_events(lines)
    assert [e.t_ms for e in events] == [1_700_000_000_000, 1_700_000_001_500]


def test_html_is_well_formed_self_contained_and_draws_attempts_and_failures(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    write_restarting_job(path)
    page = render_html(load_timeline(str(path)))
    assert page.startswith("<!DOCTYPE html>")
    root = ET.fromstring(page.split("\n", 1)[1])  # well-formed: parses as XML
    assert root.tag == "html"
    assert root.find(".//script") is None and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )
    svg = root.find(f".//{SVG}svg")
    assert svg is not None
    titles = [t.text or "" for t in svg.iter(f"{SVG}title")]
    attempts = [t for t in titles if t.startswith("attempt ")]
    assert len(attempts) == 3 and "succeeded" in attempts[2]
    failures = [c for c in svg.iter(f"{SVG}circle") if c.find(f"{SVG}title") is not None]
    assert len(failures) == 2
    assert any(t.startswith("restart 1: 0.150 s") for t in titles)
    assert any(t.startswith("trainer.checkpoint") for t in titles)
    pre = root.find(".//pre")
    assert pre is not None and "outcome: succeeded after 2 restarts" in (pre.text or "")


def test_html_escapes_whatever_the_log_contains(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    job = Job(path, context={"hostname": "<b>&'\"", "agent_pid": 1})
    job.at(0.0, "<script>alert(1)</script>", note="</pre>")
    page = render_html(load_timeline(str(path)))
    ET.fromstring(page.split("\n", 1)[1])
    assert "<script>" not in page


def test_an_empty_log_renders_without_error() -> None:
    tl = build_timeline([], source="empty.jsonl")
    assert render_text(tl) == "empty.jsonl: no events\n"
    ET.fromstring(render_html(tl).split("\n", 1)[1])


# --------------------------------------------------------------------- the command


def test_command_prints_the_text_and_writes_the_chart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "events.jsonl"
    out = tmp_path / "timeline.html"
    write_restarting_job(path)
    assert timeline_main([str(path), "--html", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "outcome: succeeded after 2 restarts" in printed
    assert f"chart written to {out}" in printed
    assert "<svg" in out.read_text()


@pytest.mark.parametrize(
    "odd",
    [float("nan"), float("inf"), float("-inf"), 10**400],
    ids=["NaN", "Infinity", "-Infinity", "an-integer-past-floats"],
)
def test_numbers_json_allows_but_no_agent_writes_read_as_missing(
    odd: float, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Python's json reads NaN and Infinity, and any integer; a hand-edited or foreign log
    # may hold them in any field the timeline reads as a number.
    path = tmp_path / "events.jsonl"
    write_restarting_job(path)
    fields = ("rank", "attempt", "exitcode", "restart_count", "duration_ms", "round")
    odd_events = [
        {
            "name": "agent.restart",
            "timestamp": 1_700_000_009_000,
            "metadata": dict.fromkeys(fields, odd),
        },
        {
            "name": "agent.rendezvous",
            "timestamp": odd,
            "metadata": {"round": 9, "duration_ms": odd},
        },
        {
            "name": "agent.workers_started",
            "timestamp": 1_700_000_009_500,
            "metadata": {"attempt": odd},
        },
    ]
    with path.open("a") as fh:
        fh.writelines(json.dumps({"source": "AGENT", **e}) + "\n" for e in odd_events)
    out = tmp_path / "timeline.html"
    assert timeline_main([str(path), "--html", str(out)]) == 0
    assert "summary:" in capsys.readouterr().out
    page = out.read_text()
    ET.fromstring(page.split("\n", 1)[1])  # still well-formed
    svg = page.split("<svg", 1)[1].split("</svg>", 1)[0]
    numbers = re.findall(r' (?:x|y|width|height|cx|cy|x1|x2|y1|y2)="([^"]*)"', svg)
    assert numbers and all(math.isfinite(float(n)) for n in numbers)


def test_command_reports_a_missing_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert timeline_main([str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elastrun timeline: error: cannot read ")
    assert err.count("\n") == 1


def test_command_reports_an_unwritable_chart_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "events.jsonl"
    write_restarting_job(path)
    assert timeline_main([str(path), "--html", str(tmp_path / "no" / "dir" / "x.html")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_command_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert timeline_main([]) == 2
    assert "usage: elastrun timeline" in capsys.readouterr().err
    assert timeline_main(["--help"]) == 0
    assert "--html" in capsys.readouterr().out
