"""NUMA binding: choose the CPUs each worker may run on, and bind it to them.

``--numa-binding MODE`` keeps every worker (and its threads) on CPUs close to its GPU,
so its host memory stays local. The work is split into a pure plan and a thin executor:

* :func:`read_topology` reads the machine's layout from sysfs into a :class:`Topology`
  value (NUMA nodes and their CPUs, sockets, hyper-thread siblings, cache groups, the
  CPUs this process may use, and the NUMA node of every GPU);
* :func:`select_cpus` is a pure function of (mode, topology, local rank, local world
  size) -- unit-tested on synthetic topologies;
* :func:`wrap_command` prefixes a binary worker's argv with ``numactl
  --physcpubind=...``; :func:`apply_affinity` binds a function worker in its own
  process with ``sched_setaffinity``.

Which NUMA node a worker belongs to:

* **with GPUs** (NVIDIA or AMD display/3D controllers found under
  ``/sys/bus/pci/devices``), local rank *i* uses GPU *i*, as torchrun assumes, and the
  worker belongs to that GPU's NUMA node (a node of -1, which firmware reports on
  single-node machines, counts as node 0);
* **without GPUs** (a CPU-only job), local rank *i* belongs to the *i mod n*-th of the
  *n* NUMA nodes that have CPUs this process may use, so the workers are spread
  round-robin over the nodes. torchrun cannot bind CPU-only jobs at all.

The modes (torch's names and values, see :class:`AffinityMode`):

* ``node``: every allowed CPU of the worker's node;
* ``socket``: every allowed CPU of every node on the same socket as the worker's node;
* ``exclusive``: the node's physical cores are split evenly among the workers of that
  node, in local-rank order, lower ranks taking the leftover cores; a worker gets every
  allowed hyper-thread of its cores. Fewer cores than workers is an error;
* ``core-complex``: the node's CPUs are grouped by the highest-level data/unified cache
  they share (an AMD CCX, an Intel sub-NUMA cluster); the groups are ordered biggest
  first, then by lowest CPU, and the *k*-th worker of the node takes group *k mod
  groups*.

Two deliberate differences from torchrun: ``exclusive`` and ``core-complex`` share the
node among the workers actually started on it (torchrun shares it among every GPU on
the node, so ``--nproc-per-node 4`` on an 8-GPU machine wastes half the cores), and
function workers do not need ``numactl`` installed (they bind themselves).

Known limitation: GPUs are found and ordered by PCI address, which is CUDA's order on
machines with identical GPUs. ``CUDA_VISIBLE_DEVICES`` with integer indices is honoured;
UUIDs cannot be mapped to PCI addresses without the vendor library, so they are an
error (or a fallback to no binding when asked). A container that sees every host GPU in
sysfs but only some of them as devices gets the host's numbering; pass
``gpu_nodes=...`` to :func:`read_topology` there.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elastrun.core.errors import ConfigError

__all__ = [
    "AffinityMode",
    "NumaOptions",
    "Topology",
    "apply_affinity",
    "binding_cpus",
    "format_cpu_list",
    "numa_options_from",
    "parse_cpu_list",
    "read_topology",
    "select_cpus",
    "wrap_command",
]

log = logging.getLogger(__name__)

FIELD = "--numa-binding"

# PCI vendor ids of GPU makers whose devices torch enumerates as CUDA/ROCm devices.
_GPU_VENDORS = frozenset({"0x10de", "0x1002"})  # NVIDIA, AMD
# PCI class prefixes of display controllers: VGA (0x0300), 3D (0x0302), other (0x0380).
# NVSwitches and audio functions of the same cards have other classes and are skipped.
_GPU_CLASSES = ("0x0300", "0x0302", "0x0380")


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
        should_fall_back_if_binding_fails: when binding is impossible (no ``numactl``,
            unreadable topology, too few cores), log a warning and start the worker
            unbound instead of failing. The CLI never sets it.
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


# ----------------------------------------------------------------------------- cpu lists


def parse_cpu_list(text: str) -> set[int]:
    """Parse a kernel CPU list such as ``"0-3,8,10-11"`` (empty text: no CPU).

    Raises:
        ValueError: malformed text.
    """
    cpus: set[int] = set()
    for raw in text.strip().split(","):
        part = raw.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        if sep:
            first, last = int(low), int(high)
            if last < first:
                raise ValueError(f"descending CPU range {part!r}")
            cpus.update(range(first, last + 1))
        else:
            cpus.add(int(low))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """Format CPUs as compact ranges: ``{0, 1, 2, 5}`` -> ``"0-2,5"`` (empty: ``""``)."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        first, last = ordered[start], ordered[end]
        ranges.append(str(first) if first == last else f"{first}-{last}")
        start = end + 1
    return ",".join(ranges)


# ----------------------------------------------------------------------------- topology


@dataclass(frozen=True)
class Topology:
    """The CPU layout of a machine, as far as binding needs it.

    Attributes:
        node_cpus: NUMA node -> all its CPUs (whether or not this process may use them).
        cpu_socket: CPU -> socket (``physical_package_id``); CPUs whose socket is
            unknown are absent.
        cpu_siblings: CPU -> the hardware threads of its physical core (itself
            included); CPUs without that information are absent (one thread per core).
        cpu_cache_group: CPU -> the CPUs sharing its highest-level data or unified
            cache; CPUs without cache information are absent.
        allowed_cpus: the CPUs this process may run on (its affinity mask).
        gpu_nodes: the NUMA node of each GPU, in GPU-index order; empty on a machine
            without GPUs.
    """

    node_cpus: Mapping[int, frozenset[int]]
    cpu_socket: Mapping[int, int] = field(default_factory=dict)
    cpu_siblings: Mapping[int, frozenset[int]] = field(default_factory=dict)
    cpu_cache_group: Mapping[int, frozenset[int]] = field(default_factory=dict)
    allowed_cpus: frozenset[int] = frozenset()
    gpu_nodes: tuple[int, ...] = ()

    def allowed_on(self, node: int) -> frozenset[int]:
        """The CPUs of ``node`` this process may use."""
        return self.node_cpus.get(node, frozenset()) & self.allowed_cpus

    def usable_nodes(self) -> list[int]:
        """NUMA nodes with at least one allowed CPU, in ascending order."""
        return sorted(n for n in self.node_cpus if self.allowed_on(n))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _read_cpu_list(path: Path) -> set[int] | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise ConfigError(FIELD, str(path), f"unreadable CPU list {text.strip()!r}") from exc


def _numbered(directory: Path, prefix: str) -> list[int]:
    """The N of every ``<prefix>N`` entry of ``directory`` (none if it is missing)."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    suffixes = (name[len(prefix) :] for name in names if name.startswith(prefix))
    return sorted(int(s) for s in suffixes if s.isdecimal())


def _read_nodes(sys_root: Path) -> dict[int, frozenset[int]]:
    node_dir = sys_root / "devices/system/node"
    nodes: dict[int, frozenset[int]] = {}
    for node in _numbered(node_dir, "node"):
        cpus = _read_cpu_list(node_dir / f"node{node}" / "cpulist")
        if cpus is not None:
            nodes[node] = frozenset(cpus)
    if nodes:
        return nodes
    # A kernel built without NUMA support has no node directory: the whole machine is
    # one node, which makes every mode meaningful (node binding = no restriction).
    online = _read_cpu_list(sys_root / "devices/system/cpu/online")
    if online is None:
        online = set(_numbered(sys_root / "devices/system/cpu", "cpu"))
    return {0: frozenset(online)} if online else {}


def _highest_cache_group(cache_dir: Path) -> frozenset[int] | None:
    best_level = -1
    best: set[int] | None = None
    for index in _numbered(cache_dir, "index"):
        entry = cache_dir / f"index{index}"
        kind = (_read(entry / "type") or "").strip()
        if kind not in ("Data", "Unified"):
            continue  # instruction caches say nothing about data locality
        level_text = (_read(entry / "level") or "").strip()
        if not level_text.isdecimal() or int(level_text) <= best_level:
            continue
        shared = _read_cpu_list(entry / "shared_cpu_list")
        if shared:
            best_level, best = int(level_text), shared
    return None if best is None else frozenset(best)


def _read_cpu_details(
    sys_root: Path, cpus: Iterable[int]
) -> tuple[dict[int, int], dict[int, frozenset[int]], dict[int, frozenset[int]]]:
    sockets: dict[int, int] = {}
    siblings: dict[int, frozenset[int]] = {}
    caches: dict[int, frozenset[int]] = {}
    for cpu in cpus:
        base = sys_root / f"devices/system/cpu/cpu{cpu}"
        package = (_read(base / "topology/physical_package_id") or "").strip()
        if package.lstrip("-").isdecimal():
            sockets[cpu] = int(package)
        threads = _read_cpu_list(base / "topology/thread_siblings_list")
        if threads:
            siblings[cpu] = frozenset(threads | {cpu})
        group = _highest_cache_group(base / "cache")
        if group is not None:
            caches[cpu] = group
    return sockets, siblings, caches


def _visible_indices(visible_devices: str | None, count: int) -> list[int]:
    """GPU indices selected by ``CUDA_VISIBLE_DEVICES`` (None or empty entries: all)."""
    if visible_devices is None:
        return list(range(count))
    picked: list[int] = []
    for raw in visible_devices.split(","):
        item = raw.strip()
        if not item:
            break
        try:
            index = int(item)
        except ValueError:
            raise ConfigError(
                FIELD,
                visible_devices,
                "CUDA_VISIBLE_DEVICES names GPUs by UUID, which cannot be mapped to PCI "
                "devices without the vendor library; use integer indices",
            ) from None
        # CUDA itself stops at the first index that does not exist.
        if index < 0 or index >= count:
            break
        picked.append(index)
    return picked


def _read_gpu_nodes(sys_root: Path, visible_devices: str | None) -> tuple[int, ...]:
    pci_dir = sys_root / "bus/pci/devices"
    try:
        addresses = sorted(os.listdir(pci_dir))
    except (FileNotFoundError, NotADirectoryError):
        return ()
    nodes: list[int] = []
    for address in addresses:
        device = pci_dir / address
        vendor = (_read(device / "vendor") or "").strip().lower()
        klass = (_read(device / "class") or "").strip().lower()
        if vendor not in _GPU_VENDORS or not klass.startswith(_GPU_CLASSES):
            continue
        node_text = (_read(device / "numa_node") or "-1").strip()
        try:
            node = int(node_text)
        except ValueError:
            node = -1
        # -1 means "firmware did not say", which is what single-node machines report.
        nodes.append(max(node, 0))
    return tuple(nodes[i] for i in _visible_indices(visible_devices, len(nodes)))


def read_topology(
    sys_root: str | os.PathLike[str] = "/sys",
    *,
    allowed_cpus: Iterable[int] | None = None,
    visible_devices: str | None = None,
    gpu_nodes: Sequence[int] | None = None,
) -> Topology:
    """Read the machine's CPU and GPU layout from sysfs.

    Args:
        sys_root: where sysfs is mounted (a directory tree of the same shape in tests).
        allowed_cpus: the CPUs this process may use; ``os.sched_getaffinity(0)`` by
            default.
        visible_devices: the value of ``CUDA_VISIBLE_DEVICES`` for the workers, if set.
        gpu_nodes: the NUMA node of each GPU, overriding the PCI scan.

    Raises:
        ConfigError: no NUMA node or CPU could be found, a CPU list is malformed, or
            ``visible_devices`` cannot be interpreted.
    """
    root = Path(sys_root)
    nodes = _read_nodes(root)
    if not nodes:
        raise ConfigError(FIELD, str(root), "no CPU topology found under this sysfs root")
    all_cpus = sorted(set().union(*nodes.values()))
    sockets, siblings, caches = _read_cpu_details(root, all_cpus)
    allowed = os.sched_getaffinity(0) if allowed_cpus is None else set(allowed_cpus)
    gpus = tuple(gpu_nodes) if gpu_nodes is not None else _read_gpu_nodes(root, visible_devices)
    return Topology(
        node_cpus=nodes,
        cpu_socket=sockets,
        cpu_siblings=siblings,
        cpu_cache_group=caches,
        allowed_cpus=frozenset(allowed),
        gpu_nodes=gpus,
    )


# ----------------------------------------------------------------------------- selection


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


def _ranks_on_node(topology: Topology, node: int, local_world_size: int) -> list[int]:
    return [r for r in range(local_world_size) if _node_of(topology, r) == node]


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
    if affinity is AffinityMode.NODE:
        cpus = set(topology.allowed_on(node))
    elif affinity is AffinityMode.SOCKET:
        cpus = _select_socket(topology, node)
    else:
        sharers = _ranks_on_node(topology, node, local_world_size)
        position = sharers.index(local_rank)
        if affinity is AffinityMode.EXCLUSIVE:
            cpus = _select_exclusive(topology, node, position, len(sharers))
        else:
            cpus = _select_core_complex(topology, node, position)
    if not cpus:  # every branch draws from allowed CPUs of a usable node; be explicit
        raise ConfigError(FIELD, affinity.value, f"no CPU left for local rank {local_rank}")
    return cpus


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


# ----------------------------------------------------------------------------- executors


def wrap_command(
    argv: Sequence[str],
    cpus: Iterable[int],
    *,
    fallback: bool = False,
    which: Callable[[str], str | None] = shutil.which,
) -> tuple[str, ...]:
    """Prefix ``argv`` with ``numactl --physcpubind=<cpus>``.

    ``numactl`` replaces itself with the command (exec), so the worker keeps the pid
    the agent started, and every thread it creates inherits the binding.

    Args:
        argv: the worker's command line.
        cpus: the CPUs to bind to (non-empty).
        fallback: when ``numactl`` is not installed, log a warning and return ``argv``
            unchanged instead of raising.
        which: how to look an executable up on PATH (injected by tests).

    Raises:
        ConfigError: ``numactl`` is missing (without ``fallback``) or ``cpus`` is empty.
    """
    cpu_list = format_cpu_list(cpus)
    if not cpu_list:
        raise ConfigError(FIELD, cpu_list, "cannot bind a worker to an empty set of CPUs")
    if which("numactl") is None:
        reason = "binding a command needs the numactl executable, which is not on PATH"
        if fallback:
            log.warning("NUMA binding skipped: %s", reason)
            return tuple(argv)
        raise ConfigError(FIELD, "numactl", f"{reason} (install the numactl package)")
    return ("numactl", f"--physcpubind={cpu_list}", *argv)


def apply_affinity(cpus: Iterable[int], *, task_dir: str = "/proc/self/task") -> None:
    """Bind the calling process to ``cpus`` (for function workers, before the function).

    The calling thread is bound, then every other thread of the process whose affinity
    is still the calling thread's original one; a thread that some library already
    pinned elsewhere is left alone on purpose.

    Args:
        cpus: the CPUs to bind to (non-empty).
        task_dir: where the process's threads are listed (``/proc/self/task``).

    Raises:
        ConfigError: ``cpus`` is empty or the kernel refused the calling thread's new
            affinity (CPUs outside this process's cpuset).
    """
    wanted = set(cpus)
    if not wanted:
        raise ConfigError(FIELD, "", "cannot bind a worker to an empty set of CPUs")
    original = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, wanted)
    except OSError as exc:
        raise ConfigError(
            FIELD, format_cpu_list(wanted), f"the kernel refused the binding: {exc.strerror}"
        ) from exc
    own_tid = threading.get_native_id()
    for name in os.listdir(task_dir):
        if not name.isdecimal() or int(name) == own_tid:
            continue
        tid = int(name)
        try:
            if os.sched_getaffinity(tid) == original:
                os.sched_setaffinity(tid, wanted)
        except (ProcessLookupError, PermissionError) as exc:
            # The thread ended between listing and binding (or belongs to a sandboxed
            # helper we may not touch): nothing of ours runs there any more.
            log.debug("thread %d not bound: %s", tid, exc)
