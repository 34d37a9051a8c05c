"""The progress records in one process: layout, writer, board, and reads that are never torn."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.core.errors import ConfigError, ElastrunError
from elastrun.pace import FILE_NAME, ProgressBoard, read_record
from elastrun.pace.worker import report as wp
from elastrun.pace.worker.report import Reporter
from elastrun.wire.progress import (
    CHECK,
    MAX_STEP,
    PROGRESS_FILE_ENV,
    PROGRESS_SLOT_ENV,
    SEQ,
    SLOT_WORDS,
    STEP,
    ProgressFileError,
    record_check,
    slot_offset,
)


@pytest.fixture
def board(tmp_path: Path) -> Iterator[ProgressBoard]:
    with ProgressBoard.create(tmp_path, 3) as b:
        yield b


def _reporter(board: ProgressBoard, rank: int) -> Reporter:
    env = board.worker_env(rank)
    return Reporter.open(env[PROGRESS_FILE_ENV], int(env[PROGRESS_SLOT_ENV]))


def test_a_new_board_is_an_empty_file_with_two_records_per_rank(
    board: ProgressBoard, tmp_path: Path
) -> None:
    assert board.path == str(tmp_path / FILE_NAME)
    assert os.path.getsize(board.path) == (1 + 2 * 3) * SLOT_WORDS * 8
    assert os.stat(board.path).st_mode & 0o777 == 0o600
    assert board.snapshot() == {}
    assert board.worker_env(2) == {PROGRESS_FILE_ENV: board.path, PROGRESS_SLOT_ENV: "4"}


def test_reports_show_in_the_snapshot_with_step_times(board: ProgressBoard) -> None:
    reporter = _reporter(board, 1)
    try:
        reporter.report(None)
        (only,) = board.snapshot().items()
        assert only[0] == 1
        assert only[1].step == 1
        assert (only[1].step_time, only[1].longest, only[1].reports) == (None, None, 1)
        assert only[1].pid == os.getpid()
        reporter.report(None)
        reporter.report(10)  # eight steps at once: the step time is per step
        record = board.snapshot()[1]
        assert (record.step, record.reports) == (10, 3)
        assert record.step_time is not None and record.longest is not None
        assert 0 < record.step_time <= record.longest
        reporter.report(None)
        assert board.snapshot()[1].step == 11
        assert board.snapshot([0, 2]) == {}
    finally:
        reporter.close()


def test_reset_moves_a_rank_to_its_other_record_where_the_old_worker_cannot_write(
    board: ProgressBoard,
) -> None:
    old = _reporter(board, 0)
    try:
        old.report(5)
        assert board.snapshot()[0].step == 5
        board.reset(0)
        assert board.worker_env(0)[PROGRESS_SLOT_ENV] == "1"
        assert board.snapshot() == {}
        old.report(6)  # the replaced worker, still running: unseen
        assert board.snapshot() == {}
        new = _reporter(board, 0)
        new.report(None)
        assert board.snapshot()[0].step == 1
        new.close()
        board.reset(0)  # back to the first record, cleared
        assert board.worker_env(0)[PROGRESS_SLOT_ENV] == "0"
        assert board.snapshot() == {}
    finally:
        old.close()


def test_a_record_caught_mid_write_reads_as_the_last_consistent_copy(
    board: ProgressBoard,
) -> None:
    reporter = _reporter(board, 2)
    try:
        reporter.report(7)
        assert board.snapshot()[2].step == 7
        words = memoryview(reporter._map).cast("q")
        base = slot_offset(reporter.slot)
        words[base + SEQ] += 1  # a writer stopped half-way: odd sequence number
        words[base + STEP] = 8
        assert read_record(words, reporter.slot) is None
        assert board.snapshot()[2].step == 7
        words.release()
    finally:
        reporter.close()


def test_a_copy_mixing_two_versions_of_a_record_is_refused(board: ProgressBoard) -> None:
    reporter = _reporter(board, 0)
    try:
        reporter.report(1)
        reporter.report(2)
        words = memoryview(reporter._map).cast("q")
        base = slot_offset(reporter.slot)
        before = words[base : base + SLOT_WORDS].tolist()
        reporter.report(3)
        after = words[base : base + SLOT_WORDS].tolist()
        # What a reader may see where stores become visible out of order: the new
        # sequence number and check, one field still old.
        for index in range(1, CHECK):
            mixed = list(after)
            mixed[index] = before[index]
            if mixed == after:
                continue
            _store(words, base, mixed)
            assert read_record(words, reporter.slot) is None, index
        _store(words, base, after)
        assert read_record(words, reporter.slot) is not None
        words.release()
    finally:
        reporter.close()


def _store(words: memoryview, base: int, values: list[int]) -> None:
    for i, value in enumerate(values):
        words[base + i] = value


fields = st.tuples(*[st.integers(0, 2**62)] * 7)


@given(a=fields, b=fields, mask=st.integers(1, 2**7 - 2))
def test_the_check_word_tells_a_mix_of_two_records_from_either(
    a: tuple[int, ...], b: tuple[int, ...], mask: int
) -> None:
    mixed = tuple(x if mask >> i & 1 else y for i, (x, y) in enumerate(zip(a, b, strict=True)))
    if mixed in (a, b):
        return
    assert record_check(*mixed) not in (record_check(*a), record_check(*b))


def test_opening_a_file_that_is_not_a_progress_file_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 4096)
    with pytest.raises(ProgressFileError, match="is not a progress file"):
        Reporter.open(str(junk), 0)
    (tmp_path / "short").write_bytes(b"x")
    with pytest.raises(ProgressFileError, match="is not a progress file"):
        Reporter.open(str(tmp_path / "short"), 0)
    with pytest.raises(ProgressFileError, match="cannot open"):
        Reporter.open(str(tmp_path / "missing"), 0)


def test_a_record_beyond_the_file_is_refused(board: ProgressBoard) -> None:
    with pytest.raises(ProgressFileError, match="has no record 6"):
        Reporter.open(board.path, 6)


def test_close_removes_the_file_and_is_idempotent(tmp_path: Path) -> None:
    board = ProgressBoard.create(tmp_path, 1)
    board.close()
    board.close()
    assert board.closed
    assert not (tmp_path / FILE_NAME).exists()
    with pytest.raises(ElastrunError, match="closed"):
        board.snapshot()
    assert "closed" in repr(board)


def test_a_second_board_in_the_same_directory_is_refused(board: ProgressBoard) -> None:
    with pytest.raises(ElastrunError, match="cannot create the progress file"):
        ProgressBoard.create(os.path.dirname(board.path), 1)


@pytest.mark.parametrize("size", [0, -1, True])
def test_a_board_needs_at_least_one_rank(tmp_path: Path, size: int) -> None:
    with pytest.raises(ConfigError):
        ProgressBoard.create(tmp_path, size)


def test_unknown_local_ranks_are_refused(board: ProgressBoard) -> None:
    with pytest.raises(ConfigError, match="local_rank"):
        board.worker_env(3)


@pytest.mark.parametrize("step", [-1, MAX_STEP + 1, 1.0, "3", True, None.__class__])
def test_progress_refuses_a_step_that_is_not_a_small_non_negative_integer(step: object) -> None:
    # Checked the same with or without an agent, so a script behaves alike everywhere.
    with pytest.raises(ConfigError, match="step: must be an integer from 0"):
        wp.progress(step)  # type: ignore[arg-type]  # bad steps, refused at run time
