"""The node's memory checkpoint directory, end to end: the agent makes it before its
first workers start, every attempt's workers get the same one (what a worker leaves
there, its restarted successor finds), and it goes when the run ends, however it ends.
Shell workers: no torch."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from _helpers import finish, start, wait_for

WORKER = """
echo "$ELASTRUN_CHECKPOINT_DIR" > "$OUT/dir_$TORCHELASTIC_RESTART_COUNT"
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
    echo left by attempt 0 > "$ELASTRUN_CHECKPOINT_DIR/note"
    [ "$MODE" = hang ] && exec sleep 60
    exit 1
fi
cat "$ELASTRUN_CHECKPOINT_DIR/note" > "$OUT/found"
"""


def _launch(tmp_path: Path, mode: str, restarts: int) -> tuple[Path, subprocess.Popen[str]]:
    out = tmp_path / "out"
    out.mkdir()
    proc = start(
        ["--standalone", "--nproc-per-node", "1", "--max-restarts", str(restarts),
         "--no-python", "/bin/sh", "-c", WORKER],
        cwd=tmp_path, env={"OUT": str(out), "MODE": mode},
    )  # fmt: skip
    return out, proc


def test_a_restarted_worker_finds_its_predecessors_files_and_the_directory_ends_with_the_run(
    tmp_path: Path,
) -> None:
    out, proc = _launch(tmp_path, "fail", restarts=1)
    res = finish(proc)
    assert res.returncode == 0, res.stderr
    first, second = (out / "dir_0").read_text(), (out / "dir_1").read_text()
    assert first == second and first.startswith("/dev/shm/elastrun-ckpt-")
    assert (out / "found").read_text() == "left by attempt 0\n"
    assert not os.path.exists(first.strip())


def test_the_directory_is_removed_when_the_run_fails(tmp_path: Path) -> None:
    out, proc = _launch(tmp_path, "fail", restarts=0)
    res = finish(proc)
    assert res.returncode == 1, res.stderr
    assert not os.path.exists((out / "dir_0").read_text().strip())


def test_the_directory_is_removed_when_a_signal_ends_the_run(tmp_path: Path) -> None:
    out, proc = _launch(tmp_path, "hang", restarts=0)

    def noted() -> bool:
        named = out / "dir_0"
        return named.exists() and os.path.exists(os.path.join(named.read_text().strip(), "note"))

    wait_for(noted, 30, "the worker's note")
    proc.send_signal(signal.SIGTERM)
    res = finish(proc)
    assert res.returncode != 0
    assert not os.path.exists((out / "dir_0").read_text().strip())


def test_the_directory_is_removed_when_the_launcher_is_killed(tmp_path: Path) -> None:
    out, proc = _launch(tmp_path, "hang", restarts=0)
    wait_for((out / "dir_0").exists, 30, "the worker's start")
    path = (out / "dir_0").read_text().strip()
    os.kill(proc.pid, signal.SIGKILL)  # no teardown: the orphan guard removes it
    proc.communicate(timeout=10)
    wait_for(lambda: not os.path.exists(path), 10, "the directory's removal")
