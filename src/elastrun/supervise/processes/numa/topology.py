"""The machine's CPU and GPU layout, read from sysfs into a :class:`Topology` value.

NUMA nodes and their CPUs, sockets, hyper-thread siblings, cache groups, the CPUs this
process may use, and the NUMA node of every GPU (NVIDIA or AMD display/3D controllers
under ``/sys/bus/pci/devices``, in PCI-address order). Also the kernel's CPU-list format.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastrun.core.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["FIELD", "Topology", "format_cpu_list", "parse_cpu_list", "read_topology"]

#: The option that every binding error names.
FIELD = "--numa-binding"

# PCI vendor ids of GPU makers whose devices torch enumerates as CUDA/ROCm devices.
_GPU_VENDORS = frozenset({"0x10de", "0x1002"})  # NVIDIA, AMD
# PCI class prefixes of display controllers: VGA (0x0300), 3D (0x0302), other (0x0380).
# NVSwitches and audio functions of the same cards have other classes and are skipped.
_GPU_CLASSES = ("0x0300", "0x0302", "0x0380")


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
        first, last = int(low), int(high if sep else low)
        if last < first:
            raise ValueError(f"descending CPU range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """Format CPUs as compact ranges: ``{0, 1, 2, 5}`` -> ``"0-2,5"`` (empty: ``""``)."""
    ranges: list[str] = []
    # Consecutive CPUs keep the same difference to their index in the sorted list.
    for _, group in itertools.groupby(enumerate(sorted(set(cpus))), lambda p: p[1] - p[0]):
        run = [cpu for _, cpu in group]
        ranges.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(ranges)


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
    from pathlib import Path  # only --numa-binding reads sysfs: off a plain launch's path

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
