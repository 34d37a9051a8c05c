"""The event loop the workers' store runs on: uvloop's when installed, else asyncio's."""

from __future__ import annotations

import asyncio
import sys

import pytest

from elastrun.core.eventloop import new_event_loop


def test_without_uvloop_the_loop_is_asyncios(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what an absent package imports as
    loop = new_event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio.")
    finally:
        loop.close()


def test_with_uvloop_installed_the_loop_is_uvloops() -> None:
    uvloop = pytest.importorskip("uvloop")
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()
