"""In-process recovery's worker side without an agent: the state and its commits."""

from __future__ import annotations

import pickle

import pytest

from elastrun import inprocess
from elastrun.inprocess import State


class Counter:
    """A stateful object as torch's are: state_dict / load_state_dict."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.value = sd["value"]


def test_rollback_returns_every_item_to_the_last_commit() -> None:
    counter = Counter()
    state = State(counter=counter, step=0, log=[])
    assert state.commit_id == 0
    counter.value, state.step = 5, 5
    state.log.append("a")
    state.commit()
    assert state.commit_id == 1
    counter.value, state.step = 9, 9
    state.log.append("b")
    state.rollback()
    assert (counter.value, state.step, state.log) == (5, 5, ["a"])
    assert state.counter is counter  # the same object, reloaded in place


def test_a_commit_moves_to_another_rank_with_its_number() -> None:
    ahead, behind = State(c=Counter(), step=0), State(c=Counter(), step=0)
    for step in (1, 2, 3):
        ahead.c.value = step * 10
        ahead.step = step
        ahead.commit()
    desc = pickle.loads(pickle.dumps(ahead.describe()))  # as it travels
    behind.adopt(desc, behind.targets(desc))
    assert (behind.c.value, behind.step, behind.commit_id) == (30, 3, 3)
    assert behind.held_commit() == 3


def test_a_process_started_into_a_round_holds_no_commit_until_it_takes_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its commit 0 is what it built, not its peers' commit 0 (which their script may
    # have loaded from a checkpoint): it must take theirs, not offer its own.
    survivor = State(c=Counter(), step=0)
    survivor.c.value, survivor.step = 7, 40  # as loaded from a checkpoint
    survivor = State(c=survivor.c, step=40)
    monkeypatch.setenv("ELASTRUN_INPROCESS_ROUND", "3")
    replacement = State(c=Counter(), step=0)
    assert survivor.held_commit() == 0 and replacement.held_commit() is None
    replacement.rollback()  # (a round superseded before it took the commit)
    assert replacement.held_commit() is None
    desc = pickle.loads(pickle.dumps(survivor.describe()))
    replacement.adopt(desc, replacement.targets(desc))
    assert (replacement.c.value, replacement.step, replacement.held_commit()) == (7, 40, 0)


def test_items_are_attributes_and_private_names_are_refused() -> None:
    state = State(step=1)
    state.lr = 0.1
    assert state.names() == ["lr", "step"]
    with pytest.raises(AttributeError, match="no item"):
        _ = state.missing
    with pytest.raises(AttributeError, match="may not start"):
        state._hidden = 1


def test_outside_elastrun_run_just_calls_the_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTRUN_INPROCESS_SOCKET", raising=False)
    calls: list[int] = []

    @inprocess.run
    def train(state: State, extra: int) -> str:
        calls.append(extra)
        return "done"

    assert train(State(step=0), 7) == "done"
    assert calls == [7]
    with pytest.raises(TypeError, match=r"inprocess\.State"):
        train(object(), 1)
