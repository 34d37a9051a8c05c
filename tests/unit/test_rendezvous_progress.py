"""A long rendezvous wait: one line in place on a terminal, few lines in a log."""

from __future__ import annotations

import io
import logging

import pytest

from elastrun.rendezvous.progress import ProgressLine
from elastrun.testing import FakeClock


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_when_the_count_changes_and_at_most_every_30s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    line = ProgressLine(logging.getLogger("t.progress"), clock, stream=io.StringIO())
    caplog.set_level(logging.INFO, logger="t.progress")
    # Ten minutes of waiting, a status every 5 s, the count changing twice.
    for tick in range(120):
        count = 1 if tick < 40 else (2 if tick < 80 else 3)
        line.show((0, count), f"{count} node(s) in; timeout in {600 - 5 * tick}s")
        clock.advance(5)
    shown = [r.getMessage() for r in caplog.records]
    assert len(shown) <= 3 + 600 // 30  # one per change plus one per 30 s at most
    assert len(shown) >= 3
    assert [m.split()[0] for m in shown].count("2") >= 1
    assert shown[0].startswith("1 node(s)")


def test_a_terminal_gets_one_line_rewritten_in_place(caplog: pytest.LogCaptureFixture) -> None:
    tty = _Tty()
    line = ProgressLine(logging.getLogger("t.progress2"), FakeClock(), stream=tty)
    caplog.set_level(logging.INFO, logger="t.progress2")
    for i in range(5):
        line.show((0, i), f"{i} node(s) in")
    line.end()
    out = tty.getvalue()
    assert out.count("\r") == 5 and out.count("\n") == 1 and out.endswith("4 node(s) in\x1b[K\n")
    assert not caplog.records
