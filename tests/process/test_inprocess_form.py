"""In-process synchronisation: the group of the exchange forms in short tries (a peer
killed while gloo connects the mesh costs seconds, not ten minutes, and the survivors
hear of the next round), a try that fails for one rank is tried again by all, and the
exchange itself then runs under the long timeout."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from elastrun.store.torchwire.server import TorchWireServer

# One rank of a two-rank group, formed by ``sync._form`` on the store at a port.
# argv: port, rank, then what it does:
#   "stay": form (the test kills it once it is forming);
#   "now": form, and say the round is superseded 3 s after it started;
#   "late": wait 1.5 s (the first try of its peer, 1 s, times out), then form;
#   "slow": form, then wait 3 s (over the first try's timeout) before the collective;
#   "broken": form alone, where every init fails at once (in 3 tries).
RANK = """
import datetime, os, sys, time
import torch, torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore
from elastrun.inprocess.worker import sync

port, rank, then = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
if then == "late":
    time.sleep(1.5)
if then == "broken":
    def init_process_group(*args, **kwargs):
        raise RuntimeError("no device for gloo")
    dist.init_process_group = init_process_group
    sync.FORM_TRIES = 3
print("forming", flush=True)
t0 = time.monotonic()
superseded = (lambda: time.monotonic() - t0 > 3.0) if then == "now" else (lambda: False)
try:
    sync._form(PrefixStore("test/", store), rank, 1 if then == "broken" else 2, 7, superseded)
except sync.Superseded as exc:
    print(f"superseded after {time.monotonic() - t0:.1f}s: {exc}")
    sys.exit(3)
except RuntimeError as exc:
    print(f"failed after {time.monotonic() - t0:.1f}s: {exc}")
    sys.exit(4)
if then == "slow":
    time.sleep(3.0)
t = torch.ones(2)
dist.all_reduce(t)
print(f"reduced {t[0].item():.0f}", flush=True)
# Leave at once: the group stays parked, as the synchronisation leaves it (released at
# the next recovery, see inprocess.worker.parking), and an interpreter that ends with
# its gloo threads alive may abort in their destructors, which is not what this tests.
os._exit(0)
"""


@contextlib.contextmanager
def _store() -> Iterator[int]:
    """The port of a store as the agent serves it to the workers."""
    server = TorchWireServer("127.0.0.1", 0)
    try:
        yield server.start()
    finally:
        server.close()


def _rank(tmp_path: Path, port: int, rank: int, then: str) -> subprocess.Popen[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(script), str(port), str(rank), then],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip


def _ended(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_peer_killed_after_publishing_its_address_holds_the_others_for_seconds(
    tmp_path: Path,
) -> None:
    # Rank X publishes its address and waits for rank Y's; it is then killed. Y comes
    # later and reads X's address. gloo connects each pair from one side, picked by
    # comparing the two addresses (random ports): when X was to connect, Y waits for it
    # five times the group's timeout (ten minutes with the exchange's 120 s, when the
    # group formed in one try). In tries of 1 s, Y hears of the next round (announced
    # here 3 s after it started) within 5 s. The side is a coin toss: three tries, in
    # both rank orders.
    for dead, late in ((1, 0), (0, 1), (1, 0)):
        with _store() as port:
            procs = [_rank(tmp_path, port, dead, "stay")]
            try:
                assert procs[0].stdout is not None
                assert procs[0].stdout.readline().strip() == "forming"
                time.sleep(1.0)  # its address is in the store
                procs[0].kill()
                procs.append(_rank(tmp_path, port, late, "now"))
                out, _ = procs[1].communicate(timeout=60)
            finally:
                _ended(procs)
        assert procs[1].returncode == 3, out
        took = float(out.split("superseded after ")[1].split("s:")[0])
        assert took < 10, out


@pytest.mark.parametrize(
    "second",
    [
        # Rank 0's first try (1 s) ends before rank 1 comes: rank 1 may form with what
        # rank 0 left, or fail; either way both try again, with 2 s, and the group works.
        "late",
        # A rank 3 s late to the first collective, after a first try of 1 s: the
        # collective waits for it (under the formation's timeout, it would fail).
        "slow",
    ],
    ids=["a-try-failed-for-one-rank-is-tried-again-by-all", "the-exchange-gets-the-long-timeout"],
)
def test_a_two_rank_group_forms_and_reduces(tmp_path: Path, second: str) -> None:
    with _store() as port:
        procs = [_rank(tmp_path, port, 0, "stay"), _rank(tmp_path, port, 1, second)]
        try:
            outs = [proc.communicate(timeout=60)[0] for proc in procs]
        finally:
            _ended(procs)
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out
        assert "reduced 2" in out, out


def test_a_formation_that_fails_every_try_fails_for_good(tmp_path: Path) -> None:
    # An init that fails at once every time (a backend that cannot start) is not tried
    # for ever: after the last try the rank raises, and the agent is asked as for any
    # failed collective.
    with _store() as port:
        procs = [_rank(tmp_path, port, 0, "broken")]
        try:
            out, _ = procs[0].communicate(timeout=60)
        finally:
            _ended(procs)
    assert procs[0].returncode == 4, out
    assert "did not form in 3 tries (the last: no device for gloo)" in out, out
