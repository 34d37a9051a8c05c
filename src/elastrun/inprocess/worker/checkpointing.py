"""A ``State`` as a checkpoint takes it, and a memory checkpoint as ``State.restore``'s
way back when a shard has no replica.

``State`` is a ``Stateful`` of ``torch.distributed.checkpoint`` (and so of
``elastrun.checkpoint.MemoryCheckpoint``): its modules and optimizers go in by their
parameters' names, through torch's own ``get_model_state_dict`` and
``get_optimizer_state_dict`` (FSDP2's shards as DTensors, an optimizer's state made
before its first step, as DCP needs to load into it), every other stateful item by its
``state_dict()``, and the plain items as they are.

With FSDP2 a rank's shard is in no other rank: when a rank dies, no replica can hand
its shard to the replacement (``inprocess.transfer.decide_sharded``). Given the memory
checkpoint the job saves the State into, ``restore`` then has every rank load the
newest step complete on every rank (the replacement its predecessor's shards, from its
node's memory; the survivors roll back to it), in place.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from elastrun.inprocess.worker.state import State
    from elastrun.inprocess.worker.transfer import CommitLostError

from elastrun.inprocess.worker.receive import is_module, stateful

log = logging.getLogger("elastrun.inprocess")

#: The key under which ``restore`` loads the State from the checkpoint: save it as
#: ``checkpoint.save(step, {"state": state})``.
KEY = "state"


def state_dict(items: dict[str, Any]) -> dict[str, Any]:
    """See ``State.state_dict``."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    out: dict[str, Any] = {}
    for name, value in items.items():
        model = _model_of(value, items)
        if is_module(value):
            out[name] = get_model_state_dict(value)
        elif model is not None:
            out[name] = get_optimizer_state_dict(model, value)
        elif stateful(value):
            out[name] = value.state_dict()
        else:
            out[name] = value
    return out


def load_state_dict(items: dict[str, Any], loaded: dict[str, Any]) -> None:
    """See ``State.load_state_dict``."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for name, value in list(items.items()):
        if name not in loaded:
            continue
        model = _model_of(value, items)
        if is_module(value):
            set_model_state_dict(value, loaded[name])
        elif model is not None:
            set_optimizer_state_dict(model, value, loaded[name])
        elif stateful(value):
            value.load_state_dict(loaded[name])
        else:
            items[name] = loaded[name]


def load_instead(state: State, checkpoint: Any, lost: CommitLostError) -> int:
    """Every rank loads the newest step of ``checkpoint`` into ``state`` (a collective),
    which becomes its commit; the step. Raises ``lost`` when there is none."""
    step = checkpoint.load_latest({KEY: state})
    if step is None:
        raise lost
    state._hold((lost.newest or 0) + 1)
    log.warning(
        "%s; every rank loaded step %d from the memory checkpoint instead, in place",
        str(lost).split(" (", 1)[0], step,
    )  # fmt: skip
    return int(step)


def load_at_start(state: State, checkpoint: Any) -> int | None:
    """At an attempt's start (every process new: the job's start, a group restart),
    every rank loads the newest step of ``checkpoint`` into ``state`` (a collective),
    which becomes its commit; the step (None: there is none, nothing is loaded)."""
    step = checkpoint.load_latest({KEY: state})
    if step is not None:
        state._hold(state.commit_id)
    return None if step is None else int(step)


def _model_of(value: object, items: dict[str, Any]) -> torch.nn.Module | None:
    """The module item whose parameters ``value`` (an optimizer) steps (None: it is no
    optimizer, or steps no module of the State)."""
    groups = getattr(value, "param_groups", None)
    if not groups or is_module(value):
        return None
    params = {id(p) for group in groups for p in group["params"]}
    for item in items.values():
        if is_module(item) and params <= {id(p) for p in item.parameters()}:
            return item  # type: ignore[no-any-return]  # a torch.nn.Module, checked
    return None
