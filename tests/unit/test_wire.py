"""Every wire format declares its version, and its reader refuses another one."""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

import pytest

import elastrun.wire
from elastrun.launch.commands.stacks import stacks_main
from elastrun.pace.worker.report import Reporter
from elastrun.wire import checkpoint, inprocess, progress, template, timer, workers

WIRE_MODULES = sorted(m.name for m in pkgutil.iter_modules(elastrun.wire.__path__))


def test_the_wire_package_holds_the_seven_formats_and_the_variables_names() -> None:
    assert WIRE_MODULES == [
        "bootstrap", "checkpoint", "env", "inprocess", "progress", "template", "timer", "workers",
    ]  # fmt: skip


@pytest.mark.parametrize("name", WIRE_MODULES)
def test_every_wire_module_declares_an_integer_version(name: str) -> None:
    module = importlib.import_module(f"elastrun.wire.{name}")
    version = getattr(module, "VERSION", None)
    assert type(version) is int and version >= 1


# -- timer: torch's JSON lines, torch's "version": 1 -----------------------------------


def test_a_timer_request_carries_the_version_and_a_line_without_it_is_version_1() -> None:
    request = timer.FileTimerRequest(7, "s", 12.5, 9)
    assert json.loads(request.to_json())["version"] == timer.VERSION == 1
    line = '{"pid": 7, "scope_id": "s", "expiration_time": 12.5, "signal": 9}'
    assert timer.FileTimerRequest.from_json(line) == request


@pytest.mark.parametrize("version", [timer.VERSION + 1, 0, True, "1"])
def test_a_timer_request_of_another_version_is_refused(version: object) -> None:
    line = json.dumps(
        {"version": version, "pid": 7, "scope_id": "s", "expiration_time": 1.0, "signal": 9}
    )
    with pytest.raises(timer.TimerRequestError, match="unknown timer request version"):
        timer.FileTimerRequest.from_json(line)


# -- in-process channel: the version rides in the worker's hello -------------------------


def test_a_hello_of_this_version_or_from_before_the_key_is_accepted() -> None:
    assert inprocess.version_problem({"op": "hello", "version": inprocess.VERSION}) is None
    assert inprocess.version_problem({"op": "hello"}) is None  # version 2's hello


@pytest.mark.parametrize("version", [inprocess.VERSION + 1, 1, True, "2"])
def test_a_hello_of_another_version_is_refused(version: object) -> None:
    problem = inprocess.version_problem({"op": "hello", "version": version})
    assert problem == f"in-process channel version {version!r}, expected {inprocess.VERSION}"


def test_the_channels_messages_round_trip_with_the_version_key() -> None:
    hello = {"op": "hello", "version": inprocess.VERSION, "local_rank": 0, "pid": 1, "round": 0}
    assert inprocess.LineReader().feed(inprocess.encode(hello)) == [hello]


# -- worker template: every batch and request carries it --------------------------------


def _request(version: object) -> dict[str, object]:
    return {
        "version": version,
        **{name: kind() for name, kind in template.REQUEST_FIELDS.items()},
        "stdio": [False, False, False],
    }


def test_a_template_request_of_this_version_is_accepted() -> None:
    request = _request(template.VERSION)
    assert template.check_request(request, 0) is None
    batch = template.split_batch({"version": template.VERSION, "batch": [request]}, [99])
    assert batch == ([request], [[]], 99)


@pytest.mark.parametrize("version", [template.VERSION + 1, template.VERSION - 1, None, True])
def test_a_template_message_of_another_version_is_refused(version: object) -> None:
    expected = f"protocol version {version!r}, expected {template.VERSION}"
    assert template.version_problem({"version": version}) == expected
    assert template.check_request(_request(version), 0) == expected
    assert template.split_batch(
        {"version": version, "batch": [_request(template.VERSION)]}, [9]
    ) == (expected)


# -- progress file: the version is the header's second word ------------------------------


def test_a_progress_header_of_this_version_is_accepted() -> None:
    header = progress.header_words(2)[:4]
    assert progress.header_problem(header, progress.file_size(2), 1) is None
    assert progress.header_problem(header, progress.file_size(2), 2) == (
        f"has no record 2 (2 records, {progress.file_size(2)} bytes)"
    )


def test_a_progress_file_of_another_version_is_refused_by_its_writer(tmp_path: Path) -> None:
    header = progress.header_words(1)
    header[1] = progress.VERSION + 1
    assert progress.header_problem(header[:4], progress.file_size(1), 0) == (
        f"is a version {progress.VERSION + 1} progress file, not version {progress.VERSION}"
    )
    path = tmp_path / "progress"
    path.write_bytes(b"".join(w.to_bytes(8, "little", signed=True) for w in header))
    with path.open("r+b") as fh:
        fh.truncate(progress.file_size(1))
    with pytest.raises(progress.ProgressFileError, match="is a version 2 progress file"):
        Reporter.open(str(path), 0)


# -- workers.json: the object's "version" key ----------------------------------------------


def test_workers_json_round_trips_and_carries_the_version() -> None:
    entries = {
        1: workers.WorkerEntry(12, "/logs/1/stacks.txt", None),
        0: workers.WorkerEntry(11, "/logs/0/stacks.txt", 4567),
    }
    text = workers.encode(entries)
    assert json.loads(text)["version"] == workers.VERSION
    assert list(json.loads(text)["workers"]) == ["0", "1"]
    assert workers.decode(text) == entries


@pytest.mark.parametrize("version", [workers.VERSION + 1, None, True])
def test_workers_json_of_another_version_is_refused(version: object) -> None:
    text = json.dumps({"version": version, "workers": {}})
    with pytest.raises(workers.WorkersFileError, match=f"version {version!r}, this elastrun"):
        workers.decode(text)


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[]",
        '{"version": 1}',
        '{"version": 1, "workers": {"x": {"pid": 1, "stacks": "s", "start_time": null}}}',
        '{"version": 1, "workers": {"0": {"pid": true, "stacks": "s", "start_time": null}}}',
        '{"version": 1, "workers": {"0": {"pid": 1, "stacks": 2, "start_time": null}}}',
        '{"version": 1, "workers": {"0": {"pid": 1, "stacks": "s", "start_time": "t"}}}',
        '{"version": 1, "workers": {"0": 5}}',
    ],
)
def test_a_malformed_workers_json_is_refused(text: str) -> None:
    with pytest.raises(workers.WorkersFileError):
        workers.decode(text)


def test_elastrun_stacks_names_a_workers_json_of_another_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    attempt = tmp_path / "run_x" / "attempt_0"
    attempt.mkdir(parents=True)
    (attempt / workers.FILE_NAME).write_text(json.dumps({"version": 99, "workers": {}}))
    assert stacks_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"elastrun stacks: {attempt / workers.FILE_NAME}: "
        f"version 99, this elastrun reads version {workers.VERSION}\n"
    )


# -- memory checkpoints: the marker's "version" key ---------------------------------------


def test_a_checkpoint_marker_round_trips_and_carries_the_version() -> None:
    marker = checkpoint.Marker(step=42, rank=3, world_size=4, data_bytes=100, meta_bytes=7)
    text = checkpoint.encode_marker(marker)
    assert json.loads(text)["version"] == checkpoint.VERSION
    assert checkpoint.decode_marker(text) == marker


@pytest.mark.parametrize("version", [checkpoint.VERSION + 1, 0, True, "1", None])
def test_a_checkpoint_marker_of_another_version_is_refused(version: object) -> None:
    data = {"version": version, "step": 1, "rank": 0, "world_size": 1,
            "data_bytes": 0, "meta_bytes": 0}  # fmt: skip
    with pytest.raises(checkpoint.MarkerError, match="version"):
        checkpoint.decode_marker(json.dumps(data))


@pytest.mark.parametrize(
    "text", ["", "[]", '{"version": 1}', '{"version": 1, "step": -1, "rank": 0, '
     '"world_size": 1, "data_bytes": 0, "meta_bytes": 0}'],
)  # fmt: skip
def test_a_malformed_checkpoint_marker_is_refused(text: str) -> None:
    with pytest.raises(checkpoint.MarkerError):
        checkpoint.decode_marker(text)


def test_checkpoint_step_directories_sort_as_their_steps_and_name_their_ranks_files() -> None:
    names = [checkpoint.step_dir_name(s) for s in (10, 9, 100)]
    assert sorted(names) == [checkpoint.step_dir_name(s) for s in (9, 10, 100)]
    assert [checkpoint.step_of_dir(n) for n in names] == [10, 9, 100]
    assert checkpoint.step_of_dir("step-12") is None
    assert checkpoint.step_of_dir("spare") is None
    for name in (checkpoint.data_name(3), checkpoint.meta_name(3), checkpoint.marker_name(3),
                 checkpoint.marker_name(3) + ".tmp"):  # fmt: skip
        assert checkpoint.rank_of_file(name) == 3
    assert checkpoint.rank_of_file("rank-3.other") is None
