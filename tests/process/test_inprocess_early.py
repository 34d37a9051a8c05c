"""Allocating a receiver's tensors ahead (``inprocess.worker.early``) through a real round
store: elastrun's torch-wire server, torch's own clients, as the ranks use them."""

from __future__ import annotations

import ctypes
import datetime
import mmap
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from _helpers import wait_for
from elastrun.inprocess import State
from elastrun.inprocess.worker import early
from elastrun.store.torchwire.server import TorchWireServer

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch


@pytest.fixture
def port() -> Iterator[int]:
    server = TorchWireServer("127.0.0.1", 0)
    try:
        yield server.start()
    finally:
        server.close()


def _client(port: int) -> Any:
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    timeout = datetime.timedelta(seconds=5)
    return PrefixStore("round/1/", TCPStore("127.0.0.1", port, is_master=False, timeout=timeout))


def _trained(width: int) -> State:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    opt = torch.optim.Adam(model.parameters())
    opt.zero_grad()
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    state = State(model=model, optimizer=opt)
    state.commit()
    return state


def _fresh(width: int) -> State:
    model = torch.nn.Linear(width, width)
    return State(model=model, optimizer=torch.optim.Adam(model.parameters()))


def test_the_first_holder_publishes_and_a_fresh_rank_allocates_and_faults_in_ahead(
    port: int,
) -> None:
    # 64 MiB moments: above glibc's largest mmap threshold, so each is a fresh mapping
    # (a smaller block may reuse heap pages another test left resident).
    width = 4096
    early.publish(_trained(width), _client(port))
    early.publish(_trained(8), _client(port))  # a second holder: the first one's claim stands
    fresh = _fresh(width)
    with early.ahead(fresh, _client(port)) as pool:
        shapes = sorted(tuple(t.shape) for t in pool.values())
        assert shapes == [(), (), (width,), (width,), (width, width), (width, width)]
        moments = [t for t in pool.values() if t.dim() == 2]
        # Nothing writes them: their pages come in from the populating thread.
        # (all but the two partial pages at their ends, which prefault leaves to the copy)
        wait_for(lambda: all(_resident(t) > 0.999 for t in moments), 20, "the moments' pages")
    assert "elastrun-prefault" not in [t.name for t in threading.enumerate()]


def _resident(t: torch.Tensor) -> float:
    """The share of ``t``'s pages in memory (``mincore``)."""
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = (ctypes.c_ubyte * -(-length // page))()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    assert mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return sum(v & 1 for v in vec) / len(vec)


def test_nothing_is_allocated_before_a_holder_publishes_or_when_the_store_fails(
    port: int,
) -> None:
    fresh = _fresh(64)
    with early.ahead(fresh, _client(port)) as pool:
        assert pool == {}

    class Broken:
        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("the store went away")

    with early.ahead(fresh, Broken()) as pool:
        assert pool == {}
