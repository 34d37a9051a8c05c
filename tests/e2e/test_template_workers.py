"""Workers forked from the template, through the ``elastrun`` command: each must behave
like the fresh ``python -u train.py ARGS`` that ``--no-template`` (and torchrun) starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from functools import partial
from pathlib import Path

import pytest

from _helpers import finish, run, start, wait_for, write_script

MODES = {"template": [], "no-template": ["--no-template"]}

# Prints what a rank draws with no seed, then with an explicit one; attempt 0 fails so
# that attempt 1 (a restart, forked from the same template) draws too. A rank of attempt
# 0 fails only once every rank has drawn: the first failure stops the group, and a rank
# still importing torch (fresh interpreters on a loaded machine) would never print.
SEEDS = """\
import json, os, sys, time
import torch
record = {
    "rank": os.environ["RANK"],
    "restart": os.environ["TORCHELASTIC_RESTART_COUNT"],
    "initial_seed": torch.initial_seed(),
    "rand": torch.rand(4).tolist(),
}
torch.manual_seed(1234)
record["seeded"] = [torch.initial_seed(), torch.rand(4).tolist()]
# One write per line: print() writes the text and the newline separately, and two
# workers' lines could interleave on the shared console.
os.write(1, ("SEEDS " + json.dumps(record) + "\\n").encode())
if record["restart"] == "0":
    open(f"drawn_{record['rank']}", "w").close()
    deadline = time.monotonic() + 60
    while len([f for f in os.listdir() if f.startswith("drawn_")]) < 2:
        assert time.monotonic() < deadline, "the other ranks never drew"
        time.sleep(0.05)
    sys.exit(1)
"""
# torch.manual_seed(1234); torch.rand(4) in any fresh interpreter (CPU generator).
SEEDED_1234 = [0.028979241847991943, 0.4018985629081726, 0.25984418392181396, 0.3666413426399231]


@pytest.mark.torch
@pytest.mark.parametrize("mode", MODES)
def test_every_rank_and_restart_draws_its_own_torch_random_numbers_unless_seeded(
    tmp_path: Path, mode: str
) -> None:
    script = write_script(tmp_path / "seeds.py", SEEDS)
    result = run(
        [*MODES[mode], "--nproc-per-node", "2", "--max-restarts", "1", str(script)],
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    records = [
        json.loads(line.removeprefix("SEEDS "))
        for line in result.stdout.splitlines()
        if line.startswith("SEEDS ")
    ]
    assert sorted((r["restart"], r["rank"]) for r in records) == [
        (restart, rank) for restart in "01" for rank in "01"
    ]
    # Four workers (two ranks, two attempts): four different OS-drawn seeds.
    assert len({r["initial_seed"] for r in records}) == 4, records
    assert len({tuple(r["rand"]) for r in records}) == 4, records
    # An explicit seed gives every worker exactly that seed's numbers.
    assert all(r["seeded"] == [1234, SEEDED_1234] for r in records), records


# --- a stop request while workers are being forked -------------------------------------

# Says when it runs; on attempt 0 rank 1 fails at once, so that a restart follows.
STARTED = """\
import os, sys, time
restart, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
print("started", restart, rank, flush=True)
if len(sys.argv) > 1 and restart == "0" and rank == "1":
    sys.exit(1)
time.sleep(60)
"""
# Lines of the launcher's log just before (or while) it forks workers.
TEMPLATE_READY = "worker template pid"
RESTARTING = "restarting all workers"
RUNS = 15
# A lost signal costs the whole shutdown grace (30 s by default) and a SIGKILL.
PROMPT = 5.0


def _interrupt_when(proc: subprocess.Popen[str], line: str, delay: float) -> str:
    """Send SIGINT ``delay`` seconds after the launcher's stderr shows ``line``."""
    assert proc.stderr is not None
    seen: list[str] = []
    while True:
        got = proc.stderr.readline()
        assert got, f"the launcher ended before logging {line!r}: {''.join(seen)}"
        seen.append(got)
        if line in got:
            break
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGINT)
    return "".join(seen)


def _assert_stops_promptly(proc: subprocess.Popen[str], sent_at: float, what: str) -> None:
    result = finish(proc, 60)
    took = time.monotonic() - sent_at
    assert result.returncode == 128 + signal.SIGINT, (what, result.stderr)
    assert took < PROMPT, f"{what}: stopping took {took:.1f}s\n{result.stderr}"
    assert "needed SIGKILL" not in result.stderr, what


@pytest.mark.slow
@pytest.mark.parametrize(("trigger", "args"), [(TEMPLATE_READY, []), (RESTARTING, ["fail"])])
def test_an_interrupt_while_workers_are_forked_stops_them_at_once(
    tmp_path: Path, trigger: str, args: list[str]
) -> None:
    script = write_script(tmp_path / "started.py", STARTED)
    for i in range(RUNS):
        delay = (i % 8) / 1000  # 0 to 7 ms after the line: the forks take a few ms
        proc = start(
            ["--nproc-per-node", "2", "--max-restarts", "1", str(script), *args], cwd=tmp_path
        )
        _interrupt_when(proc, trigger, delay)
        _assert_stops_promptly(proc, time.monotonic(), f"run {i}, {delay * 1000:.0f} ms")


def _runs_its_own_code(pid: int) -> bool:
    """Whether the launcher ``pid`` is past the interpreter's start-up: its first line
    holds the stop signals back until its handlers are in place, which start its first
    thread (the signal relay); or it has ended."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            fields = dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)
    except OSError:
        return True
    held = int(fields["SigBlk"], 16) & (1 << (signal.SIGINT - 1))
    return bool(held) or int(fields["Threads"]) > 1 or fields["State"].startswith("Z")


@pytest.mark.slow
def test_an_interrupt_at_any_moment_of_the_launch_stops_it_at_once(tmp_path: Path) -> None:
    script = write_script(tmp_path / "started.py", STARTED)
    # When does the first worker run on this machine, now?
    t0 = time.monotonic()
    proc = start(["--nproc-per-node", "2", str(script)], cwd=tmp_path)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("started")
    first = time.monotonic() - t0
    os.kill(proc.pid, signal.SIGINT)
    _assert_stops_promptly(proc, time.monotonic(), "calibration")
    for i in range(RUNS):
        # From well before the first worker runs to well after, a few ms apart.
        delay = first * (0.7 + 0.04 * i)
        t0 = time.monotonic()
        proc = start(["--nproc-per-node", "2", str(script)], cwd=tmp_path)
        # Not before the launcher's first line: until then the interpreter's start-up
        # decides, and python may end with "Fatal Python error" (exit 1), die of it (-2)
        # or drop the KeyboardInterrupt where it is raised in an import's callback
        # ("Exception ignored in: <function _get_module_lock.<locals>.cb ...>"): the
        # launcher then ran the job and never answered (60 s). Seen 1 in 600 SIGINTs sent
        # in a launcher's first 50 ms; the delays here reach that far only when a load
        # peak makes one launch's start-up far slower than the calibration's.
        wait_for(partial(_runs_its_own_code, proc.pid), 30, "the launcher's first line")
        time.sleep(max(0.0, delay - (time.monotonic() - t0)))
        os.kill(proc.pid, signal.SIGINT)
        what = f"run {i}, {delay * 1000:.0f} ms"
        _assert_stops_promptly(proc, time.monotonic(), what)


# --- how a worker looks from outside ---------------------------------------------------

# What ps, pgrep -f, top and psutil show of this worker.
LOOKS = """\
import json, os, subprocess
import psutil
me = psutil.Process()
pgrep = subprocess.run(["pgrep", "-f", "train.py --lr 0.1"], capture_output=True, text=True)
os.write(1, ("LOOKS " + json.dumps({
    "rank": os.environ["RANK"],
    "cmdline": me.cmdline(),
    "comm": me.name(),
    "pgrep": os.getpid() in [int(p) for p in pgrep.stdout.split()],
}) + "\\n").encode())
"""


def test_a_forked_worker_looks_like_a_fresh_one_to_ps_pgrep_and_psutil(tmp_path: Path) -> None:
    pytest.importorskip("psutil")
    write_script(tmp_path / "train.py", LOOKS)
    seen = {}
    for mode, args in MODES.items():
        result = run([*args, "--nproc-per-node", "2", "train.py", "--lr", "0.1"], cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        seen[mode] = sorted(
            (json.loads(line.removeprefix("LOOKS ")) for line in result.stdout.splitlines()
             if line.startswith("LOOKS ")),
            key=lambda r: r["rank"],
        )  # fmt: skip
    assert seen["template"] == seen["no-template"]
    for record in seen["template"]:
        assert record["cmdline"][-3:] == ["train.py", "--lr", "0.1"]
        assert record["pgrep"] is True
        assert record["comm"].startswith("python")
