"""The torch store's table: compare_set and add rules, waiters, queues, barriers."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from elastrun.store.torchwire.state import (
    NotANumberError,
    TorchStoreState,
    Waiter,
    parse_counter,
    read_counter,
)


class Woken:
    """Wake callbacks that record which waiter fired, in order."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def cb(self, name: str) -> Callable[[], None]:
        return lambda: self.order.append(name)


def blocked(w: Waiter | None) -> Waiter:
    assert w is not None, "expected the request to block"
    return w


# -- compare_set -------------------------------------------------------------------------


def test_compare_set_on_a_missing_key_with_empty_expected_creates_it() -> None:
    s = TorchStoreState()
    assert s.compare_set(b"k", b"", b"new") == b"new"
    assert s.get(b"k") == b"new"


def test_compare_set_on_a_missing_key_with_other_expected_answers_it_and_creates_nothing() -> None:
    s = TorchStoreState()
    assert s.compare_set(b"k", b"exp", b"new") == b"exp"
    assert not s.check([b"k"])
    assert s.num_keys == 0


def test_compare_set_on_a_matching_value_replaces_it() -> None:
    s = TorchStoreState()
    s.set(b"k", b"old")
    assert s.compare_set(b"k", b"old", b"new") == b"new"
    assert s.get(b"k") == b"new"


def test_compare_set_on_a_different_value_answers_the_current_one() -> None:
    s = TorchStoreState()
    s.set(b"k", b"cur")
    assert s.compare_set(b"k", b"old", b"new") == b"cur"
    assert s.get(b"k") == b"cur"


def test_compare_set_with_empty_expected_on_an_existing_empty_value_replaces_it() -> None:
    s = TorchStoreState()
    s.set(b"k", b"")
    assert s.compare_set(b"k", b"", b"new") == b"new"


def test_compare_set_that_creates_a_key_releases_its_waiters() -> None:
    s, woken = TorchStoreState(), Woken()
    blocked(s.wait([b"k"], woken.cb("a")))
    s.compare_set(b"k", b"exp", b"new")
    assert woken.order == []
    s.compare_set(b"k", b"", b"new")
    assert woken.order == ["a"]


# -- add ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "number"),
    [
        (b"12", 12),
        (b" 12abc", 12),
        (b"+5", 5),
        (b"-0x5", 0),
        (b"\t\n-5", -5),
        (b"007", 7),
        (b"1_0", 1),
        (b"9223372036854775807", 2**63 - 1),
    ],
)
@pytest.mark.parametrize("read", [parse_counter, read_counter])
def test_counters_are_read_as_stoll_reads_them(
    read: Callable[[bytes], int], stored: bytes, number: int
) -> None:
    assert read(stored) == number


@pytest.mark.parametrize(
    "stored", [b"", b"abc", b" ", b"-", b"99999999999999999999", b"9223372036854775808"]
)
@pytest.mark.parametrize("read", [parse_counter, read_counter])
def test_values_that_are_not_64_bit_numbers_are_refused(
    read: Callable[[bytes], int], stored: bytes
) -> None:
    with pytest.raises(NotANumberError):
        read(stored)


def test_add_starts_from_zero_and_stores_decimal() -> None:
    s = TorchStoreState()
    assert s.add(b"n", 0) == 0
    assert s.add(b"n", -7) == -7
    assert s.get(b"n") == b"-7"


def test_add_wraps_around_at_64_bits_like_torch() -> None:
    s = TorchStoreState()
    s.set(b"n", b"9223372036854775807")
    assert s.add(b"n", 1) == -(2**63)


def test_add_on_a_non_number_changes_nothing() -> None:
    s = TorchStoreState()
    s.set(b"n", b"abc")
    with pytest.raises(NotANumberError):
        s.add(b"n", 1)
    assert s.get(b"n") == b"abc"


# -- keys --------------------------------------------------------------------------------


def test_missing_keys_read_as_empty_values() -> None:
    s = TorchStoreState()
    s.set(b"a", b"1")
    assert s.get(b"zz") == b""
    assert s.multi_get([b"a", b"zz"]) == [b"1", b""]


def test_delete_reports_whether_the_key_was_there() -> None:
    s = TorchStoreState()
    s.set(b"a", b"1")
    assert s.delete(b"a")
    assert not s.delete(b"a")


def test_append_creates_then_extends() -> None:
    s = TorchStoreState()
    s.append(b"a", b"x")
    s.append(b"a", b"y")
    assert s.get(b"a") == b"xy"


def test_num_keys_and_list_keys_count_values_not_queues() -> None:
    s = TorchStoreState()
    s.multi_set([b"a", b"b"], [b"1", b""])
    s.queue_push(b"q", b"item")
    assert s.num_keys == 2
    assert sorted(s.list_keys()) == [b"a", b"b"]
    assert s.check([b"a", b"b", b"q"])


# -- waiting -----------------------------------------------------------------------------


def test_wait_on_present_keys_does_not_block() -> None:
    s = TorchStoreState()
    s.set(b"a", b"")
    assert s.wait([b"a"], lambda: None) is None
    assert s.wait([], lambda: None) is None


def test_wait_releases_when_the_last_missing_key_is_written() -> None:
    s, woken = TorchStoreState(), Woken()
    blocked(s.wait([b"a", b"b", b"a"], woken.cb("w")))
    s.set(b"a", b"1")
    assert woken.order == []
    s.add(b"b", 1)
    assert woken.order == ["w"]
    s.set(b"b", b"2")  # released once only
    assert woken.order == ["w"]


def test_every_kind_of_write_releases_all_waiters_of_a_key() -> None:
    writes: tuple[Callable[[TorchStoreState], object], ...] = (
        lambda s: s.set(b"k", b"v"),
        lambda s: s.append(b"k", b"v"),
        lambda s: s.add(b"k", 1),
        lambda s: s.multi_set([b"x", b"k"], [b"1", b"2"]),
        lambda s: s.compare_set(b"k", b"", b"v"),
    )
    for write in writes:
        s, woken = TorchStoreState(), Woken()
        for name in "abc":
            blocked(s.wait([b"k"], woken.cb(name)))
        write(s)
        assert woken.order == ["a", "b", "c"]


def test_a_cancelled_waiter_is_never_woken_and_leaves_no_trace() -> None:
    s, woken = TorchStoreState(), Woken()
    w = blocked(s.wait([b"a", b"b"], woken.cb("w")))
    s.cancel(w)
    s.cancel(w)  # idempotent
    s.multi_set([b"a", b"b"], [b"1", b"2"])
    assert woken.order == []
    assert "waited_keys=0" in repr(s)


def test_delete_does_not_affect_waiters() -> None:
    s, woken = TorchStoreState(), Woken()
    blocked(s.wait([b"k"], woken.cb("w")))
    s.delete(b"k")
    assert woken.order == []


# -- queues ------------------------------------------------------------------------------


def test_queue_pop_reports_the_length_before_popping() -> None:
    s = TorchStoreState()
    s.queue_push(b"q", b"1")
    s.queue_push(b"q", b"2")
    assert s.queue_len(b"q") == 2
    assert s.queue_pop(b"q") == (2, b"1")
    assert s.queue_pop(b"q") == (1, b"2")
    assert s.queue_pop(b"q") == (0, None)
    assert s.queue_len(b"q") == 0


def test_a_push_releases_one_waiter_in_arrival_order() -> None:
    s, woken = TorchStoreState(), Woken()
    for name in "abc":
        blocked(s.wait([b"q"], woken.cb(name)))
    s.queue_push(b"q", b"1")
    assert woken.order == ["a"]
    s.queue_push(b"q", b"2")
    assert woken.order == ["a", "b"]


def test_a_non_empty_queue_counts_as_present_for_wait_and_check() -> None:
    s = TorchStoreState()
    s.queue_push(b"q", b"1")
    assert s.check([b"q"])
    assert s.wait([b"q"], lambda: None) is None
    s.queue_pop(b"q")
    assert not s.check([b"q"])


# -- barriers ----------------------------------------------------------------------------


def test_a_barrier_releases_everyone_when_the_last_arrives() -> None:
    s, woken = TorchStoreState(), Woken()
    blocked(s.barrier(b"bar", 3, woken.cb("a")))
    blocked(s.barrier(b"bar", 3, woken.cb("b")))
    assert woken.order == []
    assert s.barrier(b"bar", 3, woken.cb("c")) is None
    assert woken.order == ["a", "b"]
    assert s.get(b"bar") == b"3"


def test_a_timed_out_barrier_arrival_still_counts() -> None:
    s = TorchStoreState()
    s.cancel(blocked(s.barrier(b"bar", 2, lambda: None)))
    assert s.barrier(b"bar", 2, lambda: None) is None


def test_a_barrier_arrival_satisfies_plain_waiters_on_its_key_but_not_other_arrivals() -> None:
    s, woken = TorchStoreState(), Woken()
    blocked(s.wait([b"bar"], woken.cb("plain")))
    blocked(s.barrier(b"bar", 3, woken.cb("first")))
    assert woken.order == ["plain"]
    blocked(s.barrier(b"bar", 3, woken.cb("second")))
    assert woken.order == ["plain"]


def test_a_barrier_on_a_non_counter_is_refused() -> None:
    s = TorchStoreState()
    s.set(b"bar", b"x")
    with pytest.raises(NotANumberError):
        s.barrier(b"bar", 2, lambda: None)
