"""NUMA binding: choose the CPUs each worker may run on, and bind it to them.

``--numa-binding MODE`` keeps every worker (and its threads) on CPUs close to its GPU,
so its host memory stays local. Each worker is bound in its child as it starts
(``sched_setaffinity``: ``spawn.prepare_child``, or the template's fork);
:func:`wrap_command` and :func:`apply_affinity` are for code that binds itself.

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
the node, so ``--nproc-per-node 4`` on an 8-GPU machine wastes half the cores), and no
worker needs ``numactl`` installed.

Known limitation: GPUs are found and ordered by PCI address, which is CUDA's order on
machines with identical GPUs. ``CUDA_VISIBLE_DEVICES`` with integer indices is honoured;
UUIDs cannot be mapped to PCI addresses without the vendor library, so they are an
error (or a fallback to no binding when asked). A container that sees every host GPU in
sysfs but only some of them as devices gets the host's numbering; pass
``gpu_nodes=...`` to :func:`read_topology` there.
"""

from __future__ import annotations

from elastrun.supervise.processes.numa.bind import apply_affinity, wrap_command
from elastrun.supervise.processes.numa.policy import (
    AffinityMode,
    NumaOptions,
    binding_cpus,
    numa_options_from,
    select_cpus,
)
from elastrun.supervise.processes.numa.topology import (
    Topology,
    format_cpu_list,
    parse_cpu_list,
    read_topology,
)

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
