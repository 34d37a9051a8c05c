"""In-process recovery: when a worker fails, the others keep their processes and state.

    import elastrun.inprocess as inprocess

    state = inprocess.State(model=model, optimizer=optimizer, step=0)

    @inprocess.run
    def train(state):
        dist.init_process_group("gloo")
        ...
        state.step += 1
        state.commit()

    train(state)

Under elastrun, a worker that fails (dies or raises) is replaced by a new process and
the others recover in place: their failed collective raises, the agent confirms that a
peer failed (an error that is the worker's own propagates unchanged), ``run`` rolls the
state back to the last commit, takes the next round's environment, hands the newest
commit to every rank that is behind (the replacement included), tensor by tensor into
its own tensors, and calls the function again. A commit copies no tensor of the model or
optimizer on CPU (see ``inprocess.snapshot``).
Outside elastrun the decorator just calls the function. Sharded training (FSDP2, HSDP)
calls ``state.restore()`` once its model is sharded: a replacement takes its shard
from a replica (HSDP); without one, the state comes from a memory checkpoint
(``elastrun.checkpoint``, with ``rebind``). See docs/inprocess.md.

This package holds both sides of in-process recovery: ``elastrun.inprocess.worker``
is the workers' side, ``elastrun.inprocess.agent`` the agent's. The agent imports its
own side only, so the names below load when first read (importing the package itself
loads nothing of the workers').
"""

from __future__ import annotations

from elastrun.core.lazy import lazy_getattr

# As in elastrun/__init__.py: not typing.TYPE_CHECKING, so that workers skip typing.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from elastrun.inprocess.worker.fsdp import FsdpRebindError, rebind
    from elastrun.inprocess.worker.receive import StateMismatchError
    from elastrun.inprocess.worker.recovery import run
    from elastrun.inprocess.worker.state import RestoreMissingError, State
    from elastrun.inprocess.worker.transfer import CommitLostError, ShardedWorldChangedError

__getattr__ = lazy_getattr(
    __name__,
    {
        "run": "elastrun.inprocess.worker.recovery",
        "rebind": "elastrun.inprocess.worker.fsdp",
        "FsdpRebindError": "elastrun.inprocess.worker.fsdp",
        "State": "elastrun.inprocess.worker.state",
        "StateMismatchError": "elastrun.inprocess.worker.receive",
        "RestoreMissingError": "elastrun.inprocess.worker.state",
        "CommitLostError": "elastrun.inprocess.worker.transfer",
        "ShardedWorldChangedError": "elastrun.inprocess.worker.transfer",
    },
)

__all__ = [
    "CommitLostError",
    "FsdpRebindError",
    "RestoreMissingError",
    "ShardedWorldChangedError",
    "State",
    "StateMismatchError",
    "rebind",
    "run",
]
