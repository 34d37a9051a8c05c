"""The collector's policy for a process serving a large store (``core.collector``): run
in a child process of its own, since it changes the whole process's collector."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import gc, json
from elastrun.core.collector import Calm
clock = [0.0]
calm = Calm(slow=SLOW, thaw_every=100.0, clock=lambda: clock[0])
gc.callbacks.append(calm)
heap = [[i] for i in range(200_000)]  # long-lived objects a full collection scans
def full(pause):
    # The policy sees the pause on its clock: the collection's start, then its end.
    calm("start", {"generation": 2})
    clock[0] += pause
    calm("stop", {"generation": 2, "collected": 0})
full(0.01)
short = gc.get_freeze_count()
full(0.2)
frozen = gc.get_freeze_count()
calm("start", {"generation": 0}); calm("stop", {"generation": 0})  # young: ignored
gc.collect()  # a real full collection: its own pause is short on the clock here
clock[0] += 100.0
full(0.2)  # the period has passed: they go back to the collector
print(json.dumps({"short": short, "frozen": frozen, "thawed": gc.get_freeze_count(),
                  "freezes": calm.freezes, "thaws": calm.thaws}))
"""


def test_a_slow_full_collection_freezes_the_survivors_until_the_period_ends() -> None:
    got = json.loads(_child(CHILD.replace("SLOW", "0.05")))
    assert got["short"] == 0  # a short pause: nothing frozen
    assert got["frozen"] >= 200_000  # the heap, frozen after the slow one
    assert got["thawed"] == 0 and got["thaws"] == 1
    assert got["freezes"] == 1


def test_installing_twice_installs_once() -> None:
    code = (
        "import gc; from elastrun.core.collector import calm_full_collections as c;"
        "a = c(); b = c(); print(a is b, gc.callbacks.count(a))"
    )
    assert _child(code).split() == ["True", "1"]


def test_a_forked_child_gets_its_collector_back() -> None:
    code = (
        "import gc, os; from elastrun.core.collector import calm_full_collections as c;"
        "calm = c(); gc.freeze(); pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if calm not in gc.callbacks and gc.get_freeze_count() == 0 else 1)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status), calm in gc.callbacks)"
    )
    assert _child(code).split() == ["0", "True"]


def _child(code: str) -> str:
    """What a fresh interpreter running ``code`` printed."""
    argv = [sys.executable, "-c", code]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    return run.stdout
