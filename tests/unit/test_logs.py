"""Unit tests of the --redirects/--tee syntax, filter parsing, log layout and prefixes."""

from __future__ import annotations

import os
import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.supervise.processes.logs import (
    DefaultLogsSpecs,
    LogsDest,
    LogsSpecs,
    Std,
    format_line_prefix,
    parse_duplicate_filters,
    parse_local_ranks_filter,
    reify_or_console,
    to_map,
)

# --------------------------------------------------------------------------- Std


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", Std.NONE),
        ("1", Std.OUT),
        ("2", Std.ERR),
        ("3", Std.ALL),
        (" 3 ", Std.ALL),
        ("0:3", {0: Std.ALL}),
        ("0:3,1:0,2:1,3:2", {0: Std.ALL, 1: Std.NONE, 2: Std.OUT, 3: Std.ERR}),
        ("0:3,12:1", {0: Std.ALL, 12: Std.OUT}),
        ("10:3", {10: Std.ALL}),
        (" 0 : 1 , 7:2 ", {0: Std.OUT, 7: Std.ERR}),
        ("123456:2", {123456: Std.ERR}),
    ],
)
def test_std_from_str_accepts_values_and_maps_including_ranks_above_nine(
    text: str, expected: Std | dict[int, Std]
) -> None:
    assert Std.from_str(text) == expected


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("9", "'9'"),
        ("4", "'4'"),
        ("0:4", "'4'"),
        ("0:1,", "empty item"),
        ("0:1,1", "'1'"),
        ("1,0:1", "'1'"),
        ("a", "'a'"),
        ("", "empty"),
        ("   ", "empty"),
        ("0:1,0:2", "rank 0 appears twice"),
        ("-1:1", "'-1:1'"),
        ("0:", "''"),
        (":1", "':1'"),
        ("0:1:2", "'1:2'"),
        ("0:11", "'11'"),
        ("x:1", "'x:1'"),
        ("0;1", "'0;1'"),
        ("٣", "'٣'"),  # a non-ASCII digit that int() would accept
    ],
)
def test_std_from_str_rejects_malformed_text_naming_the_bad_part(text: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        Std.from_str(text)


def test_std_values_combine_as_bit_masks() -> None:
    assert Std.OUT | Std.ERR == Std.ALL
    assert Std.ALL & Std.ERR == Std.ERR
    assert int(Std.ALL) == 3


def test_to_map_fills_every_rank_from_a_single_value() -> None:
    assert to_map(Std.OUT, 3) == {0: Std.OUT, 1: Std.OUT, 2: Std.OUT}


def test_to_map_gives_none_to_missing_ranks_and_ignores_ranks_out_of_range() -> None:
    assert to_map({1: Std.ERR, 5: Std.ALL}, 3) == {0: Std.NONE, 1: Std.ERR, 2: Std.NONE}


@given(
    st.dictionaries(
        st.integers(min_value=0, max_value=100_000),
        st.sampled_from(list(Std)),
        min_size=1,
        max_size=20,
    ),
    st.sampled_from(["", " ", "  "]),
)
def test_std_rank_map_round_trips_through_its_text_form(mapping: dict[int, Std], pad: str) -> None:
    text = ",".join(f"{pad}{rank}{pad}:{pad}{int(v)}{pad}" for rank, v in mapping.items())
    assert Std.from_str(text) == mapping


# ------------------------------------------------------------------- filters


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("  ", None),
        ("0", {0}),
        ("0,2", {0, 2}),
        (" 1 , 3 ", {1, 3}),
        ("12,0,12", {0, 12}),
    ],
)
def test_parse_local_ranks_filter(text: str, expected: set[int] | None) -> None:
    assert parse_local_ranks_filter(text) == expected


@pytest.mark.parametrize("text", ["a", "0,", "0,,1", "-1", "1.5", "0;1"])
def test_parse_local_ranks_filter_rejects_non_integers(text: str) -> None:
    with pytest.raises(ValueError, match="local rank"):
        parse_local_ranks_filter(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", []),
        ("apple", ["apple"]),
        ("apple,orange", ["apple", "orange"]),
        ("from 1,,x,from 2", ["from 1,x", "from 2"]),
        (",,", [","]),
        ("a,,,b", ["a,", "b"]),
        ("a,,,,b", ["a,,b"]),
        ("a,,b,", ["a,b"]),
        (",a", ["a"]),
        (" spaced ", [" spaced "]),
    ],
)
def test_parse_duplicate_filters_treats_double_comma_as_a_literal_comma(
    text: str, expected: list[str]
) -> None:
    assert parse_duplicate_filters(text) == expected


# ------------------------------------------------------------------- prefixes


def test_default_prefix_is_torchruns_role_and_local_rank_without_trailing_space() -> None:
    assert format_line_prefix(None, "default", 7, 2) == "[default2]:"


def test_prefix_template_substitutes_role_rank_and_local_rank() -> None:
    template = "<${role_name}|${rank}|${local_rank}> "
    assert format_line_prefix(template, "trainer", 9, 1) == "<trainer|9|1> "


def test_prefix_template_leaves_unknown_placeholders_alone() -> None:
    assert format_line_prefix("$host ${rank}: $", "r", 3, 0) == "$host 3: $"


# ---------------------------------------------------------- DefaultLogsSpecs


def _envs(n: int, run_id: str = "job") -> dict[int, dict[str, str]]:
    return {
        lr: {"TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0"} for lr in range(n)
    }


def test_constructor_does_no_io(tmp_path: os.PathLike[str]) -> None:
    target = os.path.join(os.fspath(tmp_path), "not", "yet")
    specs = DefaultLogsSpecs(log_dir=target)
    assert not os.path.exists(target)
    assert specs.run_log_dir is None
    assert specs.attempt_dirs == []
    assert specs.root_log_dir == target


def test_reify_builds_run_attempt_and_rank_directories(tmp_path: os.PathLike[str]) -> None:
    root = os.path.join(os.fspath(tmp_path), "logs")
    specs = DefaultLogsSpecs(log_dir=root, redirects=Std.ERR, tee={1: Std.OUT})
    envs = _envs(2, run_id="myjob")
    dest = specs.reify(envs)

    run_dir = specs.run_log_dir
    assert run_dir is not None
    assert os.path.dirname(run_dir) == root
    assert os.path.basename(run_dir).startswith("myjob_")
    attempt = os.path.join(run_dir, "attempt_0")
    assert specs.attempt_dirs == [attempt]
    assert sorted(os.listdir(attempt)) == ["0", "1"]

    assert dest.stdouts == {0: "", 1: os.path.join(attempt, "1", "stdout.log")}
    assert dest.stderrs == {lr: os.path.join(attempt, str(lr), "stderr.log") for lr in (0, 1)}
    assert dest.tee_stdouts == {1: os.path.join(attempt, "1", "stdout.log")}
    assert dest.tee_stderrs == {}
    assert dest.filtered_stdout == os.path.join(attempt, "filtered_stdout.log")
    assert dest.filtered_stderr == os.path.join(attempt, "filtered_stderr.log")
    for lr in (0, 1):
        error_file = os.path.join(attempt, str(lr), "error.json")
        assert dest.error_files[lr] == error_file
        assert envs[lr]["TORCHELASTIC_ERROR_FILE"] == error_file
    # Files are made by whoever writes them, not by reify.
    assert os.listdir(os.path.join(attempt, "0")) == []


def test_every_reify_gets_a_new_attempt_dir_and_keeps_earlier_logs(
    tmp_path: os.PathLike[str],
) -> None:
    specs = DefaultLogsSpecs(log_dir=os.fspath(tmp_path), redirects=Std.ALL)
    first = specs.reify(_envs(1))
    with open(first.stdouts[0], "w") as f:
        f.write("before the membership change\n")
    # Same restart count (a membership change): torch would wipe attempt_0 here.
    second = specs.reify(_envs(1))
    assert first.stdouts[0] != second.stdouts[0]
    with open(first.stdouts[0]) as f:
        assert f.read() == "before the membership change\n"
    run_dir = specs.run_log_dir
    assert run_dir is not None
    assert specs.attempt_dirs == [os.path.join(run_dir, f"attempt_{k}") for k in (0, 1)]


def test_reify_skips_attempt_dirs_that_already_exist(tmp_path: os.PathLike[str]) -> None:
    specs = DefaultLogsSpecs(log_dir=os.fspath(tmp_path))
    specs.reify(_envs(1))
    run_dir = specs.run_log_dir
    assert run_dir is not None
    os.mkdir(os.path.join(run_dir, "attempt_1"))
    marker = os.path.join(run_dir, "attempt_1", "keep")
    open(marker, "w").close()
    specs.reify(_envs(1))
    assert specs.attempt_dirs[-1] == os.path.join(run_dir, "attempt_2")
    assert os.path.exists(marker)
    specs.reify(_envs(1))
    assert specs.attempt_dirs[-1] == os.path.join(run_dir, "attempt_3")


def test_run_dir_is_made_once_per_instance(tmp_path: os.PathLike[str]) -> None:
    specs = DefaultLogsSpecs(log_dir=os.fspath(tmp_path))
    specs.reify(_envs(1, run_id="a"))
    run_dir = specs.run_log_dir
    specs.reify(_envs(1, run_id="b"))
    assert specs.run_log_dir == run_dir
    assert os.listdir(os.fspath(tmp_path)) == [os.path.basename(str(run_dir))]


def test_missing_run_id_defaults_and_separators_cannot_escape_the_log_dir(
    tmp_path: os.PathLike[str],
) -> None:
    root = os.fspath(tmp_path)
    specs = DefaultLogsSpecs(log_dir=root)
    specs.reify({0: {}})
    assert os.path.basename(str(specs.run_log_dir)).startswith("none_")
    other = DefaultLogsSpecs(log_dir=root)
    other.reify(_envs(1, run_id="../../evil"))
    assert os.path.dirname(str(other.run_log_dir)) == root
    assert os.path.basename(str(other.run_log_dir)).startswith(".._.._evil_")


def test_reify_handles_any_set_of_local_ranks(tmp_path: os.PathLike[str]) -> None:
    specs = DefaultLogsSpecs(log_dir=os.fspath(tmp_path), tee={12: Std.ALL})
    envs = {lr: {"TORCHELASTIC_RUN_ID": "j"} for lr in (3, 12)}
    dest = specs.reify(envs)
    assert set(dest.error_files) == {3, 12}
    assert dest.stdouts[3] == ""
    assert dest.tee_stdouts[12].endswith(os.path.join("12", "stdout.log"))


def test_missing_log_dir_is_created_at_first_reify(tmp_path: os.PathLike[str]) -> None:
    root = os.path.join(os.fspath(tmp_path), "a", "b")
    specs = DefaultLogsSpecs(log_dir=root)
    specs.reify(_envs(1))
    assert os.path.isdir(root)


def test_log_dir_that_is_a_file_fails_at_first_reify(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(os.fspath(tmp_path), "file")
    open(path, "w").close()
    specs = DefaultLogsSpecs(log_dir=path)  # no error yet: the constructor does no I/O
    with pytest.raises(NotADirectoryError, match="file"):
        specs.reify(_envs(1))


def test_run_dir_removed_during_the_run_is_made_again(
    tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture
) -> None:
    root = os.path.join(os.fspath(tmp_path), "logs")
    specs = DefaultLogsSpecs(log_dir=root)
    specs.reify(_envs(1))
    run_dir = str(specs.run_log_dir)
    shutil.rmtree(root)
    dest = specs.reify(_envs(1))
    assert specs.run_log_dir == run_dir
    assert dest.error_files[0] == os.path.join(run_dir, "attempt_1", "0", "error.json")
    assert os.path.isdir(os.path.join(run_dir, "attempt_1", "0"))
    assert [r.getMessage() for r in caplog.records] == [
        f"log directory {run_dir} was removed during the run; made it again for attempt 1"
    ]


def test_reify_or_console_sends_file_streams_to_the_console_when_the_dir_fails(
    tmp_path: os.PathLike[str], caplog: pytest.LogCaptureFixture
) -> None:
    blocker = os.path.join(os.fspath(tmp_path), "file")
    open(blocker, "w").close()
    specs = DefaultLogsSpecs(log_dir=blocker, redirects={0: Std.ERR}, tee={1: Std.OUT})
    envs = _envs(3)
    envs[2]["TORCHELASTIC_ERROR_FILE"] = "/the/agents/own/error.json"
    dest = reify_or_console(specs, envs)
    problem = f"cannot write worker logs to {blocker}: exists and is not a directory"
    assert dest == LogsDest(
        stdouts={0: "", 1: "", 2: ""},
        stderrs={0: "", 1: "", 2: ""},
        error_files={0: "", 1: "", 2: ""},
        problem=problem,
        to_console={0: Std.ERR, 1: Std.OUT},
    )
    assert all(env["TORCHELASTIC_ERROR_FILE"] == "" for env in envs.values())
    assert [r.getMessage() for r in caplog.records] == [
        f"{problem}; this attempt's output goes to the agent's console and its workers "
        "write no error files"
    ]


def test_reify_or_console_lets_other_errors_through() -> None:
    class Broken(LogsSpecs):
        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            raise ValueError("a bug")

        @property
        def root_log_dir(self) -> str:
            return ""

    with pytest.raises(ValueError, match="a bug"):
        reify_or_console(Broken(), _envs(1))


@pytest.mark.parametrize("log_dir", [None, ""])
def test_no_log_dir_uses_a_temporary_directory_made_lazily(
    log_dir: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    monkeypatch.setenv("TMPDIR", os.fspath(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    specs = DefaultLogsSpecs(log_dir=log_dir)
    assert specs.is_temporary
    assert specs.root_log_dir == ""
    assert os.listdir(os.fspath(tmp_path)) == []
    specs.reify(_envs(1))
    root = specs.root_log_dir
    assert os.path.dirname(root) == os.fspath(tmp_path)
    assert os.path.basename(root).startswith("elastrun_")
    assert os.path.dirname(str(specs.run_log_dir)) == root


def test_explicit_log_dir_is_not_temporary(tmp_path: os.PathLike[str]) -> None:
    assert not DefaultLogsSpecs(log_dir=os.fspath(tmp_path)).is_temporary


def test_devnull_mode_makes_no_files_and_disables_error_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[str] = []
    monkeypatch.setattr(os, "mkdir", lambda *a, **k: made.append(str(a[0])))
    specs = DefaultLogsSpecs(log_dir=os.devnull, redirects=Std.ALL, tee=Std.ALL)
    envs = _envs(2)
    dest = specs.reify(envs)
    assert made == []
    assert dest == LogsDest(
        stdouts={0: "", 1: ""},
        stderrs={0: "", 1: ""},
        tee_stdouts={},
        tee_stderrs={},
        error_files={0: os.devnull, 1: os.devnull},
        filtered_stdout="",
        filtered_stderr="",
    )
    assert envs[0]["TORCHELASTIC_ERROR_FILE"] == ""
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == ""
    assert specs.root_log_dir == os.devnull
    assert specs.run_log_dir is None
    assert specs.attempt_dirs == []


def test_equality_compares_settings_not_state(tmp_path: os.PathLike[str]) -> None:
    root = os.fspath(tmp_path)
    a = DefaultLogsSpecs(log_dir=root, redirects=Std.OUT, tee={0: Std.ERR}, local_ranks_filter={0})
    b = DefaultLogsSpecs(log_dir=root, redirects=Std.OUT, tee={0: Std.ERR}, local_ranks_filter={0})
    a.reify(_envs(1))
    assert a == b
    assert a != DefaultLogsSpecs(log_dir=root, redirects=Std.ERR)
    assert a != DefaultLogsSpecs(log_dir=root, redirects=Std.OUT, tee={0: Std.ERR})
    assert a != "not a specs"


def test_repr_shows_settings_and_progress(tmp_path: os.PathLike[str]) -> None:
    specs = DefaultLogsSpecs(log_dir=os.fspath(tmp_path), tee=Std.ALL)
    assert "attempts=0" in repr(specs)
    specs.reify(_envs(1))
    text = repr(specs)
    assert "attempts=1" in text
    assert "Std.ALL" in text
    assert str(specs.run_log_dir) in text


def test_torch_style_private_names_alias_the_public_attributes() -> None:
    class Custom(LogsSpecs):
        def __init__(self) -> None:
            super().__init__(log_dir="/x", redirects=Std.OUT, tee=Std.ERR, local_ranks_filter={1})
            self._root_log_dir = "/y"  # as torch's subclasses sometimes do

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            return LogsDest()

        @property
        def root_log_dir(self) -> str:
            return str(self._root_log_dir)

    custom = Custom()
    assert custom.root_log_dir == "/y" == custom.log_dir
    assert custom._redirects is Std.OUT is custom.redirects
    assert custom._tee is Std.ERR
    assert custom._local_ranks_filter == {1}


def test_logs_specs_is_abstract() -> None:
    with pytest.raises(TypeError):
        LogsSpecs()  # type: ignore[abstract]  # abstract: it must raise


def test_a_launch_with_a_log_dir_that_is_a_file_is_refused_before_anything_starts(
    tmp_path: os.PathLike[str],
) -> None:
    # torch: NotADirectoryError from DefaultLogsSpecs(); ours builds without I/O, and the
    # launch refuses it before its first worker (it used to warn and log to the console).
    import sys

    from elastrun import LaunchConfig, elastic_launch
    from elastrun.core.errors import ConfigError

    path = os.path.join(os.fspath(tmp_path), "file")
    open(path, "w").close()
    marker = os.path.join(os.fspath(tmp_path), "started")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=1, logs_specs=DefaultLogsSpecs(log_dir=path)
    )
    with pytest.raises(ConfigError, match="exists and is not a directory") as info:
        elastic_launch(config, sys.executable)("-c", f"open({marker!r}, 'w').close()")
    assert (info.value.field, info.value.value) == ("log_dir", path)
    assert not os.path.exists(marker)
