"""A commit as the ranks that take it learn of it, and where they receive its tensors:
their own, or new ones shaped as the sender's (an optimizer's state before its first
step; a DTensor sharded as its parameter is)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastrun.core.errors import ElastrunError
from elastrun.inprocess.worker import rng
from elastrun.inprocess.worker.snapshot import TensorSpec, local

if TYPE_CHECKING:
    import torch

__all__ = [
    "CommitDescription",
    "StateMismatchError",
    "dtype_of",
    "is_module",
    "new_tensor",
    "stateful",
    "where",
]


@dataclass(frozen=True)
class CommitDescription:
    """A commit as the ranks that take it first learn of it: everything but the
    tensors' bytes (plain values, small enough to pickle), and each tensor's spec."""

    commit: int
    plain: dict[str, Any]  # the items that are plain values
    skeletons: dict[str, Any]  # each stateful item's state dict, tensors as slots
    specs: dict[str, list[TensorSpec]]
    modules: frozenset[str]
    rng: rng.RngState | None


class StateMismatchError(ElastrunError, ValueError):
    """A rank's objects do not have the shapes of the commit it must take (it built
    its model or optimizer differently from the rank that sends the commit)."""


def new_tensor(
    name: str, value: Any, own: dict[Any, torch.Tensor], spec: TensorSpec, pool: dict[Any, Any]
) -> torch.Tensor:
    """A tensor for an entry of ``spec`` that item ``value`` lacks (an optimizer's state
    before its first step): from ``pool`` where it fits; a DTensor sharded as its
    parameter is where the sender's was one."""
    import torch

    dtype = dtype_of(spec.dtype)
    device = _home_device(value, own) if spec.device_type != "cpu" else torch.device("cpu")
    early: torch.Tensor | None = pool.pop((name, spec.path), None)
    wanted = (spec.shape, dtype, device)
    if early is None or (tuple(early.shape), early.dtype, early.device) != wanted:
        early = torch.empty(spec.shape, dtype=dtype, device=device)
    if not spec.sharded:
        return early
    param = _param_of(value, spec.path)
    if param is None or tuple(local(param).shape) != spec.shape:
        raise StateMismatchError(
            f"{name}: the commit has a shard {list(spec.shape)} at {where(spec.path)}; "
            f"this rank has no parameter sharded so (shard the model the same way on "
            f"every rank, before State.restore())"
        )
    from torch.distributed.tensor import DTensor

    made: torch.Tensor = DTensor.from_local(
        early, param.device_mesh, param.placements, run_check=False,
        shape=param.size(), stride=param.stride(),
    )  # fmt: skip
    return made


def _param_of(value: Any, path: tuple[object, ...]) -> Any:
    """The parameter an optimizer's state entry at ``path`` (``("state", index,
    name)``) belongs to: torch numbers an optimizer's parameters in its groups'
    order."""
    if len(path) < 2 or path[0] != "state" or not isinstance(path[1], int):
        return None
    params = [p for group in getattr(value, "param_groups", ()) for p in group["params"]]
    index = path[1]
    return params[index] if 0 <= index < len(params) else None


def _home_device(value: object, own: dict[Any, torch.Tensor]) -> torch.device:
    """Where a new tensor of ``value`` goes: its parameters' device."""
    import torch

    for group in getattr(value, "param_groups", None) or ():
        for p in group.get("params", ()):
            if isinstance(p, torch.Tensor):
                return p.device
    for t in own.values():
        return t.device
    return torch.device("cpu")


def dtype_of(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise StateMismatchError(f"unknown dtype in the commit: {name!r}")
    return dtype


def where(path: tuple[object, ...]) -> str:
    return "/".join(str(p) for p in path)


def stateful(value: object) -> bool:
    """Whether ``value`` has ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def is_module(value: object) -> bool:
    import torch

    return isinstance(value, torch.nn.Module)
