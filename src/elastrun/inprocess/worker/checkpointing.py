"""A ``State`` as a checkpoint takes it.

``State`` is a ``Stateful`` of ``torch.distributed.checkpoint`` (and so of
``elastrun.checkpoint.MemoryCheckpoint``): its modules and optimizers go in by their
parameters' names, through torch's own ``get_model_state_dict`` and
``get_optimizer_state_dict`` (FSDP2's shards as DTensors, an optimizer's state made
before its first step, as DCP needs to load into it), every other stateful item by its
``state_dict()``, and the plain items as they are. (``State.restore`` loads a memory
checkpoint of it when a shard has no replica: ``inprocess.worker.sharded``.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from elastrun.inprocess.worker.receive import is_module, stateful


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
