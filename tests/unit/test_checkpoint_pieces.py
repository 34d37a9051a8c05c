"""A rank's view of the pieces its node holds: its own in a copy, every rank's for
another world size (read through the union of their metadata), and the wait for the
buddy's copy after a save. One process, no process group."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from elastrun.checkpoint import CheckpointSpaceError, MemoryStorageReader, MemoryStorageWriter
from elastrun.checkpoint.worker.space import check_space
from elastrun.checkpoint.worker.steps import RankSteps
from elastrun.wire import checkpoint as layout

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save


def _save(directory: Path, step: int, rank: int, world: int, state: dict[str, Any]) -> None:
    writer = MemoryStorageWriter(str(directory), step, rank=rank, world_size=world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save(state, storage_writer=writer, no_dist=True)


def _load(directory: Path, step: int, rank: int, world: int, state: dict[str, Any]) -> None:
    reader = MemoryStorageReader(str(directory), step, rank=rank, world_size=world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_load(state, storage_reader=reader, no_dist=True)


def _move(directory: Path, step: int, rank: int, to: Path) -> None:
    """Move rank ``rank``'s piece of ``step`` into ``to`` (a copy's or gathered step
    directory), as an agent's copy would hold it."""
    to.mkdir(parents=True, exist_ok=True)
    src = directory / layout.step_dir_name(step)
    for name in (layout.data_name(rank), layout.meta_name(rank), layout.marker_name(rank)):
        (src / name).rename(to / name)


def test_a_rank_loads_its_own_piece_from_a_copy_of_its_lost_node(tmp_path: Path) -> None:
    _save(tmp_path, 4, 1, 2, {"w": torch.full((3,), 7.0)})
    copies = tmp_path / layout.COPIES_DIR / "b-1" / layout.step_dir_name(4)
    _move(tmp_path, 4, 1, copies)
    steps = RankSteps(str(tmp_path), 1, 2)
    assert steps.complete_steps() == []  # (none in its own steps)
    assert steps.loadable_steps() == [4]
    state = {"w": torch.zeros(3)}
    _load(tmp_path, 4, 1, 2, state)
    assert state["w"].tolist() == [7.0, 7.0, 7.0]


def test_another_world_size_loads_only_when_every_ranks_piece_is_here(tmp_path: Path) -> None:
    # Two ranks of a world of 2 each saved their half of "w", a value, and their own
    # tensor; one rank of a world of 1 reads both halves (DCP's planner over the union).
    for rank in (0, 1):
        _save(tmp_path, 9, rank, 2, {"w": torch.arange(4.0) + 10 * rank, f"only{rank}":
                                     torch.tensor([rank + 0.5]), "note": "hi"})  # fmt: skip
    gathered = tmp_path / layout.GATHERED_DIR / layout.step_dir_name(9)
    _move(tmp_path, 9, 1, gathered)
    alone = RankSteps(str(tmp_path), 0, 1)
    assert alone.loadable_steps() == [9]
    state: dict[str, Any] = {"w": torch.zeros(4), "only0": torch.zeros(1),
                             "only1": torch.zeros(1), "note": ""}  # fmt: skip
    _load(tmp_path, 9, 0, 1, state)
    assert state["only0"].tolist() == [0.5] and state["only1"].tolist() == [1.5]
    assert state["note"] == "hi"
    assert state["w"].tolist() == [
        0.0,
        1.0,
        2.0,
        3.0,
    ]  # (a chunk two ranks hold: the lowest rank's)
    for name in (layout.data_name(1), layout.meta_name(1), layout.marker_name(1)):
        (gathered / name).unlink()
    assert alone.loadable_steps() == []  # rank 1's piece is gone: nothing to reshard from


def test_a_save_waits_for_the_buddys_copy_when_the_agent_names_a_copier(tmp_path: Path) -> None:
    steps = RankSteps(str(tmp_path), 0, 1)
    _save(tmp_path, 3, 0, 1, {"w": torch.zeros(2)})  # (no buddy.json: nothing waited for)
    marker, data = Path(steps.marker_path(3)).stat(), Path(steps.data_path(3)).stat()
    version = layout.piece_version(marker, data)
    buddy = layout.Buddy(1, "node-b", "node-b")
    (tmp_path / layout.BUDDY_FILE).write_text(layout.encode_buddy(buddy))
    slept: list[float] = []

    def confirm(pause: float) -> None:
        slept.append(pause)
        if len(slept) == 2:  # a word about an earlier writing of the step: not this one
            (tmp_path / layout.copied_name(3)).write_text(json.dumps({"0": "old"}))
        if len(slept) == 4:
            (tmp_path / layout.copied_name(3)).write_text(json.dumps({"0": version}))

    assert steps.wait_copied(3, timeout=60, sleep=confirm)
    assert len(slept) == 4
    assert not steps.wait_copied(4, timeout=0, sleep=confirm)  # never copied: goes on
    alone = layout.Buddy(2, None, None)
    (tmp_path / layout.BUDDY_FILE).write_text(layout.encode_buddy(alone))
    assert steps.wait_copied(4, timeout=60, sleep=confirm)


def test_the_space_check_counts_a_buddys_copy_when_the_node_holds_one(tmp_path: Path) -> None:
    free = SimpleNamespace(f_bavail=3 << 20, f_frsize=1)  # 3 MiB free
    check_space(str(tmp_path), 1 << 20, rank=0, local_ranks=1, statvfs=lambda _p: free)
    buddy = layout.Buddy(1, "node-b", "node-b")
    (tmp_path / layout.BUDDY_FILE).write_text(layout.encode_buddy(buddy))
    copies = r"4 steps x 1 local rank.*; 2 of the steps a buddy node's copy"
    with pytest.raises(CheckpointSpaceError, match=copies):
        check_space(str(tmp_path), 1 << 20, rank=0, local_ranks=1, statvfs=lambda _p: free)


def test_a_step_saved_again_by_a_smaller_world_loads_from_its_own_pieces(tmp_path: Path) -> None:
    # Ranks 2 and 3 of a world of 4 left a copy of step 6; the 2 ranks left saved step 6
    # again: rank 0 of the 2 loads its own piece, and the copy does not get in the way.
    for rank in (2, 3):
        _save(tmp_path, 6, rank, 4, {"w": torch.full((2,), float(rank))})
        _move(tmp_path, 6, rank, tmp_path / layout.COPIES_DIR / "b-1" / layout.step_dir_name(6))
    _save(tmp_path, 6, 0, 2, {"w": torch.full((2,), 9.0)})
    needed = RankSteps(str(tmp_path), 0, 2).needed(6)
    assert needed is not None and list(needed) == [0]
    assert needed[0].marker.world_size == 2
    assert RankSteps(str(tmp_path), 1, 2).needed(6) is None  # (rank 1's piece is missing)
