"""An FSDP2 model kept through an in-process recovery: ``elastrun.inprocess.rebind``.

A survivor keeps its process, and with it its model: with FSDP2 (``fully_shard``) the
model holds its own shards (DTensors) and, for each parameter group, the process groups
it all-gathers and reduces over. An in-process recovery destroys every process group;
the training function then runs again, makes the world's group and its device mesh
anew, and the model must use the new groups. Two things stand in the way:

* **The groups.** FSDP2 resolves its groups once, from the device mesh, when the model
  is sharded. The mesh itself finds its groups by name, and a mesh made again the same
  way in the new world makes groups of the same names (torch names them by a count that
  starts over with the world: ``inprocess.recovery`` keeps it so). So each parameter
  group's mesh information is resolved again from its mesh.
* **The iteration the failure cut short.** The collective that failed left FSDP2 in the
  middle of a forward or backward pass: parameters unsharded, a reduction's state
  pending, the backward's final callback marked as queued. A fresh replacement has none
  of it, and the ranks would issue different collectives. FSDP2's own reset after an
  aborted iteration (``FSDPModule.reset_iter_state``, on the root) puts every parameter
  group back between iterations, resharded; the failed collectives' results are
  dropped first, so that it does not wait on them.

The model's values are not touched: the training function loads them (from a memory
checkpoint: ``elastrun.checkpoint``), as a replacement does.

FSDP2 keeps its groups in private attributes; this module is written against torch
2.13's and checks what it finds, so that a torch whose FSDP2 differs fails here with a
clear error rather than hang in a collective later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastrun.core.errors import ElastrunError

if TYPE_CHECKING:
    import torch

__all__ = ["FsdpRebindError", "rebind"]


class FsdpRebindError(ElastrunError, RuntimeError):
    """This torch's FSDP2 keeps its state where ``rebind`` does not look."""


def rebind(model: torch.nn.Module) -> int:
    """Point every FSDP2 (``fully_shard``) module of ``model`` at the process groups of
    the current world, and put it back between iterations (see the module's docstring).

    Call it in the training function after the world's group and the device mesh are
    made again, before the model runs: after an in-process recovery a survivor's model
    still refers to the groups of the world that failed. A model that is not sharded
    (or sharded in this world already) is left as it was; calling it on every call of
    the training function is safe. Returns the number of parameter groups rebound.

    Raises:
        FsdpRebindError: FSDP2's state is not where torch 2.13 keeps it.
        ShardedWorldChangedError: the world's size changed (a node was lost, or one
            joined): the shards are laid out for the old one, and the group restarts
            (a memory checkpoint then loads them resharded).
    """
    states = _fsdp_states(model)
    groups = [g for state in states for g in _param_groups(state)]
    for group in groups:
        # The failed iteration's collectives are gone with their groups: nothing of
        # theirs is waited for (their ``Work`` would raise, or wait on a dead peer).
        if not hasattr(group, "_all_gather_result"):
            raise FsdpRebindError("an FSDP2 parameter group without its all-gather state")
        group._all_gather_result = None
    for state in states:
        if getattr(state, "_is_root", None):
            state._reset_iter_state()  # (FSDPModule.reset_iter_state, on the root)
    infos: dict[int, Any] = {}
    for group in groups:
        for owner in (group, *getattr(group, "fsdp_params", ())):
            for name in ("mesh_info", "post_forward_mesh_info"):
                info = getattr(owner, name, None)
                if info is not None:
                    infos[id(info)] = info
    for info in infos.values():
        _resolve_again(info)
    return len(groups)


def _fsdp_states(model: torch.nn.Module) -> list[Any]:
    getters = (getattr(module, "_get_fsdp_state", None) for module in model.modules())
    return [get() for get in getters if callable(get)]


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        raise FsdpRebindError("an FSDP2 state without its parameter groups (torch changed)")
    return list(groups)


def _resolve_again(info: Any) -> None:
    """Resolve the process groups of one FSDP2 mesh information from its mesh (by the
    groups' names, which the new world's mesh registered)."""
    mesh = getattr(info, "mesh", None)
    if mesh is None:
        raise FsdpRebindError("an FSDP2 mesh information without its mesh (torch changed)")
    shard_dim = getattr(info, "shard_mesh_dim", None)
    if shard_dim is not None:
        info.shard_process_group = _group_of(mesh, shard_dim)
        info.shard_mesh_rank = info.shard_process_group.rank()
        if hasattr(info, "reduce_scatter_process_group"):
            info.reduce_scatter_process_group = None
    replicate_dim = getattr(info, "replicate_mesh_dim", None)
    if replicate_dim is not None:
        info.replicate_process_group = _group_of(mesh, replicate_dim)
        info.replicate_mesh_rank = info.replicate_process_group.rank()


def _group_of(mesh: Any, dim: int) -> Any:
    """The new world's group of the mesh's dimension ``dim``, of the size the shards
    were laid out for.

    Raises:
        ShardedWorldChangedError: the new world's group has another size (a node was
            lost, or one joined): the shards of this model cannot be kept.
    """
    group = mesh.get_group(dim)
    laid_out, now = mesh.size(dim), group.size()
    if now != laid_out:
        from elastrun.inprocess.worker.transfer import ShardedWorldChangedError

        raise ShardedWorldChangedError(laid_out, now)
    return group
