"""A commit without a second copy of the state: what it copies, how a rank tells that
its live state is still its commit, and how a commit is taken into another rank's own
tensors (no processes: the transfer's bytes are copied by hand)."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from elastrun.inprocess import State
from elastrun.inprocess.worker.receive import StateMismatchError
from elastrun.inprocess.worker.transfer import (
    CHUNK,
    CommitLostError,
    chunks,
    decide,
    decide_sharded,
)

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")


def _model(width: int = 32) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.BatchNorm1d(width), torch.nn.Dropout(0.5),
        torch.nn.Linear(width, 1),
    )  # fmt: skip


def _first_layer(model: torch.nn.Sequential) -> torch.nn.Linear:
    layer = model[0]
    assert isinstance(layer, torch.nn.Linear)
    return layer


def _step(model: torch.nn.Sequential, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    inputs = _first_layer(model).in_features
    model(torch.randn(4, inputs)).sum().backward()
    opt.step()


def _bytes(*tensors: torch.Tensor) -> list[bytes]:
    return [t.detach().numpy().tobytes() for t in tensors]


def _everything(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    live = list(model.state_dict().values())
    live += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return _bytes(*live)


def test_a_commit_copies_the_buffers_but_not_the_parameters_or_the_optimizer_state() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256))
    opt = torch.optim.Adam(model.parameters())
    state = State(model=model, optimizer=opt, step=0)
    _step(model, opt)
    state.commit()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    steps = 4 * len(opt.state)  # Adam's step counters (a float each)
    assert state.copied_bytes() == buffers + steps
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert buffers < 0.05 * 3 * params  # the parameters and Adam's two moments


def test_a_forward_pass_after_a_commit_is_rolled_back_and_the_commit_stays_intact() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = State(model=model, optimizer=opt, step=0)
    _step(model, opt)
    state.commit()
    committed, draw = _everything(model, opt), torch.rand(3)
    model(torch.randn(4, 8)).sum().backward()  # the batch-norm statistics move, dropout draws
    state.rollback()  # ... and the all-reduce of the gradients failed
    assert state.held_commit() == 1
    assert _everything(model, opt) == committed
    assert torch.equal(torch.rand(3), draw)  # the generator as at the commit


def _broadcast_in_place(model: torch.nn.Module) -> None:
    """What DDP's construction does to every rank: rank 0's values copied in place (the
    same values here), each parameter's version counter bumped."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.clone())


@pytest.mark.parametrize("failure", ["in-the-first-step", "in-the-setup"])
def test_the_setup_after_a_recovery_rewriting_the_commit_in_place_keeps_it_intact(
    failure: str,
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = State(model=model, optimizer=opt, step=0)
    _step(model, opt)
    state.commit()
    committed = _everything(model, opt)
    state.rollback()  # a peer failed; the state synchronisation follows, then the setup
    state._after_sync()
    _broadcast_in_place(model)
    if failure == "in-the-first-step":
        model(torch.randn(4, 8)).sum().backward()  # ... and the all-reduce fails
    state.rollback()
    assert state.held_commit() == 1
    assert _everything(model, opt) == committed


@pytest.mark.parametrize("when", ["after-a-commit", "after-the-first-forward"])
def test_an_in_place_write_outside_the_setup_still_means_the_rank_no_longer_holds_it(
    when: str,
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = State(model=model, optimizer=opt, step=0)
    _step(model, opt)
    state.commit()
    if when == "after-the-first-forward":
        state._after_sync()
        model(torch.randn(4, 8))
    _broadcast_in_place(model)  # (user code writing parameters in place)
    model(torch.randn(4, 8)).sum().backward()
    state.rollback()
    assert state.held_commit() is None


def test_an_optimizer_step_in_the_setup_is_not_taken_as_the_commit() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = State(model=model, optimizer=opt, step=0)
    state._after_sync()
    _step(model, opt)
    state.rollback()
    assert state.held_commit() is None


@pytest.mark.parametrize("kind", ["sgd", "adam-foreach", "adam-fused"])
def test_an_optimizer_step_after_the_commit_means_the_rank_no_longer_holds_it(kind: str) -> None:
    model = _model()
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        fused = kind == "adam-fused"
        opt = torch.optim.Adam(model.parameters(), fused=fused, foreach=not fused)
    state = State(model=model, optimizer=opt, step=0)
    _step(model, opt)
    state.commit()
    _step(model, opt)  # (a collective after the step failed)
    state.rollback()
    assert state.held_commit() is None


def test_with_copy_state_an_optimizer_step_after_the_commit_is_rolled_back() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    state = State(model=model, optimizer=opt, step=0, copy_state=True)
    _step(model, opt)
    state.commit()
    committed = _everything(model, opt)
    _step(model, opt)
    state.rollback()
    assert state.held_commit() == 1 and _everything(model, opt) == committed
    first = [leaf.saved for leaf in state._snap["model"].leaves]
    state.commit()  # the copies are reused, not made anew
    assert [leaf.saved for leaf in state._snap["model"].leaves] == first


def test_a_replacement_takes_a_commit_into_its_own_tensors_and_allocates_adams_state() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    ahead = State(model=model, optimizer=opt, step=0)
    for step in range(3):
        _step(model, opt)
        ahead.step = step + 1
        ahead.commit()
    fresh_model = _model()
    fresh_opt = torch.optim.Adam(fresh_model.parameters())  # no state yet
    fresh = State(model=fresh_model, optimizer=fresh_opt, step=0)
    desc = pickle.loads(pickle.dumps(ahead.describe()))
    targets = fresh.targets(desc)
    weight = _first_layer(fresh_model).weight
    assert any(t.data_ptr() == weight.data_ptr() for t in targets)  # in place
    for target, source in zip(targets, ahead.commit_tensors(), strict=True):
        target.copy_(source)  # what the broadcast does
    fresh.adopt(desc, targets)
    assert _first_layer(fresh_model).weight is weight
    assert _everything(fresh_model, fresh_opt) == _everything(model, opt)
    assert (fresh.step, fresh.commit_id, fresh.held_commit()) == (3, 3, 3)
    torch.manual_seed(1)
    _step(model, opt)
    torch.manual_seed(1)
    _step(fresh_model, fresh_opt)  # both go on alike
    assert _everything(fresh_model, fresh_opt) == _everything(model, opt)


def test_a_replacement_allocates_adams_state_ahead_and_takes_what_the_commit_agrees_on() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    ahead = State(model=model, optimizer=opt, step=0)
    _step(model, opt)
    ahead.commit()
    published = pickle.loads(pickle.dumps(ahead.lacking_specs()))
    assert set(published) == {"optimizer"}  # a module's tensors exist once it is built
    fresh_model = _model()
    fresh_opt = torch.optim.Adam(fresh_model.parameters())
    fresh = State(model=fresh_model, optimizer=fresh_opt, step=0)
    pool = fresh.allocate(published)
    # Adam's two moments and its step counter for each of the six parameters.
    assert len(pool) == 3 * 6 and all(key[0] == "optimizer" for key in pool)
    wrong_key = next(key for key, t in pool.items() if t.dim() == 2)
    pool[wrong_key] = torch.empty(1, 1)  # a guess the description does not agree on
    early = {id(t) for t in pool.values()}
    targets = fresh.targets(ahead.describe(), pool)
    assert sum(id(t) in early for t in targets) == 3 * 6 - 1 and not pool
    for target, source in zip(targets, ahead.commit_tensors(), strict=True):
        target.copy_(source)
    fresh.adopt(ahead.describe(), targets)
    assert _everything(fresh_model, fresh_opt) == _everything(model, opt)
    # A rank that has the state already allocates nothing.
    assert ahead.allocate(published) == {}


def test_a_replacement_built_differently_is_told_which_tensor_does_not_fit() -> None:
    ahead = State(model=_model(32))
    other = State(model=_model(16))
    with pytest.raises(StateMismatchError, match=r"model: 0\.weight is \[16, 8\]"):
        other.targets(ahead.describe())


def test_the_newest_intact_commit_is_taken_from_every_rank_that_holds_it() -> None:
    plan = decide([(7, True), (0, True), (7, True), (6, True)])
    assert (plan.commit, plan.sources, plan.receivers) == (7, (0, 2), (1, 3))
    plan = decide([(7, False), (7, True), (0, True)])  # rank 0's optimizer stepped
    assert (plan.sources, plan.receivers) == ((1,), (0, 2))
    with pytest.raises(CommitLostError, match="rank 0's state moved on past its commit 7"):
        decide([(7, False), (0, True)])


def test_a_sharded_commit_moves_only_between_the_ranks_of_one_shard() -> None:
    # HSDP 2 x 2: ranks 0 and 2 hold shard "a", ranks 1 and 3 shard "b". Rank 1 is a
    # replacement (commit 0, held by nobody): it takes commit 7 from rank 3 only.
    plans = decide_sharded([(7, True, "a"), (0, False, "b"), (7, True, "a"), (7, True, "b")])
    assert [(p.commit, p.sources, p.receivers) for p in plans] == [
        (7, (0, 2), ()), (7, (3,), (1,)),
    ]  # fmt: skip
    # A whole replica group replaced: each takes its shard from the other group.
    plans = decide_sharded([(0, False, "a"), (0, False, "b"), (7, True, "a"), (7, True, "b")])
    assert [(p.sources, p.receivers) for p in plans] == [((2,), (0,)), ((3,), (1,))]
    # A rank of a shard one commit behind takes the newest from its replica.
    plans = decide_sharded([(7, True, "a"), (6, True, "b"), (7, True, "a"), (7, True, "b")])
    assert [(p.sources, p.receivers) for p in plans] == [((0, 2), ()), ((3,), (1,))]


def test_a_shard_that_no_rank_holds_at_the_newest_commit_is_lost() -> None:
    # FSDP2: every rank its own shard; the replacement's is nowhere.
    with pytest.raises(CommitLostError, match="shard of rank 2 holds commit 7 intact"):
        decide_sharded([(7, True, 0), (7, True, 1), (0, False, 2), (7, True, 3)])
    # Both replicas of shard "b" lost.
    with pytest.raises(CommitLostError, match="shard of ranks 1, 3 holds commit 7"):
        decide_sharded([(7, True, "a"), (0, False, "b"), (7, True, "a"), (0, False, "b")])
    # Every rank must end on the same commit: shard "b" holds only an older one.
    with pytest.raises(CommitLostError, match="shard of ranks 1, 3 holds commit 7"):
        decide_sharded([(7, True, "a"), (6, True, "b"), (7, True, "a"), (6, True, "b")])


def test_the_chunks_are_split_across_the_sources() -> None:
    per = CHUNK // 4
    parts = chunks([(3 * per, 4), (10, 4)], (0, 2))
    assert [(c.tensor, c.start, c.stop, c.source) for c in parts] == [
        (0, 0, per, 0), (0, per, 2 * per, 2), (0, 2 * per, 3 * per, 0), (1, 0, 10, 2),
    ]  # fmt: skip


def test_a_commit_is_read_from_a_process_memory_or_refused_for_another_machine() -> None:
    from elastrun.inprocess.worker import local_copy

    source = [torch.arange(10_000, dtype=torch.float32), torch.ones(3, 5, dtype=torch.int64)]
    where = local_copy.whereabouts(source)  # (this very process stands for the sender)
    targets = [torch.zeros_like(t) for t in source]
    parts = [(0, 0, 16_000, 0), (0, 16_000, 40_000, 0), (1, 0, 120, 0)]  # bytes
    assert local_copy.read_chunks(targets, parts, {0: where})
    assert all(torch.equal(a, b) for a, b in zip(source, targets, strict=True))
    elsewhere = local_copy.Whereabouts("another-boot/pid:[1]", where.pid, where.spans)
    assert not local_copy.read_chunks(targets, parts, {0: elsewhere})
    assert local_copy.whereabouts(None).spans is None


def test_new_tensors_are_populated_from_their_end_without_changing_a_byte() -> None:
    from elastrun.inprocess.worker import prefault

    fresh = torch.empty(3 * prefault.SLICE // 8 + 1000, dtype=torch.float32)  # 1.5 slices
    written = torch.arange(prefault.MINIMUM // 4, dtype=torch.float64)  # already touched
    small, gpu = torch.empty(10), torch.empty(prefault.MINIMUM, device="meta")
    pieces = prefault.spans([written, small, fresh, gpu])
    begin, end = fresh.data_ptr(), fresh.data_ptr() + fresh.numel() * 4
    top, bottom = pieces[0], pieces[1]  # the last tensor first, from its last page
    assert top == (end // 4096 * 4096 - prefault.SLICE, prefault.SLICE)
    assert bottom == (-(-begin // 4096) * 4096, top[0] - -(-begin // 4096) * 4096)
    assert len(pieces) == 3 and written.data_ptr() <= pieces[2][0]  # no small one
    with prefault.populating([written, small, fresh]):
        pass
    assert torch.equal(written, torch.arange(prefault.MINIMUM // 4, dtype=torch.float64))


# -- which errors a worker asks the agent about ------------------------------------------


def _raised(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except BaseException as exc:
        return exc
    raise AssertionError("nothing was raised")


def test_only_an_error_that_torch_raised_may_be_a_peers_failure() -> None:
    from elastrun.inprocess.worker.recovery import _raised_by_torch

    def users() -> None:
        raise RuntimeError("gloo socket closed by user code")

    def torchs() -> None:
        torch.autograd.grad(torch.ones(1), torch.ones(1))  # no graph: torch raises

    def wrapped() -> None:
        try:
            torchs()
        except RuntimeError as exc:
            raise RuntimeError("the step failed") from exc

    assert not _raised_by_torch(_raised(users))
    assert _raised_by_torch(_raised(torchs))
    assert _raised_by_torch(_raised(wrapped))  # the user's wrapper of torch's error
