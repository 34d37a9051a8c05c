"""The agent's side of memory checkpoints: the node's directory, made once and named to
every worker, removed with what it holds; no torch."""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from pathlib import Path

import pytest

from elastrun.checkpoint.agent.node_dir import LOCK_FILE, NodeCheckpointDir, remove_left_behind
from elastrun.wire.checkpoint import CHECKPOINT_DIR_ENV, DIR_PREFIX


def test_the_directory_is_made_once_private_and_named_after_the_run(tmp_path: Path) -> None:
    node = NodeCheckpointDir(str(tmp_path))
    assert os.listdir(tmp_path) == []  # nothing is made before it is opened
    given = node.open("job/1 a")
    path = given[CHECKPOINT_DIR_ENV]
    assert node.path == path and os.path.dirname(path) == str(tmp_path)
    assert os.path.basename(path).startswith(f"{DIR_PREFIX}job_1_a-")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert node.open("job/1 a") == given  # every attempt's workers get the same one
    node.close()


def test_the_orphan_guard_is_told_the_directory_once_it_is_made(tmp_path: Path) -> None:
    told: list[str] = []
    node = NodeCheckpointDir(str(tmp_path), on_made=told.append)
    path = node.open("r")[CHECKPOINT_DIR_ENV]
    node.open("r")
    assert told == [path]
    node.close()


def test_closing_removes_the_directory_with_every_checkpoint_in_it(tmp_path: Path) -> None:
    node = NodeCheckpointDir(str(tmp_path))
    path = Path(node.open("r")[CHECKPOINT_DIR_ENV])
    (path / "step-000000000001").mkdir()
    (path / "step-000000000001" / "rank-0.data").write_bytes(b"x" * 100)
    node.close()
    assert not path.exists() and node.path is None
    node.close()  # idempotent
    assert node.open("r") == {}  # a closed directory is not made again


def test_a_base_that_cannot_hold_it_gives_workers_no_variable_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = NodeCheckpointDir(str(tmp_path / "missing"))
    with caplog.at_level(logging.WARNING, "elastrun.agent"):
        assert node.open("r") == {}
        assert node.open("r") == {}
    assert caplog.text.count("no memory checkpoints on this node") == 1
    node.close()


def test_the_worker_template_serves_workers_whatever_their_node_directory() -> None:
    # The launcher starts the template before the agent makes the directory.
    from elastrun.template.agent.key import TemplateKey
    from elastrun.template.agent.preload import BootstrapCommand

    cmd = BootstrapCommand(options=("-u",), args=("train.py",))
    before = TemplateKey.of(cmd, {"HOME": "/h"}, ())
    after = TemplateKey.of(cmd, {"HOME": "/h", CHECKPOINT_DIR_ENV: "/dev/shm/x"}, ())
    assert before == after


def test_a_directory_whose_agent_died_with_its_guard_goes_when_another_agent_opens_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    live = NodeCheckpointDir(str(tmp_path))
    live_path = Path(live.open("live")[CHECKPOINT_DIR_ENV])
    assert (live_path / LOCK_FILE).exists()
    # An agent killed with its guard: its directory and (unlocked) lock file stay.
    dead = tmp_path / f"{DIR_PREFIX}dead-x"
    (dead / "step-000000000001").mkdir(parents=True)
    (dead / LOCK_FILE).write_bytes(b"")
    # A directory with no lock file: an older elastrun's agent, or one being made.
    older = tmp_path / f"{DIR_PREFIX}older-y"
    older.mkdir()
    # Somebody else's lock held: its agent lives (flock: per open file, even here).
    held = tmp_path / f"{DIR_PREFIX}held-z"
    held.mkdir()
    fd = os.open(held / LOCK_FILE, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with caplog.at_level(logging.INFO, "elastrun.agent"):
            other = NodeCheckpointDir(str(tmp_path))
            other.open("other")
        assert not dead.exists()
        assert older.is_dir() and held.is_dir() and live_path.is_dir()
        assert f"removed {dead}, left behind by an agent that died" in caplog.text
        assert remove_left_behind(str(tmp_path)) == []  # (the live ones stay)
        other.close()
        live.close()
    finally:
        os.close(fd)
    assert remove_left_behind(str(tmp_path)) == [str(held)]  # (its holder is gone now)
    assert sorted(os.listdir(tmp_path)) == [older.name]
