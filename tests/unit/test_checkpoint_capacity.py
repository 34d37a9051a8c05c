"""``--dry-run`` states what the node's shared memory can hold of memory checkpoints:
the rule (two steps of each rank's state) and the state per rank the space free now
leaves room for. The file system's figures come from a fake ``statvfs``."""

from __future__ import annotations

import os
from pathlib import Path

from elastrun.checkpoint.agent.capacity import capacity_lines
from elastrun.launch.cli import parse_launch
from elastrun.launch.dryrun import render_plan
from elastrun.launch.main import command_of


def _statvfs(free: int, total: int) -> os.statvfs_result:
    block = 4096
    return os.statvfs_result((block, block, total // block, free // block, free // block,
                              1000, 1000, 1000, 0, 255))  # fmt: skip


def test_the_state_per_rank_that_fits_is_the_free_space_over_two_steps_per_local_rank() -> None:
    lines = capacity_lines(4, base="/shm", statvfs=lambda _p: _statvfs(16 << 30, 32 << 30))
    assert len(lines) == 2
    assert lines[0].startswith("in /shm when the script uses elastrun.checkpoint: 2 steps")
    assert "newest complete, one in progress" in lines[0]
    assert lines[1] == (
        "16.00 GiB free of 32.00 GiB now for 4 local rank(s): up to 2.00 GiB of state per "
        "rank (checked before training)"
    )


def test_a_container_sized_shared_memory_is_stated_in_mebibytes() -> None:
    lines = capacity_lines(1, base="/shm", statvfs=lambda _p: _statvfs(64 << 20, 64 << 20))
    assert "64.0 MiB free of 64.0 MiB now for 1 local rank(s): up to 32.0 MiB" in lines[1]


def test_without_shared_memory_one_line_says_that_workers_get_no_directory() -> None:
    def missing(path: str) -> os.statvfs_result:
        raise FileNotFoundError(2, "No such file or directory", path)

    (line,) = capacity_lines(2, base="/nowhere", statvfs=missing)
    assert line == (
        "none: /nowhere cannot be read here (No such file or directory), so workers get no "
        "node directory"
    )


def test_the_dry_run_plan_shows_the_checkpoints_lines(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    launch = parse_launch(["--nproc-per-node", "3", "--dry-run", str(script)], {})
    entry, args = command_of(launch)
    shown = render_plan(launch, entry, args, {}).splitlines()
    (at,) = [i for i, line in enumerate(shown) if line.startswith("  checkpoints : ")]
    if shown[at].startswith("  checkpoints : none:"):
        return  # (no /dev/shm on this machine: the one line says so)
    assert "for 3 local rank(s)" in shown[at + 1]
    assert shown[at + 1].startswith(" " * 16)


def test_a_job_of_several_nodes_leaves_room_for_a_buddys_copy() -> None:
    lines = capacity_lines(4, nodes=2, base="/shm", statvfs=lambda _p: _statvfs(16 << 30, 32 << 30))
    assert (
        "and 2 of each of its buddy node's ranks (a copy: the newest, one arriving)" in (lines[0])
    )
    assert lines[1].endswith("up to 1.00 GiB of state per rank (checked before training)")
