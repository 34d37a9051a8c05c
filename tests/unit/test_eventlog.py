"""Unit tests of the event sinks behind --event-log-handler (null, console, file:PATH)."""

from __future__ import annotations

import io
import json
import logging
import threading
from pathlib import Path

import pytest

from elastrun.core.errors import ConfigError
from elastrun.observe.eventlog import (
    ConsoleEventSink,
    JsonLinesEventSink,
    NullEventLog,
    make_event_sink,
)
from elastrun.observe.sinks import EventSink, EventValue
from elastrun.testing import FakeClock


def read_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------- make_event_sink


def test_null_and_torchs_dynamic_rendezvous_discard_events() -> None:
    assert isinstance(make_event_sink("null"), NullEventLog)
    assert isinstance(make_event_sink("dynamic_rendezvous"), NullEventLog)


def test_console_spec_gives_a_console_sink() -> None:
    assert isinstance(make_event_sink("console"), ConsoleEventSink)


def test_file_spec_gives_a_json_lines_sink_without_touching_the_file(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "events.jsonl"
    sink = make_event_sink(f"file:{target}")
    assert isinstance(sink, JsonLinesEventSink)
    assert sink.path == str(target)
    assert not target.parent.exists()  # parsing the option does no I/O


@pytest.mark.parametrize("spec", ["", "syslog", "Console", "file", "File:/tmp/x", "json:/tmp/x"])
def test_unknown_specs_are_rejected_naming_the_option(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_event_sink(spec)
    assert info.value.field == "--event-log-handler"
    assert info.value.value == spec
    assert "null, console or file:PATH" in str(info.value)


def test_file_spec_without_a_path_is_rejected() -> None:
    with pytest.raises(ConfigError, match="needs a path"):
        make_event_sink("file:")


# --------------------------------------------------------------------- JSON lines


def test_each_event_is_one_json_object_with_name_source_timestamp_and_metadata(
    tmp_path: Path,
) -> None:
    clock = FakeClock(wall=1_700_000_000.25)
    path = tmp_path / "events.jsonl"
    sink: EventSink = JsonLinesEventSink(path, clock=clock)
    sink.record("agent.rendezvous", {"round": 1, "group_rank": None, "ok": True})
    clock.advance(1.5)
    sink.record("agent.restart", {"rank": 1, "exitcode": 3, "why": "a b"})
    assert read_lines(path) == [
        {
            "name": "agent.rendezvous",
            "source": "AGENT",
            "timestamp": 1_700_000_000_250,
            "metadata": {"round": 1, "group_rank": None, "ok": True},
        },
        {
            "name": "agent.restart",
            "source": "AGENT",
            "timestamp": 1_700_000_001_750,
            "metadata": {"rank": 1, "exitcode": 3, "why": "a b"},
        },
    ]


def test_the_file_and_its_directory_are_created_and_existing_lines_are_kept(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a" / "b" / "events.jsonl"
    JsonLinesEventSink(path).record("first", {})
    JsonLinesEventSink(path).record("second", {})
    assert [e["name"] for e in read_lines(path)] == ["first", "second"]


def test_context_is_added_to_every_event_and_the_events_own_values_win(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = JsonLinesEventSink(path, context={"run_id": "job1", "hostname": "h", "rank": -1})
    sink.record("e", {"rank": 4})
    (event,) = read_lines(path)
    assert event["metadata"] == {"run_id": "job1", "hostname": "h", "rank": 4}


def test_record_event_keeps_the_given_source_and_timestamp(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    JsonLinesEventSink(path).record_event("w", "WORKER", 42, {"local_rank": 0})
    (event,) = read_lines(path)
    assert event == {
        "name": "w",
        "source": "WORKER",
        "timestamp": 42,
        "metadata": {"local_rank": 0},
    }


def test_a_value_json_cannot_hold_is_written_as_text_instead_of_failing(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    # dict-item: a Path is no EventValue: the sink must write it as text
    weird: dict[str, EventValue] = {"path": Path("/x/y")}  # type: ignore[dict-item]
    JsonLinesEventSink(path).record("e", weird)
    assert read_lines(path)[0]["metadata"] == {"path": "/x/y"}


def test_lines_stay_whole_with_many_concurrent_writers(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    writers, per_writer = 4, 150
    payload = "x" * 3000  # several lines per page: a torn write would show

    def write(n: int) -> None:
        sink = JsonLinesEventSink(path)  # each writer has its own descriptor, as agents do
        for i in range(per_writer):
            sink.record("e", {"writer": n, "i": i, "payload": payload})

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = read_lines(path)  # every line parses
    assert len(events) == writers * per_writer
    for n in range(writers):
        # index: the parsed JSON's metadata is typed object
        mine = [e["metadata"]["i"] for e in events if e["metadata"]["writer"] == n]  # type: ignore[index]
        assert mine == list(range(per_writer))


def test_a_failing_write_is_logged_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    sink = JsonLinesEventSink(blocker / "events.jsonl")
    with caplog.at_level(logging.WARNING, logger="elastrun.observe.eventlog"):
        sink.record("a", {})
        sink.record("b", {})
    assert sink.failed == 2 and sink.written == 0
    assert len([r for r in caplog.records if "cannot write the event log" in r.message]) == 1


def test_probe_reports_an_unusable_path_as_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(ConfigError) as info:
        JsonLinesEventSink(blocker / "events.jsonl").probe()
    assert info.value.field == "--event-log-handler"
    assert "cannot append to the event log" in str(info.value)


def test_probe_creates_an_empty_file_for_a_good_path(tmp_path: Path) -> None:
    path = tmp_path / "d" / "events.jsonl"
    JsonLinesEventSink(path).probe()
    assert path.read_text() == ""


# --------------------------------------------------------------------- console, fanout


def test_console_sink_writes_the_same_json_line_to_its_stream() -> None:
    stream = io.StringIO()
    ConsoleEventSink(stream, clock=FakeClock(wall=2.0)).record("e", {"k": "v"})
    assert json.loads(stream.getvalue()) == {
        "name": "e",
        "source": "AGENT",
        "timestamp": 2000,
        "metadata": {"k": "v"},
    }
    assert stream.getvalue().count("\n") == 1


def test_console_sink_defaults_to_stderr_at_event_time(capsys: pytest.CaptureFixture[str]) -> None:
    sink = make_event_sink("console")
    sink.record("hello", {})
    captured = capsys.readouterr()
    assert captured.out == ""
    assert json.loads(captured.err)["name"] == "hello"
