"""Where node checks meet in the store: nodes that check at the same time form one wave
with one member list, a late node opens the next one, and a round's results read the
same on every node, a missing one included; the worker side's test-only fault hook."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from elastrun.core.clock import SYSTEM_CLOCK
from elastrun.nodecheck.agent.board import CheckBoard, LinkResult, Wave
from elastrun.store.memory import MemoryStore

WINDOW = 0.3


def _board(store: MemoryStore, node: str) -> CheckBoard:
    addr = f"10.0.0.{node[-1]}"
    return CheckBoard(store, "/run/", node, addr, lease=None, clock=SYSTEM_CLOCK, window=WINDOW)


def test_nodes_checking_together_form_one_wave_and_a_late_node_the_next() -> None:
    store = MemoryStore()
    waves: dict[str, Wave] = {}

    def join(node: str) -> None:
        waves[node] = _board(store, node).join(time.monotonic() + 10)

    threads = [threading.Thread(target=join, args=(f"n{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {w.members for w in waves.values()} == {("n0", "n1", "n2")}
    assert waves["n0"].addrs == {"n0": "10.0.0.0", "n1": "10.0.0.1", "n2": "10.0.0.2"}
    late = _board(store, "n3").join(time.monotonic() + 10)
    assert late.id == waves["n0"].id + 1 and late.members == ("n3",)


def test_every_node_reads_the_same_results_and_a_late_result_loses_to_the_marker() -> None:
    store = MemoryStore()
    wave = Wave(1, ("a", "b", "c"), {})
    a, b, c = (_board(store, n) for n in ("a", "b", "c"))
    a.publish(wave, 0, LinkResult(0.01, 0.2))
    b.publish(wave, 0, LinkResult(None, None))
    # c never reports in time: a marks it missing when its deadline passes.
    seen_by_a = a.results(wave, 0, ["a", "b", "c"], time.monotonic() + 0.05)
    c.publish(wave, 0, LinkResult(0.01, 0.2))  # too late: the marker stands
    seen_by_b = b.results(wave, 0, ["a", "b", "c"], time.monotonic())
    assert seen_by_a == seen_by_b
    assert seen_by_a["a"] == LinkResult(0.01, 0.2)
    assert seen_by_a["b"] == LinkResult(None, None)
    assert seen_by_a["c"] == LinkResult(None, None, missing=True)


def test_a_partner_that_cannot_serve_says_so_at_once() -> None:
    store = MemoryStore()
    wave = Wave(1, ("a", "b"), {})
    a, b = _board(store, "a"), _board(store, "b")
    a.offer_port(wave, 0, 0)
    assert b.partner_port(wave, 0, "a", time.monotonic() + 10) is None
    a.offer_port(wave, 1, 4242)
    assert b.partner_port(wave, 1, "a", time.monotonic() + 10) == 4242


def _check(*args: str, fault: str = "") -> tuple[int, list[dict[str, object]]]:
    env = {"ELASTRUN_TEST_NODE_CHECK": fault, "PYTHONPATH": ":".join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-m", "elastrun.nodecheck.worker.runner", "--deadline", "20", *args],
        check=False, capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    return proc.returncode, [json.loads(x) for x in proc.stdout.splitlines()]


def test_the_fault_hook_fails_the_check_process_at_once_and_slows_its_link() -> None:
    status, lines = _check("compute", fault="fail")
    assert status == 1 and lines[-1]["ok"] is False and "injected" in str(lines[-1]["error"])
    with subprocess.Popen(
        [sys.executable, "-m", "elastrun.nodecheck.worker.runner", "serve", "127.0.0.1"],
        stdout=subprocess.PIPE, text=True,
        env={"ELASTRUN_TEST_NODE_CHECK": "slow:0.3", "PYTHONPATH": ":".join(sys.path)},
    ) as server:  # fmt: skip
        assert server.stdout is not None
        port = json.loads(server.stdout.readline())["port"]
        status, lines = _check("connect", "127.0.0.1", str(port))
        served = json.loads(server.stdout.readline())
        assert server.wait(timeout=30) == 0 and served["ok"] is True
    assert status == 0 and lines[-1]["ok"] is True
    # The slow side's delay is inside the time both sides report.
    # arg-type: the parsed JSON's values are typed object
    assert float(lines[-1]["seconds"]) >= 0.3 and float(served["seconds"]) >= 0.3  # type: ignore[arg-type]


def test_a_result_with_numbers_past_a_float_reads_as_no_measure() -> None:
    # JSON as Python reads it allows NaN, infinities and integers of any size; a peer's
    # result holding one is no measurement, not an OverflowError in every reader.
    from elastrun.nodecheck.agent.board import VERSION

    store = MemoryStore()
    wave = Wave(1, ("a", "b"), {})
    a = _board(store, "a")
    doc = {"v": VERSION, "link": 10**400, "compute": float("nan")}
    store.set(a._key(wave, 0, "r", "b"), json.dumps(doc).encode())
    assert a.results(wave, 0, ["b"], time.monotonic())["b"] == LinkResult(None, None)
