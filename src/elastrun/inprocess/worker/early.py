"""A receiver's new tensors, allocated and faulted in before the commit's description
comes.

A replacement takes Adam's moments (two thirds of the state) into tensors it must
allocate, and faulting their pages in costs more than the copy (``inprocess.prefault``).
That work need not wait for the description, which comes only once every rank of the
round has joined its process group: the ranks that hold their commit publish the shapes
of the tensors a fresh rank lacks on the round's store as soon as they reach it (the
first to claim the key writes it), and a rank that is about to receive reads them when
it reaches the store, allocates what it lacks and faults it in on a thread while it joins
the process group. The joining is the replacement's own work, on one core, while the
ranks waiting for it leave the other idle; the replacement is the last to come in
nearly every round, so the shapes are there when it looks.

The shapes are a guess: a rank whose commit is not the newest may have published them,
or none may be there yet. A tensor of the pool is used only where the description
agrees on its item, place, shape and dtype (``State.targets``); the rest is dropped
when the round's exchange ends. A store that fails here is left to the exchange to
report.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from elastrun.inprocess.worker import prefault
from elastrun.inprocess.worker.snapshot import TensorSpec

if TYPE_CHECKING:
    import torch

    from elastrun.inprocess.worker.state import State

#: The round's store keys (under the synchronisation's prefix).
KEY = "shapes"
CLAIM = "shapes/claim"

#: Tensors allocated ahead, by (item name, place in its state dict).
Pool = dict[tuple[str, Any], "torch.Tensor"]


def publish(state: State, store: Any) -> None:
    """Put the shapes of the tensors a fresh rank lacks on ``store`` (a torch store),
    unless another rank claimed the key first. For ranks that hold their commit."""
    if store.add(CLAIM, 1) == 1:
        store.set(KEY, pickle.dumps(state.lacking_specs()))


@contextlib.contextmanager
def ahead(state: State, store: Any) -> Iterator[Pool]:
    """For a rank about to receive: the CPU tensors it lacks according to the published
    shapes, their pages faulted in on a thread until the block ends (an empty pool when
    none are published yet)."""
    pool: Pool = {}
    with contextlib.suppress(RuntimeError):  # the store's errors: the exchange reports them
        if store.check([KEY]):
            published: dict[str, list[TensorSpec]] = pickle.loads(store.get(KEY))
            pool = state.allocate(published)
    with prefault.populating(list(pool.values())):
        yield pool
