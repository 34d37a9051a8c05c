"""Memory checkpoints in one process (a world of 1, no process group): DCP's save and
load through elastrun's storage layer, what counts as complete, how many steps a rank
keeps, and the size check, with the node directory in a temporary directory."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from elastrun.checkpoint import (
    CheckpointSpaceError,
    MemoryCheckpoint,
    MemoryCheckpointError,
    MemoryStorageReader,
    MemoryStorageWriter,
)
from elastrun.checkpoint.worker import memory
from elastrun.checkpoint.worker.staging import Staging
from elastrun.checkpoint.worker.steps import RankSteps
from elastrun.wire import checkpoint as layout

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save


@pytest.fixture(autouse=True)
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", layout.CHECKPOINT_DIR_ENV):
        monkeypatch.delenv(name, raising=False)


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return model, opt


def _state(seed: int, step: int) -> dict[str, Any]:
    model, opt = _model_and_optimizer(seed)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {"step": step, "note": f"seed {seed}"},
        # a transposed view (not contiguous) and a dtype numpy has no name for
        "odd": (torch.arange(12, dtype=torch.bfloat16) + seed).reshape(3, 4).t(),
        "scalar": torch.tensor(float(seed)),
    }


def _blank_state() -> dict[str, Any]:
    state = _state(99, -1)
    state["odd"] = torch.zeros(4, 3, dtype=torch.bfloat16)
    return state


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _save(directory: Path, step: int, state: dict[str, Any], **kw: Any) -> MemoryStorageWriter:
    writer = MemoryStorageWriter(str(directory), step, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's "assuming one process"
        dcp_save(state, storage_writer=writer, no_dist=True)
    return writer


def _load(directory: Path, step: int, state: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(state, storage_reader=MemoryStorageReader(str(directory), step), no_dist=True)


def _steps_on_disk(directory: Path) -> list[int]:
    return sorted(s for p in directory.iterdir() if (s := layout.step_of_dir(p.name)) is not None)


# -- the storage layer -------------------------------------------------------------------


def test_a_state_dict_round_trips_through_dcp_in_memory(tmp_path: Path) -> None:
    saved = _state(1, 7)
    _save(tmp_path, 7, saved)
    step_dir = tmp_path / layout.step_dir_name(7)
    assert sorted(os.listdir(step_dir)) == ["rank-0.data", "rank-0.done", "rank-0.meta.json"]
    loaded = _blank_state()
    _load(tmp_path, 7, loaded)
    _assert_same(saved, loaded)


def test_a_model_and_its_optimizer_come_back_exactly_through_their_state_dicts(
    tmp_path: Path,
) -> None:
    model, opt = _model_and_optimizer(1)
    _save(tmp_path, 0, {"model": model.state_dict(), "optim": opt.state_dict()})
    model2, opt2 = _model_and_optimizer(2)
    state = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    _load(tmp_path, 0, state)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    _assert_same(model.state_dict(), model2.state_dict())
    _assert_same(opt.state_dict(), opt2.state_dict())


def test_a_step_without_its_marker_is_never_read(tmp_path: Path) -> None:
    _save(tmp_path, 3, _state(1, 3), publish_on_finish=False)  # died before the marker
    assert (tmp_path / layout.step_dir_name(3) / "rank-0.data").exists()
    with pytest.raises(MemoryCheckpointError, match="step 3 of rank 0 is not complete"):
        MemoryStorageReader(str(tmp_path), 3).read_metadata()
    assert RankSteps(str(tmp_path), 0, 1).complete_steps() == []


def test_a_step_whose_files_disagree_with_its_marker_is_not_complete(tmp_path: Path) -> None:
    _save(tmp_path, 4, _state(1, 4))
    steps = RankSteps(str(tmp_path), 0, 1)
    assert steps.complete_steps() == [4]
    with open(steps.data_path(4), "r+b") as fh:
        fh.truncate(16)
    assert steps.complete_steps() == []
    assert RankSteps(str(tmp_path), 0, 2).complete_steps() == []  # another world size


def test_a_collective_save_is_refused_with_what_to_do(tmp_path: Path) -> None:
    writer = MemoryStorageWriter(str(tmp_path), 0)
    with pytest.raises(MemoryCheckpointError, match="no_dist=True"):
        writer.set_up_storage_writer(False)
    with pytest.raises(MemoryCheckpointError, match="no_dist=True"):
        writer.prepare_global_plan([SavePlan([]), SavePlan([])])


# -- MemoryCheckpoint --------------------------------------------------------------------


def test_the_newest_step_is_loaded_after_a_restart(tmp_path: Path) -> None:
    with MemoryCheckpoint(str(tmp_path)) as ckpt:
        assert ckpt.load_latest(_blank_state()) is None
        for step in range(5):
            assert ckpt.save(step, _state(step, step))
        assert ckpt.wait() == 4
    loaded = _blank_state()
    with MemoryCheckpoint(str(tmp_path)) as again:  # the restarted worker
        assert again.load_latest(loaded) == 4
    _assert_same(_state(4, 4), loaded)
    assert loaded["extra"]["step"] == 4


def test_a_half_written_step_is_never_loaded_and_is_removed(tmp_path: Path) -> None:
    with MemoryCheckpoint(str(tmp_path)) as ckpt:
        ckpt.save(1, _state(1, 1))
        ckpt.save(2, _state(2, 2))
    _save(tmp_path, 3, _state(3, 3), publish_on_finish=False)  # its writer died
    loaded = _blank_state()
    with MemoryCheckpoint(str(tmp_path)) as again:
        assert again.load_latest(loaded) == 2
    _assert_same(_state(2, 2), loaded)
    assert _steps_on_disk(tmp_path) == [2]


def test_a_rank_holds_at_most_the_newest_step_and_the_one_in_progress(tmp_path: Path) -> None:
    seen: list[list[int]] = []
    with MemoryCheckpoint(str(tmp_path), before_marker=lambda _s: seen.append(
        _steps_on_disk(tmp_path))) as ckpt:  # fmt: skip
        ckpt.load_latest(_blank_state())
        for step in range(6):
            ckpt.save(step, _state(step, step))
            ckpt.wait()
            assert _steps_on_disk(tmp_path) == [step]
    # At each marker: the step being published, and the one before it.
    assert seen == [[0], [0, 1], [1, 2], [2, 3], [3, 4], [4, 5]]


def test_a_step_writes_over_the_data_file_of_the_step_it_replaced(tmp_path: Path) -> None:
    # Its memory is allocated already: a new file's pages cost a quarter of a save.
    steps = RankSteps(str(tmp_path), 0, 1)
    with MemoryCheckpoint(str(tmp_path)) as ckpt:
        ckpt.save(0, _state(0, 0))
        ckpt.save(1, _state(1, 1))
        ckpt.wait()
        spare = os.stat(steps.spare_path)
        assert spare.st_size == os.stat(steps.data_path(1)).st_size
        ckpt.save(2, {"small": torch.ones(3)})  # a smaller state: the file shrinks
        ckpt.wait()
        reused = os.stat(steps.data_path(2))
        assert reused.st_ino == spare.st_ino and reused.st_size < spare.st_size
        assert steps.complete_steps() == [2]
    assert not os.path.exists(steps.spare_path)  # freed at close: no next step
    loaded = {"small": torch.zeros(3)}
    with MemoryCheckpoint(str(tmp_path)) as again:
        assert again.load_latest(loaded) == 2
    assert torch.equal(loaded["small"], torch.ones(3))


# -- staging: tensors on a GPU (a host buffer here stands in for the pinned one) ------


def _host_staging() -> Staging:
    return Staging(lambda n: torch.zeros(n, dtype=torch.uint8), host_too=True)


def test_staged_tensors_reach_the_data_file_when_the_step_is_published(tmp_path: Path) -> None:
    # The training thread copies into the buffer; the file gets the bytes with the
    # marker's thread, before the metadata: a step is never complete without them.
    saved = {**_state(3, 4), "mark": torch.full((64,), ord("Z"), dtype=torch.uint8)}
    staging = _host_staging()
    writer = _save(tmp_path, 4, saved, publish_on_finish=False, staging=staging)
    data = tmp_path / layout.step_dir_name(4) / "rank-0.data"
    assert staging.held == writer.data_bytes == data.stat().st_size
    assert b"Z" * 64 not in data.read_bytes()  # (DCP's values are in: they are not staged)
    with pytest.raises(MemoryCheckpointError, match="not complete"):
        MemoryStorageReader(str(tmp_path), 4).read_metadata()
    writer.publish()
    assert b"Z" * 64 in data.read_bytes()
    loaded = {**_blank_state(), "mark": torch.zeros(64, dtype=torch.uint8)}
    _load(tmp_path, 4, loaded)
    _assert_same(saved, loaded)


def test_a_checkpoint_stages_every_save_and_its_load_through_one_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        made.append(n)
        return torch.zeros(n, dtype=torch.uint8)

    monkeypatch.setattr(memory, "Staging", lambda: Staging(allocate, host_too=True))
    with MemoryCheckpoint(str(tmp_path)) as ckpt:
        for step in range(4):
            ckpt.save(step, _state(step, step))
        assert ckpt.wait() == 3
    assert len(made) == 1  # the same size every step: made once, then reused
    loaded = _blank_state()
    with MemoryCheckpoint(str(tmp_path)) as again:
        assert again.load_latest(loaded) == 3
    assert len(made) == 2  # the load read through a buffer of its own checkpoint's
    _assert_same(_state(3, 3), loaded)


def test_a_save_that_overlaps_the_previous_one_is_skipped_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    release = threading.Event()
    with MemoryCheckpoint(
        str(tmp_path), on_overlap="skip", before_marker=lambda _s: release.wait(10)
    ) as ckpt:
        assert ckpt.save(0, _state(0, 0))
        with caplog.at_level(logging.WARNING, "elastrun.checkpoint"):
            assert not ckpt.save(1, _state(1, 1))
        assert "step 1 skipped" in caplog.text
        release.set()
        assert ckpt.wait() == 0
        assert ckpt.save(2, _state(2, 2))
        assert ckpt.wait() == 2
    assert _steps_on_disk(tmp_path) == [2]


def test_a_save_that_overlaps_the_previous_one_waits_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    release = threading.Event()
    timer = threading.Timer(0.5, release.set)
    first, second = _state(0, 0), _state(1, 1)
    with MemoryCheckpoint(str(tmp_path), before_marker=lambda _s: release.wait(10)) as ckpt:
        ckpt.save(0, first)
        timer.start()
        with caplog.at_level(logging.WARNING, "elastrun.checkpoint"):
            assert ckpt.save(1, second)
        timer.join()
        assert "step 1 waited" in caplog.text
        assert ckpt.newest == 0
        assert ckpt.wait() == 1


def test_each_save_and_load_is_in_the_ranks_report_for_the_agent(tmp_path: Path) -> None:
    release = threading.Event()
    with MemoryCheckpoint(
        str(tmp_path), on_overlap="skip", before_marker=lambda _s: release.wait(10)
    ) as ckpt:
        assert ckpt.load_latest(_blank_state()) is None
        ckpt.save(0, _state(0, 0))
        assert not ckpt.save(1, _state(1, 1))  # skipped: counted, not complete
        release.set()
        assert ckpt.wait() == 0
        assert ckpt.save(2, _state(2, 2))
        ckpt.wait()
    report = layout.decode_report((tmp_path / layout.report_name(0)).read_bytes())
    assert (report.rank, report.pid) == (0, os.getpid())
    assert (report.saves, report.complete, report.newest) == (3, 2, 2)
    assert (report.loads, report.restored) == (1, None)
    # Blocked <= written <= agreed, save by save, so in the totals too.
    assert report.blocked_s > 0 and report.save_s <= report.lag_s
    with MemoryCheckpoint(str(tmp_path)) as again:  # the restarted worker
        assert again.load_latest(_blank_state()) == 2
    report = layout.decode_report((tmp_path / layout.report_name(0)).read_bytes())
    assert (report.saves, report.loads, report.restored) == (0, 1, 2)
    assert report.restore_s > 0


def test_steps_must_grow(tmp_path: Path) -> None:
    with MemoryCheckpoint(str(tmp_path)) as ckpt:
        ckpt.save(3, _state(3, 3))
        with pytest.raises(MemoryCheckpointError, match="step 3 comes after step 3"):
            ckpt.save(3, _state(3, 3))


def test_without_a_node_directory_the_error_says_where_it_comes_from() -> None:
    with pytest.raises(MemoryCheckpointError, match="ELASTRUN_CHECKPOINT_DIR is unset"):
        MemoryCheckpoint().save(0, {"x": torch.zeros(1)})


def test_the_directory_comes_from_the_agents_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(layout.CHECKPOINT_DIR_ENV, str(tmp_path))
    with MemoryCheckpoint() as ckpt:
        ckpt.save(0, {"x": torch.ones(3)})
    assert _steps_on_disk(tmp_path) == [0]


# -- the size check ----------------------------------------------------------------------


def _free(nbytes: int) -> Any:
    return lambda _path: SimpleNamespace(f_bavail=nbytes // 4096, f_frsize=4096)


def test_too_little_shared_memory_is_refused_before_training_with_the_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    state = {"w": torch.zeros(1 << 18)}  # 1 MiB
    ckpt = MemoryCheckpoint(str(tmp_path), statvfs=_free(4 << 20))
    with pytest.raises(CheckpointSpaceError) as caught:
        ckpt.load_latest(state)
    ckpt.close()
    message = str(caught.value)
    assert "need 8.0 MiB of shared memory" in message
    assert "2 steps x 4 local rank(s) x 1.0 MiB" in message
    assert "4.0 MiB free" in message and "\n" not in message
    assert caught.value.needed == 8 << 20


def test_too_little_shared_memory_is_refused_at_the_first_save_before_a_byte_is_written(
    tmp_path: Path,
) -> None:
    ckpt = MemoryCheckpoint(str(tmp_path), statvfs=_free(1 << 20))
    with pytest.raises(CheckpointSpaceError, match=r"need 2\.0 MiB"):
        ckpt.save(0, {"w": torch.zeros(1 << 18)})
    ckpt.close()
    assert _steps_on_disk(tmp_path) == []


def test_enough_shared_memory_passes_the_check(tmp_path: Path) -> None:
    with MemoryCheckpoint(str(tmp_path), statvfs=_free(2 << 20)) as ckpt:
        assert ckpt.load_latest({"w": torch.zeros(1 << 18)}) is None
        assert ckpt.save(0, {"w": torch.zeros(1 << 18)})
