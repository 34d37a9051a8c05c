"""Memory checkpoints persisted to disk, in one process (a world of one, no process
group): the arguments, which persisted steps are kept, the merge of the ranks' items,
and a persist read back by plain DCP, with the node directory in a temporary one."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from elastrun.checkpoint import MemoryCheckpoint, MemoryCheckpointError
from elastrun.checkpoint.worker.persist import (
    persist_settings,
    persisted_steps,
    steps_to_remove,
)
from elastrun.checkpoint.worker.persist_plan import merge_plans
from elastrun.core.errors import ConfigError
from elastrun.wire import checkpoint as layout

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load


@pytest.fixture(autouse=True)
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", layout.CHECKPOINT_DIR_ENV):
        monkeypatch.delenv(name, raising=False)


# -- the arguments -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"persist_dir": "d", "persist_every": 0}, "persist_every"),
        ({"persist_dir": "d", "persist_every": -3}, "persist_every"),
        ({"persist_dir": "d", "persist_every": True}, "persist_every"),
        ({"persist_dir": "d", "persist_every": 2.5}, "persist_every"),
        ({"persist_dir": "d", "persist_keep": 0}, "persist_keep"),
        ({"persist_dir": "d", "persist_keep": "2"}, "persist_keep"),
        ({"persist_every": 5}, "persist_every"),
        ({"persist_keep": 3}, "persist_keep"),
        ({"persist_dir": ""}, "persist_dir"),
    ],
)
def test_bad_persist_arguments_are_refused_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{field}: ") as info:
        MemoryCheckpoint("unused", **kwargs)
    assert info.value.field == field


def test_persist_settings_take_an_absolute_directory_and_default_to_keeping_two() -> None:
    assert persist_settings(None, None, 2) is None
    settings = persist_settings("relative/dir", None, 2)
    assert settings is not None
    assert settings.directory == os.path.abspath("relative/dir")
    assert (settings.every, settings.keep) == (None, 2)


def test_persist_without_a_directory_says_what_to_pass(tmp_path: Path) -> None:
    with (
        MemoryCheckpoint(str(tmp_path)) as ckpt,
        pytest.raises(MemoryCheckpointError, match=r"persist_dir=\.\.\."),
    ):
        ckpt.persist()


# -- which persisted steps stay ----------------------------------------------------------


@pytest.mark.parametrize(
    ("existing", "new", "keep", "removed"),
    [
        ([3, 6, 9], 9, 2, [3]),
        ([3, 6, 9], 9, 1, [3, 6]),
        ([3, 6, 9], 9, 5, []),
        ([9], 9, 1, []),
        ([], 4, 2, []),
        # a run that started again: the new step stays, with the newest other
        ([100, 110, 120], 10, 2, [100, 110]),
        ([6, 9, 12], 9, 2, [6]),  # the step persisted again replaced its old self
    ],
)
def test_the_newest_persisted_steps_are_kept_and_the_new_one_always(
    existing: list[int], new: int, keep: int, removed: list[int]
) -> None:
    assert steps_to_remove(existing, new, keep) == removed


def test_only_directories_under_a_final_name_count_as_persisted(tmp_path: Path) -> None:
    for name in ("step-3", "step-12", ".step-15.tmp-00ab", ".step-9.old-00cd", "stepx", "notes"):
        (tmp_path / name).mkdir()
    assert persisted_steps(str(tmp_path)) == [3, 12]
    assert persisted_steps(str(tmp_path / "missing")) == []


# -- merging the ranks' items ------------------------------------------------------------


def _piece(fqn: str, size: list[int], offsets: list[int], sizes: list[int]) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    whole = sizes == size
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=chunk,
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(size),
        ),
    )


def _value(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def test_replicated_pieces_are_written_once_spread_over_the_ranks() -> None:
    # Four replicated tensors on two ranks (DDP), and a value on both.
    items = [_piece(f"w{i}", [10 * (i + 1)], [0], [10 * (i + 1)]) for i in range(4)]
    plans = [SavePlan([*items, _value("step")]), SavePlan([*items, _value("step")])]
    merged, metadata = merge_plans(plans)
    kept = [sorted(i.index.fqn for i in p.items) for p in merged]
    assert sorted(kept[0] + kept[1]) == ["step", "w0", "w1", "w2", "w3"]
    assert "step" in kept[0]  # a value on the lowest rank that holds it
    assert kept == [["step", "w0", "w3"], ["w1", "w2"]]  # 40+10 elements against 30+20
    entry = metadata.state_dict_metadata["w3"]
    assert isinstance(entry, TensorStorageMetadata) and len(entry.chunks) == 1


def test_shards_are_merged_into_one_tensor_with_every_piece_indexed() -> None:
    plans = [
        SavePlan([_piece("w", [4, 6], [0, 0], [2, 6])], planner_data={"w": ("m", "w")}),
        SavePlan([_piece("w", [4, 6], [2, 0], [2, 6])], planner_data={"w": ("m", "w")}),
    ]
    merged, metadata = merge_plans(plans)
    entry = metadata.state_dict_metadata["w"]
    assert isinstance(entry, TensorStorageMetadata)
    assert [list(c.offsets) for c in entry.chunks] == [[0, 0], [2, 0]]
    assert [[i.index.index for i in p.items] for p in merged] == [[0], [1]]
    assert metadata.planner_data == {"w": ("m", "w")}


def test_a_tensor_whose_pieces_do_not_cover_it_is_refused_naming_it() -> None:
    plans = [SavePlan([_piece("w", [4, 6], [0, 0], [2, 6])]), SavePlan([])]
    with pytest.raises(MemoryCheckpointError, match=r"w: the ranks' pieces hold 12 of its 24"):
        merge_plans(plans)


def test_ranks_that_disagree_on_an_item_are_refused() -> None:
    with pytest.raises(MemoryCheckpointError, match="a value on one rank, a tensor on another"):
        merge_plans([SavePlan([_value("x")]), SavePlan([_piece("x", [2], [0], [2])])])
    with pytest.raises(MemoryCheckpointError, match=r"x: torch.float32 \[2\] on one rank"):
        merge_plans(
            [SavePlan([_piece("x", [2], [0], [2])]), SavePlan([_piece("x", [3], [0], [3])])]
        )


# -- a world of one, end to end ----------------------------------------------------------


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _state(model: torch.nn.Module, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "extra": {"step": step}}


def _train(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)


def _load_plain(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state = {"model": _model(99).state_dict(), "extra": {"step": -1}}
    dcp_load(state, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return state["model"], state["extra"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_steps_persisted_every_n_are_read_back_by_plain_dcp_and_the_oldest_removed(
    tmp_path: Path,
) -> None:
    node, out = tmp_path / "node", tmp_path / "out"
    node.mkdir()
    model = _model(1)
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with MemoryCheckpoint(str(node), persist_dir=out, persist_every=2, persist_keep=2) as ckpt:
        for step in range(8):
            _train(model)
            ckpt.save(step, _state(model, step))
            ckpt.wait()  # (each save finished: every second one is persisted, none deferred)
            expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.wait()
        assert ckpt.persisted == 7
    assert sorted(os.listdir(out)) == ["step-5", "step-7"]
    for step in (5, 7):
        weights, extra = _load_plain(out / f"step-{step}")
        assert extra == {"step": step}
        for name, value in expected[step].items():
            assert torch.equal(weights[name], value), (step, name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_persist_is_due_after_every_n_complete_steps_counted_from_the_last(
    tmp_path: Path,
) -> None:
    model = _model(3)
    for every, expected in ((3, [None, None, 2, 2, 2, 5, 5]), (None, [None] * 7)):
        node = tmp_path / f"node-{every}"
        node.mkdir()
        seen = []
        with MemoryCheckpoint(str(node), persist_dir=tmp_path / "out", persist_every=every) as ckpt:
            for step in range(7):
                ckpt.save(step, _state(model, step))
                ckpt.wait()  # (each save finished: a persist due is begun, then written)
                seen.append(ckpt.persisted)
        assert seen == expected


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_persist_on_request_writes_the_newest_step_and_a_leftover_is_removed(
    tmp_path: Path,
) -> None:
    node, out = tmp_path / "node", tmp_path / "out"
    node.mkdir()
    leftover = out / ".step-1.tmp-00000000deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"half")
    model = _model(2)
    with MemoryCheckpoint(str(node), persist_dir=out) as ckpt:
        for step in range(3):
            _train(model)
            ckpt.save(step, _state(model, step))
        ckpt.persist()
        ckpt.persist()  # nothing new since: said, not written again
        ckpt.wait()
        assert ckpt.persisted == 2
    assert sorted(os.listdir(out)) == ["step-2"]
    weights, _extra = _load_plain(out / "step-2")
    for name, value in model.state_dict().items():
        assert torch.equal(weights[name], value)


def test_a_persist_that_fails_is_logged_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = tmp_path / "node"
    node.mkdir()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model = _model(3)
    with (
        caplog.at_level(logging.ERROR, logger="elastrun.checkpoint"),
        MemoryCheckpoint(str(node), persist_dir=blocker / "out", persist_every=1) as ckpt,
    ):
        for step in range(3):
            _train(model)
            assert ckpt.save(step, _state(model, step))
            assert ckpt.wait() == step
        assert ckpt.persisted is None
    failures = [r.getMessage() for r in caplog.records if "persisting step" in r.getMessage()]
    assert failures and "failed" in failures[0], caplog.text
    assert sorted(os.listdir(tmp_path)) == ["a-file", "node"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_step_persisted_again_replaces_the_old_one_whole(tmp_path: Path) -> None:
    # A later run that went back to step 1 (say, from an older checkpoint) persists it
    # anew: the new step takes the name, the old one goes, nothing is left aside.
    out = tmp_path / "out"
    models = []
    for run in range(2):
        node = tmp_path / f"node-{run}"
        node.mkdir()
        model = _model(10 + run)
        with MemoryCheckpoint(str(node), persist_dir=out) as ckpt:
            ckpt.save(1, _state(model, 1))
            ckpt.persist()
        models.append(model)
    assert sorted(os.listdir(out)) == ["step-1"]
    weights, _extra = _load_plain(out / "step-1")
    for name, value in models[1].state_dict().items():
        assert torch.equal(weights[name], value)
