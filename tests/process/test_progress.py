"""Progress reports from real workers: the bootstrap's optimizer hook, elastrun.progress(),
workers forked from a template, and reads that are never torn while a worker writes.

The agent's end is a ``ProgressBoard`` in the test process; workers are started as the
agent starts them (``python -u -m elastrun.worker.bootstrap`` with the board's
variables, or forked from a ``TemplateStarter``). A record outlives its writer, so most
tests read it after the worker exited.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrun.pace import ProgressBoard, ProgressRecord
from elastrun.supervise.processes.spawn import ProcessSpec, ProcessStarter
from elastrun.template.agent.starter import TemplateStarter
from elastrun.wire.progress import PROGRESS_FILE_ENV, REPORTS, SLOT_WORDS, STEP, slot_offset

PY = sys.executable
BOOT = [PY, "-u", "-m", "elastrun.worker.bootstrap"]
TIMEOUT = 60.0

# A stand-in for torch with just what the hook needs, so the import hook's paths are
# tested in milliseconds; the real torch has tests of its own below.
FAKE_TORCH = {
    "torch/__init__.py": "from torch import optim\n",
    "torch/optim/__init__.py": "from torch.optim.optimizer import Optimizer\n",
    "torch/optim/optimizer.py": """\
        _post_hooks = []
        def register_optimizer_step_post_hook(hook):
            _post_hooks.append(hook)
        class Optimizer:
            def step(self):
                for hook in _post_hooks:
                    hook(self, (), {})
        """,
}

# What the worker saw: whether the import hook was waiting for torch when the script
# started, and whether the variables were left for its children.
REPORT = """\
import json, os, subprocess, sys
watching = any(type(f).__name__ == "_OptimizerImportWatcher" for f in sys.meta_path)
def report(**extra):
    code = "import os; print(sorted(k for k in os.environ if 'PROGRESS' in k))"
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    print(json.dumps({
        "watching": watching,
        "env": sorted(k for k in os.environ if k.startswith("ELASTRUN_PROGRESS")),
        "child_env": child,
        "pid": os.getpid(),
        "torch": "torch" in sys.modules,
        **extra,
    }))
"""


def _write(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture
def board(tmp_path: Path) -> Iterator[ProgressBoard]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with ProgressBoard.create(run_dir, 2) as b:
        yield b


@pytest.fixture
def fake_torch(tmp_path: Path) -> str:
    for name, body in FAKE_TORCH.items():
        _write(tmp_path / "fake" / name, body)
    return str(tmp_path / "fake")


def _env(board: ProgressBoard | None, rank: int = 0, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "PROGRESS" not in k}
    env["OMP_NUM_THREADS"] = "1"  # as the launcher sets it
    if board is not None:
        env.update(board.worker_env(rank))
    env.update(extra)
    return env


def _run(
    argv: list[str], env: dict[str, str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


def _output(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert result.returncode == 0, result.stderr
    data: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return data


def _forked(
    starter: ProcessStarter, tmp: Path, argv: list[str], env: dict[str, str], tag: str
) -> tuple[int, str, str, int]:
    """Start a worker through ``starter``; (exit code, stdout, stderr, pid) once it exited."""
    out_path, err_path = tmp / f"{tag}.out", tmp / f"{tag}.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        spec = ProcessSpec(0, env, argv=tuple(argv), stdout_fd=out.fileno(), stderr_fd=err.fileno())
        proc = starter.start(spec)
    ready, _, _ = select.select([proc.exit_fd()], [], [], TIMEOUT)
    assert ready, f"worker {proc.pid} did not exit in {TIMEOUT}s"
    code = proc.poll()
    assert code is not None
    proc.release()
    return code, out_path.read_text(), err_path.read_text(), proc.pid


# --- automatic reports, without code changes --------------------------------------------

STEPS = """\
import sys
REPORT_CODE
import torch
class Opt(torch.optim.Optimizer):
    pass
opt = Opt()
for _ in range(int(sys.argv[1])):
    opt.step()
report()
"""


def test_the_bootstrap_hooks_optimizer_steps_when_the_script_imports_torch(
    board: ProgressBoard, tmp_path: Path, fake_torch: str
) -> None:
    script = _write(tmp_path / "train.py", STEPS.replace("REPORT_CODE", REPORT))
    result = _run([*BOOT, str(script), "4"], _env(board, 1, PYTHONPATH=fake_torch))
    out = _output(result)
    assert out["watching"] is True  # torch not imported yet: the import hook waited
    record = board.snapshot()[1]
    assert (record.step, record.reports, record.pid) == (4, 4, out["pid"])
    assert list(board.snapshot()) == [1]
    # Taken out of the environment: the script's own children cannot write the record.
    assert out["env"] == []
    assert out["child_env"] == "[]"
    assert result.stderr == ""


def test_a_worker_forked_from_a_template_with_torch_preloaded_hooks_at_once(
    board: ProgressBoard, tmp_path: Path, fake_torch: str
) -> None:
    script = _write(tmp_path / "train.py", STEPS.replace("REPORT_CODE", REPORT))
    with TemplateStarter(preload=["torch"]) as starter:
        runs = [
            _forked(
                starter,
                tmp_path,
                [*BOOT, str(script), str(steps)],
                _env(board, rank, PYTHONPATH=fake_torch),
                f"w{rank}",
            )
            for rank, steps in ((0, 3), (1, 5))
        ]
        # Each worker's record is its own variable, which does not split the template.
        assert (starter.templates_started, starter.forked, starter.fell_back) == (1, 2, 0)
    for code, _, err, _ in runs:
        assert code == 0, err
    outs = [json.loads(out) for _, out, _, _ in runs]
    assert [o["watching"] for o in outs] == [False, False]  # hooked at once, no watcher
    snapshot = board.snapshot()
    assert {r: (rec.step, rec.pid) for r, rec in snapshot.items()} == {
        0: (3, runs[0][3]),
        1: (5, runs[1][3]),
    }


def test_several_optimizers_per_iteration_count_one_step_per_iteration(
    board: ProgressBoard, tmp_path: Path, fake_torch: str
) -> None:
    script = _write(
        tmp_path / "gan.py",
        """\
        from torch.optim import Optimizer
        probe, gen, disc = Optimizer(), Optimizer(), Optimizer()
        probe.step()  # a learning-rate probe, never used again
        for _ in range(6):
            gen.step()
            disc.step()
        """,
    )
    result = _run([*BOOT, str(script)], _env(board, PYTHONPATH=fake_torch))
    assert result.returncode == 0, result.stderr
    # The probe's step and the first iteration are one iteration: six in all.
    assert board.snapshot()[0].step == 6


def test_explicit_progress_stops_the_automatic_reports(
    board: ProgressBoard, tmp_path: Path, fake_torch: str
) -> None:
    script = _write(
        tmp_path / "explicit.py",
        """\
        import elastrun
        from torch.optim import Optimizer
        opt = Optimizer()
        for step in range(3):
            opt.step()
        elastrun.progress(1000)  # the script knows its global step (a resumed run)
        for step in range(3):
            opt.step()
        elastrun.progress()
        """,
    )
    result = _run([*BOOT, str(script)], _env(board, PYTHONPATH=fake_torch))
    assert result.returncode == 0, result.stderr
    record = board.snapshot()[0]
    assert (record.step, record.reports) == (1001, 5)


# --- elastrun.progress() without torch, and outside elastrun ------------------------------

EXPLICIT = """\
import os, sys, time
REPORT_CODE
import elastrun
elastrun.progress()
time.sleep(0.02)
elastrun.progress()
pid = os.fork()
if pid == 0:  # a forked child (a DataLoader worker) must not write the parent's record
    elastrun.progress(999)
    os._exit(0)
os.waitpid(pid, 0)
elastrun.progress(10)
report()
"""


def test_explicit_progress_without_torch_never_imports_torch(
    board: ProgressBoard, tmp_path: Path
) -> None:
    script = _write(tmp_path / "loop.py", EXPLICIT.replace("REPORT_CODE", REPORT))
    out = _output(_run([*BOOT, str(script)], _env(board)))
    assert out["torch"] is False
    record = board.snapshot()[0]
    assert (record.step, record.reports, record.pid) == (10, 3, out["pid"])
    assert record.step_time is not None and record.longest is not None
    assert record.longest >= 0.02
    # Two intervals over 9 steps: the second, of 8 steps, weighs in per step.
    assert 0 < record.step_time < record.longest


def test_explicit_progress_binds_from_the_environment_without_the_bootstrap(
    board: ProgressBoard, tmp_path: Path
) -> None:
    # A worker that is not started through the bootstrap (a shell script running python).
    script = _write(tmp_path / "loop.py", EXPLICIT.replace("REPORT_CODE", REPORT))
    out = _output(_run([PY, str(script)], _env(board, 1)))
    assert out["env"] == []
    assert board.snapshot()[1].step == 10


def test_outside_elastrun_progress_does_nothing_and_the_bootstrap_imports_nothing(
    tmp_path: Path,
) -> None:
    script = _write(
        tmp_path / "plain.py",
        """\
        import json, sys, time
        loaded = "elastrun.pace.worker.report" in sys.modules
        import elastrun
        from elastrun.pace.worker import report as wp
        for _ in range(3):
            elastrun.progress()
        elastrun.progress(7)
        n = 100_000
        t = time.perf_counter()
        for _ in range(n):
            elastrun.progress()
        cost = (time.perf_counter() - t) / n
        print(json.dumps({"loaded": loaded, "reporter": wp._reporter is None, "cost": cost}))
        """,
    )
    for argv in ([PY, str(script)], [*BOOT, str(script)]):
        result = _run(argv, _env(None))
        out = _output(result)
        assert out["loaded"] is False
        assert out["reporter"] is True
        assert isinstance(out["cost"], float)
        assert out["cost"] < 20e-6  # about 0.2 us; a loose bound for a loaded machine
        assert result.stderr == ""


def test_a_progress_file_that_cannot_be_used_leaves_the_worker_running_with_one_line(
    tmp_path: Path, fake_torch: str
) -> None:
    script = _write(
        tmp_path / "ok.py",
        """\
        import elastrun
        from torch.optim import Optimizer
        Optimizer().step()
        elastrun.progress()
        print("ran")
        """,
    )
    env = {**_env(None), PROGRESS_FILE_ENV: str(tmp_path / "missing"), "PYTHONPATH": fake_torch}
    env["ELASTRUN_PROGRESS_SLOT"] = "0"
    result = _run([*BOOT, str(script)], env)
    assert (result.returncode, result.stdout) == (0, "ran\n")
    assert result.stderr == (
        f"elastrun: progress reports are off: cannot open {tmp_path / 'missing'}: "
        "No such file or directory\n"
    )


# --- reads are never torn -----------------------------------------------------------------


def test_a_reader_never_sees_a_torn_record_while_a_worker_writes_flat_out(
    board: ProgressBoard, tmp_path: Path
) -> None:
    script = _write(
        tmp_path / "flat_out.py",
        """\
        import time
        import elastrun
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            for _ in range(100):
                elastrun.progress()
        """,
    )
    words = memoryview(_map_of(board)).cast("q")
    base = slot_offset(int(board.worker_env(0)["ELASTRUN_PROGRESS_SLOT"]))
    proc = subprocess.Popen([*BOOT, str(script)], env=_env(board))
    reads: list[ProgressRecord] = []
    raw_torn = 0
    try:
        while proc.poll() is None:
            record = board.snapshot().get(0)
            if record is not None:
                reads.append(record)
            # The same words copied without the protocol, to see what it protects from.
            raw = words[base : base + SLOT_WORDS].tolist()
            raw_torn += raw[STEP] != raw[REPORTS]  # equal in every whole record
    finally:
        proc.wait(timeout=TIMEOUT)
        words.release()
    assert proc.returncode == 0
    assert len(reads) > 1000, len(reads)
    for record in reads:
        # With progress() and no step, every whole record has step == reports.
        assert record.step == record.reports, record
        assert record.pid == proc.pid
    steps = [r.step for r in reads]
    assert steps == sorted(steps)
    times = [r.last_report for r in reads]
    assert times == sorted(times)
    print(f"{len(reads)} consistent reads; {raw_torn} raw copies were torn")


def _map_of(board: ProgressBoard) -> mmap.mmap:
    mapping = board._map
    assert mapping is not None
    return mapping


# --- real torch ---------------------------------------------------------------------------

TORCH_TRAIN = """\
import sys
REPORT_CODE
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 4), torch.randn(16, 1)
for _ in range(int(sys.argv[1])):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
report()
"""


@pytest.mark.torch
def test_torch_optimizer_steps_are_seen_without_code_changes_in_a_fresh_worker(
    board: ProgressBoard, tmp_path: Path
) -> None:
    script = _write(tmp_path / "train.py", TORCH_TRAIN.replace("REPORT_CODE", REPORT))
    out = _output(_run([*BOOT, str(script), "7"], _env(board)))
    assert out["watching"] is True
    record = board.snapshot()[0]
    assert (record.step, record.reports, record.pid) == (7, 7, out["pid"])


@pytest.mark.torch
def test_torch_optimizer_steps_are_seen_in_workers_forked_from_a_template(
    board: ProgressBoard, tmp_path: Path
) -> None:
    script = _write(tmp_path / "train.py", TORCH_TRAIN.replace("REPORT_CODE", REPORT))
    with TemplateStarter() as starter:  # preloads torch: the script imports it
        runs = [
            _forked(
                starter, tmp_path, [*BOOT, str(script), str(steps)], _env(board, rank), f"{rank}"
            )
            for rank, steps in ((0, 4), (1, 6))
        ]
        assert (starter.templates_started, starter.forked, starter.fell_back) == (1, 2, 0)
    for code, _, err, _ in runs:
        assert code == 0, err
    assert [json.loads(out)["watching"] for _, out, _, _ in runs] == [False, False]
    snapshot = board.snapshot()
    assert {r: (rec.step, rec.pid) for r, rec in snapshot.items()} == {
        0: (4, runs[0][3]),
        1: (6, runs[1][3]),
    }


def test_timestamps_are_on_the_agents_monotonic_clock(board: ProgressBoard, tmp_path: Path) -> None:
    script = _write(tmp_path / "once.py", "import elastrun\nelastrun.progress()\n")
    before = time.monotonic()
    assert _run([*BOOT, str(script)], _env(board)).returncode == 0
    after = time.monotonic()
    assert before <= board.snapshot()[0].last_report <= after
