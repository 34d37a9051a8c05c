"""Unit tests of elastrun.events: torch's event API with real timestamps and clear errors."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from elastrun import events
from elastrun.core.errors import ConfigError
from elastrun.events import Event, EventSource, NodeState, RdzvEvent


def read_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def now_ms() -> int:
    return int(time.time() * 1000)


# --------------------------------------------------------------------- types


def test_event_defaults_match_torch() -> None:
    ev = Event("x", EventSource.AGENT)
    assert ev.timestamp == 0
    assert ev.metadata == {}
    assert Event("y", EventSource.WORKER).metadata is not ev.metadata


def test_event_serializes_to_the_event_log_line_format_and_back() -> None:
    ev = Event("e", EventSource.WORKER, 1234, {"a": 1, "b": None, "c": "s", "d": 1.5, "e": True})
    obj = json.loads(ev.serialize())
    assert obj == {
        "name": "e",
        "source": "WORKER",
        "timestamp": 1234,
        "metadata": {"a": 1, "b": None, "c": "s", "d": 1.5, "e": True},
    }
    assert str(ev) == ev.serialize()
    assert Event.deserialize(ev.serialize()) == ev
    assert Event.deserialize(ev) is ev


def test_event_deserializes_what_torch_writes() -> None:
    text = '{"name": "torchelastic.worker.status.START", "source": "AGENT", "timestamp": 0, "metadata": {"run_id": "r"}}'  # noqa: E501
    ev = Event.deserialize(text)
    assert ev.source is EventSource.AGENT
    assert ev.metadata == {"run_id": "r"}


def test_event_deserialize_rejects_text_that_is_not_an_object() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        Event.deserialize("[1, 2]")
    with pytest.raises(KeyError):
        Event.deserialize('{"source": "AGENT"}')


def test_rdzv_event_round_trips_and_reads_torchs_form_without_timestamp() -> None:
    ev = RdzvEvent("n", "run", "msg", "host", 12, NodeState.RUNNING, "h:1", 0, 3, "", 99)
    assert RdzvEvent.deserialize(ev.serialize()) == ev
    torch_form = json.loads(ev.serialize())
    del torch_form["timestamp"]
    parsed = RdzvEvent.deserialize(json.dumps(torch_form))
    assert parsed.timestamp == 0 and parsed.node_state is NodeState.RUNNING


def test_enums_are_strings_with_torchs_members() -> None:
    assert [s.value for s in EventSource] == ["AGENT", "WORKER"]
    assert [s.value for s in NodeState] == ["INIT", "RUNNING", "SUCCEEDED", "FAILED"]
    assert EventSource.AGENT == "AGENT"


# --------------------------------------------------------------------- record


def test_record_to_a_file_stamps_the_real_time_and_keeps_metadata_plain(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    ev = Event("trainer.checkpoint", EventSource.WORKER, metadata={"step": 100, "rank": 0})
    before = now_ms()
    events.record(ev, destination=f"file:{path}")
    after = now_ms()
    (line,) = read_lines(path)
    assert line["name"] == "trainer.checkpoint"
    assert line["source"] == "WORKER"
    # The wall clock may step back a little (NTP, VMs): "real time" within a margin.
    assert isinstance(line["timestamp"], int) and before - 50 <= line["timestamp"] <= after + 50
    assert line["metadata"] == {"step": 100, "rank": 0}  # plain values, not [100] / (100,)
    assert ev.timestamp == 0  # the caller's object is left alone


def test_record_keeps_a_timestamp_the_event_already_has(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events.record(Event("e", EventSource.AGENT, timestamp=1_600_000_000_000), f"file:{path}")
    assert read_lines(path)[0]["timestamp"] == 1_600_000_000_000


def test_record_to_console_writes_one_json_line_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    events.record(Event("hello", EventSource.AGENT), destination="console")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert json.loads(captured.err)["name"] == "hello"


def test_record_to_null_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    events.record(Event("quiet", EventSource.AGENT))
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("destination", ["syslog", "", "file:"])
def test_an_unknown_destination_is_a_clear_config_error_that_is_also_a_key_error(
    destination: str,
) -> None:
    with pytest.raises(events.UnknownEventDestinationError) as info:
        events.record(Event("e", EventSource.AGENT), destination=destination)
    err = info.value
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    assert isinstance(err, KeyError)  # torch raised KeyError; old except clauses still work
    assert err.field == "destination" and err.value == destination
    assert str(err).startswith("destination: ")  # not KeyError's quoted repr


# --------------------------------------------------------------------- logging handlers


def test_logging_handlers_match_torchs_kinds() -> None:
    console = events.get_logging_handler("console")
    assert type(console) is logging.StreamHandler
    assert console.stream is not None
    assert isinstance(events.get_logging_handler("null"), logging.NullHandler)
    assert isinstance(events.get_logging_handler(), logging.NullHandler)
    assert isinstance(events.get_logging_handler("dynamic_rendezvous"), logging.NullHandler)
    assert events.get_logging_handler("console") is console


def test_file_logging_handler_appends_each_record_as_a_line(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    handler = events.get_logging_handler(f"file:{path}")
    assert isinstance(handler, events.JsonLinesLogHandler)
    logger = logging.getLogger(f"test-events-{tmp_path.name}")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        logger.warning(Event("e", EventSource.AGENT, 5).serialize())
    finally:
        logger.removeHandler(handler)
    assert read_lines(path) == [{"name": "e", "source": "AGENT", "timestamp": 5, "metadata": {}}]


def test_get_logging_handler_rejects_an_unknown_destination() -> None:
    with pytest.raises(KeyError):
        events.get_logging_handler("nowhere")


# --------------------------------------------------------------------- rendezvous events


def test_rdzv_events_are_discarded_by_default_as_in_torch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    events.construct_and_record_rdzv_event("run", "joined", NodeState.RUNNING)
    events.record_rdzv_event(RdzvEvent("n", "run", "m", "h", 1, NodeState.INIT))
    assert capsys.readouterr() == ("", "")


def test_constructed_rdzv_event_names_its_caller_and_fills_host_and_pid(tmp_path: Path) -> None:
    path = tmp_path / "rdzv.jsonl"
    events.construct_and_record_rdzv_event(
        "run1", "joined round 2", NodeState.RUNNING, rank=1, destination=f"file:{path}"
    )
    (line,) = read_lines(path)
    here = os.path.basename(__file__)
    assert (
        line["name"]
        == f"{here}:test_constructed_rdzv_event_names_its_caller_and_fills_host_and_pid"
    )
    assert line["source"] == "AGENT"
    meta = line["metadata"]
    assert isinstance(meta, dict)
    assert meta["run_id"] == "run1" and meta["message"] == "joined round 2"
    assert meta["node_state"] == "RUNNING" and meta["rank"] == 1
    assert meta["pid"] == os.getpid() and meta["hostname"]
    assert meta["error_trace"] == ""
    assert isinstance(line["timestamp"], int) and line["timestamp"] > 1_600_000_000_000


def test_a_failed_rdzv_event_carries_the_traceback_being_handled(tmp_path: Path) -> None:
    path = tmp_path / "rdzv.jsonl"
    try:
        raise RuntimeError("store unreachable")
    except RuntimeError:
        events.construct_and_record_rdzv_event(
            "run", "failed", NodeState.FAILED, name="join", destination=f"file:{path}"
        )
    events.construct_and_record_rdzv_event(
        "run", "failed", NodeState.FAILED, name="join", destination=f"file:{path}"
    )
    first, second = read_lines(path)
    assert str(first["name"]).endswith(":join")
    # index: the parsed JSON's metadata is typed object
    assert "store unreachable" in first["metadata"]["error_trace"]  # type: ignore[index]
    # index: the parsed JSON's metadata is typed object
    assert second["metadata"]["error_trace"] == ""  # type: ignore[index]


def test_public_names_match_torch_elastic_events() -> None:
    torch_names = {
        "Event",
        "EventMetadataValue",
        "EventSource",
        "NodeState",
        "RdzvEvent",
        "construct_and_record_rdzv_event",
        "get_logging_handler",
        "record",
        "record_rdzv_event",
    }
    assert torch_names <= set(events.__all__)
    assert all(hasattr(events, n) for n in events.__all__)
