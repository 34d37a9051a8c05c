"""The binding policy: which CPUs each worker gets, a pure function of the topology.

:func:`select_cpus` maps (mode, topology, local rank, local world size) to a CPU set;
:func:`binding_cpus` adds the options' fallback. The modes are described in the
package's docstring (:mod:`elastrun.supervise.processes.numa`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from elastrun.core.errors import ConfigError
from elastrun.supervise.processes.numa.topology import (
    FIELD,
    Topology,
    format_cpu_list,
    read_topology,
)

__all__ = ["AffinityMode", "NumaOptions", "binding_cpus", "numa_options_from", "select_cpus"]

log = logging.getLogger(__name__)


class AffinityMode(str, enum.Enum):
    """How a worker's CPUs are chosen (the values are the ``--numa-binding`` choices)."""

    NODE = "node"
    SOCKET = "socket"
    EXCLUSIVE = "exclusive"
    CORE_COMPLEX = "core-complex"


@dataclass(frozen=True)
class NumaOptions:
    """NUMA binding settings (torch's ``torch.numa.binding.NumaOptions``).

    Attributes:
        affinity_mode: how CPUs are chosen.
        should_fall_back_if_binding_fails: when binding is impossible (unreadable
            topology, too few cores), log a warning and start the worker unbound
            instead of failing. The CLI never sets it.
    """

    affinity_mode: AffinityMode
    should_fall_back_if_binding_fails: bool = False

    def __post_init__(self) -> None:
        # Accept the mode's string and torch's enum member too, as torch's users pass them.
        object.__setattr__(self, "affinity_mode", _to_mode(self.affinity_mode))


def numa_options_from(value: object) -> NumaOptions | None:
    """Turn what a user may pass as NUMA options into :class:`NumaOptions`.

    Accepts None, our :class:`NumaOptions`, torch's ``NumaOptions`` (duck-typed: any
    object with ``affinity_mode``), an :class:`AffinityMode`, or a mode string.

    Raises:
        ConfigError: an unknown mode or an object of another kind.
    """
    if value is None or isinstance(value, NumaOptions):
        return value
    if isinstance(value, str):  # an AffinityMode is a str too
        return NumaOptions(_to_mode(value))
    mode = getattr(value, "affinity_mode", None)
    if mode is None:
        raise ConfigError("numa_options", value, "expected NumaOptions or a mode name")
    fallback = bool(getattr(value, "should_fall_back_if_binding_fails", False))
    return NumaOptions(mode, fallback)


def _to_mode(value: object) -> AffinityMode:
    """``value`` (a mode, its string, or torch's enum member) as an :class:`AffinityMode`."""
    if isinstance(value, AffinityMode):
        return value
    try:
        return AffinityMode(str(getattr(value, "value", value)))
    except ValueError:
        choices = ", ".join(m.value for m in AffinityMode)
        raise ConfigError(FIELD, value, f"expected one of {choices}") from None


def _node_of(topology: Topology, local_rank: int) -> int:
    if topology.gpu_nodes:
        if local_rank >= len(topology.gpu_nodes):
            raise ConfigError(
                FIELD,
                local_rank,
                f"local rank {local_rank} has no GPU of its own "
                f"(this machine has {len(topology.gpu_nodes)} GPUs)",
            )
        node = topology.gpu_nodes[local_rank]
        if not topology.allowed_on(node):
            raise ConfigError(
                FIELD,
                local_rank,
                f"GPU {local_rank} is on NUMA node {node}, where this process may use no "
                f"CPU (allowed CPUs: {format_cpu_list(topology.allowed_cpus) or 'none'})",
            )
        return node
    usable = topology.usable_nodes()
    if not usable:
        raise ConfigError(
            FIELD,
            format_cpu_list(topology.allowed_cpus),
            "no NUMA node has a CPU this process may use",
        )
    return usable[local_rank % len(usable)]


def _group_by_min(cpus: Iterable[int], groups: Mapping[int, frozenset[int]]) -> dict[int, set[int]]:
    """Group ``cpus`` by the lowest CPU of their group (a CPU with none is alone)."""
    grouped: dict[int, set[int]] = {}
    for cpu in cpus:
        key = min(groups.get(cpu, frozenset({cpu})))
        grouped.setdefault(key, set()).add(cpu)
    return grouped


def _select_socket(topology: Topology, node: int) -> set[int]:
    def socket_of(n: int) -> int:
        first = min(topology.allowed_on(n))
        if first not in topology.cpu_socket:
            raise ConfigError(
                FIELD, AffinityMode.SOCKET.value, f"the socket of CPU {first} is unknown"
            )
        return topology.cpu_socket[first]

    socket = socket_of(node)
    chosen: set[int] = set()
    for other in topology.usable_nodes():
        if socket_of(other) == socket:
            chosen |= topology.allowed_on(other)
    return chosen


def _select_exclusive(topology: Topology, node: int, position: int, sharers: int) -> set[int]:
    cores = _group_by_min(topology.allowed_on(node), topology.cpu_siblings)
    ordered = [cores[key] for key in sorted(cores)]
    share, extra = divmod(len(ordered), sharers)
    if share < 1:
        raise ConfigError(
            FIELD,
            AffinityMode.EXCLUSIVE.value,
            f"NUMA node {node} has {len(ordered)} usable physical cores for "
            f"{sharers} workers; exclusive binding needs at least one core per worker",
        )
    start = position * share + min(position, extra)
    stop = start + share + (1 if position < extra else 0)
    return set().union(*ordered[start:stop])


def _select_core_complex(topology: Topology, node: int, position: int) -> set[int]:
    allowed = topology.allowed_on(node)
    missing = sorted(c for c in allowed if c not in topology.cpu_cache_group)
    if missing:
        raise ConfigError(
            FIELD,
            AffinityMode.CORE_COMPLEX.value,
            f"no cache information for CPUs {format_cpu_list(missing)}",
        )
    groups = _group_by_min(allowed, topology.cpu_cache_group)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    return ordered[position % len(ordered)][1]


def select_cpus(
    mode: AffinityMode | str, topology: Topology, local_rank: int, local_world_size: int
) -> set[int]:
    """The CPUs the worker of ``local_rank`` is bound to (see the module docstring).

    Args:
        mode: the binding mode.
        topology: the machine's layout (:func:`read_topology`).
        local_rank: the worker's local rank, ``0 <= local_rank < local_world_size``.
        local_world_size: how many workers this agent starts.

    Raises:
        ConfigError: binding is impossible: the worker has no GPU, its node has no
            allowed CPU, too few cores for ``exclusive``, missing socket or cache
            information, or an unknown mode.
        ValueError: ``local_rank`` is outside ``[0, local_world_size)``.
    """
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} outside [0, {local_world_size})")
    affinity = _to_mode(mode)
    node = _node_of(topology, local_rank)
    # Never empty: every branch draws from the allowed CPUs of a node that has some.
    if affinity is AffinityMode.NODE:
        return set(topology.allowed_on(node))
    if affinity is AffinityMode.SOCKET:
        return _select_socket(topology, node)
    sharers = [r for r in range(local_world_size) if _node_of(topology, r) == node]
    position = sharers.index(local_rank)
    if affinity is AffinityMode.EXCLUSIVE:
        return _select_exclusive(topology, node, position, len(sharers))
    return _select_core_complex(topology, node, position)


def binding_cpus(
    options: NumaOptions | None,
    local_rank: int,
    local_world_size: int,
    topology: Topology | Callable[[], Topology] = read_topology,
) -> frozenset[int] | None:
    """The CPUs to bind a worker to, or None for no binding.

    Honours ``options.should_fall_back_if_binding_fails``: an impossible binding is
    then logged as a warning and None is returned.

    Args:
        options: the binding settings; None disables binding.
        local_rank: the worker's local rank.
        local_world_size: how many workers this agent starts.
        topology: the machine's layout, or a function that reads it (the default
            reads ``/sys`` and this process's affinity).

    Raises:
        ConfigError: binding is impossible and no fallback was asked for.
    """
    if options is None:
        return None
    try:
        layout = topology() if callable(topology) else topology
        return frozenset(select_cpus(options.affinity_mode, layout, local_rank, local_world_size))
    except ConfigError as exc:
        if not options.should_fall_back_if_binding_fails:
            raise
        log.warning("NUMA binding skipped for local rank %d: %s", local_rank, exc)
        return None
