"""A rank's own part of a commit (``inprocess.worker.own``) and ``State(own=...)``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from elastrun.inprocess import State  # noqa: E402
from elastrun.inprocess.worker import own  # noqa: E402


@pytest.fixture
def node_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ELASTRUN_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.setenv("ELASTRUN_INPROCESS_SOCKET", str(tmp_path / "socket"))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("ELASTRUN_INPROCESS_ROUND", raising=False)
    return tmp_path


class Cursor:
    def __init__(self, pos: int) -> None:
        self.pos = pos

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


def test_a_record_is_read_back_only_for_its_commit(node_dir: Path) -> None:
    path = own.record_path()
    assert path == str(node_dir / "inprocess-own-3")
    own.write(path, own.OwnRecord(7, {"torch": b"x"}, b"items"))
    assert own.read(path, 7) == own.OwnRecord(7, {"torch": b"x"}, b"items")
    assert own.read(path, 6) is None
    assert os.listdir(node_dir) == ["inprocess-own-3"]  # nothing left beside it
    (node_dir / "inprocess-own-3").write_bytes(b"not a pickle")
    assert own.read(path, 7) is None
    assert own.read(str(node_dir / "missing"), 7) is None


def test_no_record_without_the_agents_offer(
    node_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ELASTRUN_INPROCESS_SOCKET")
    assert own.record_path() is None
    monkeypatch.setenv("ELASTRUN_INPROCESS_SOCKET", "s")
    monkeypatch.setenv("ELASTRUN_CHECKPOINT_DIR", str(node_dir / "gone"))
    assert own.record_path() is None


def test_every_commit_keeps_the_own_items_and_generators(node_dir: Path) -> None:
    cursor = Cursor(5)
    state = State(step=0, cursor=cursor, own=("cursor",))
    path = str(node_dir / "inprocess-own-3")
    assert own.read(path, 0) is not None  # an attempt's first worker: commit 0 at once
    cursor.pos = 9
    state.commit()
    record = own.read(path, 1)
    assert record is not None and record.rng is not None
    # A rollback puts an own item back from the commit's copy, not the live object.
    cursor.pos = 42
    state.rollback()
    assert cursor.pos == 9


def test_a_replacement_does_not_write_before_it_took_a_commit(
    node_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(node_dir / "inprocess-own-3")
    own.write(path, own.OwnRecord(4, None, b""))  # its predecessor's
    monkeypatch.setenv("ELASTRUN_INPROCESS_ROUND", "2")
    State(step=0, cursor=Cursor(0), own=("cursor",))
    record = own.read(path, 4)
    assert record is not None  # still the predecessor's


def test_own_names_an_item_that_is_not_given() -> None:
    with pytest.raises(ValueError, match="own names items that are not given: loader"):
        State(step=0, own=("loader",))
