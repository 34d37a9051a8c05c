"""The prctl calls of ``elastrun.core.linux`` on this process (no child is started)."""

from __future__ import annotations

import pytest

from elastrun.core.linux import child_subreaper, is_child_subreaper, set_parent_death_signal


def test_child_subreaper_is_on_inside_the_block_and_off_after_it() -> None:
    assert not is_child_subreaper()
    with child_subreaper() as on:
        assert on
        assert is_child_subreaper()
    assert not is_child_subreaper()


def test_child_subreaper_leaves_a_subreaper_that_was_one_before_as_it_was() -> None:
    with child_subreaper(), child_subreaper() as inner:
        assert inner
    assert not is_child_subreaper()
    with child_subreaper():
        with child_subreaper():
            pass
        assert is_child_subreaper()


def test_set_parent_death_signal_rejects_a_number_that_is_no_signal() -> None:
    with pytest.raises(OSError):
        set_parent_death_signal(10_000)
    set_parent_death_signal(0)  # 0 clears the request (workers arm a real signal)
