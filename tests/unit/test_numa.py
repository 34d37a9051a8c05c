"""CPU selection for --numa-binding, on synthetic sysfs trees (no real binding here)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.core.errors import ConfigError
from elastrun.supervise.processes.numa import (
    AffinityMode,
    NumaOptions,
    Topology,
    binding_cpus,
    format_cpu_list,
    numa_options_from,
    parse_cpu_list,
    read_topology,
    select_cpus,
    wrap_command,
)

# The synthetic machine: 2 sockets x 2 NUMA nodes x 4 cores, 2 hardware threads per
# core, numbered the way Linux numbers them: cpu c and cpu c+16 are the two threads of
# core c. Node n holds cores 4n..4n+3; each node has two core complexes of two cores
# (an L3 each); node n sits on socket n // 2.
CORES = 16
SMT_OFFSET = 16


def node_cpus(node: int) -> set[int]:
    cores = range(4 * node, 4 * node + 4)
    return set(cores) | {c + SMT_OFFSET for c in cores}


def core(c: int) -> set[int]:
    return {c, c + SMT_OFFSET}


def cores(*cs: int) -> set[int]:
    return set().union(*(core(c) for c in cs))


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def make_sysfs(
    root: Path,
    *,
    gpus: Sequence[tuple[str, int]] = (),
    with_cache: bool = True,
    with_nodes: bool = True,
) -> Path:
    """Write the synthetic machine under ``root``; ``gpus`` is (pci address, node)."""
    system = root / "devices/system"
    for node in range(4):
        if with_nodes:
            write(system / f"node/node{node}/cpulist", format_cpu_list(node_cpus(node)))
    if with_nodes:
        write(system / "node/possible", "0-3")
    write(system / "cpu/online", f"0-{2 * CORES - 1}")
    for cpu in range(2 * CORES):
        c = cpu % SMT_OFFSET
        node = c // 4
        base = system / f"cpu/cpu{cpu}"
        write(base / "topology/physical_package_id", str(node // 2))
        write(base / "topology/thread_siblings_list", format_cpu_list(core(c)))
        if not with_cache:
            continue
        ccx_first = c - c % 2
        ccx = cores(ccx_first, ccx_first + 1)
        caches = [
            ("Data", 1, core(c)),
            ("Instruction", 1, core(c)),
            ("Unified", 2, core(c)),
            ("Unified", 3, ccx),
            # An instruction cache at a higher level must not count as a complex.
            ("Instruction", 4, set().union(*(node_cpus(n) for n in range(4)))),
        ]
        for index, (kind, level, shared) in enumerate(caches):
            entry = base / f"cache/index{index}"
            write(entry / "type", kind)
            write(entry / "level", str(level))
            write(entry / "shared_cpu_list", format_cpu_list(shared))
    pci = root / "bus/pci/devices"
    # Devices that are not GPUs: a BMC's VGA, an NVIDIA card's audio, an NVSwitch.
    for address, vendor, klass in [
        ("0000:02:00.0", "0x1a03", "0x030000"),
        ("0000:03:00.1", "0x10de", "0x040300"),
        ("0000:04:00.0", "0x10de", "0x068000"),
    ]:
        write(pci / address / "vendor", vendor)
        write(pci / address / "class", klass)
        write(pci / address / "numa_node", "0")
    for address, node in gpus:
        write(pci / address / "vendor", "0x10de")
        write(pci / address / "class", "0x030200")
        write(pci / address / "numa_node", str(node))
    return root


ALL = frozenset(range(2 * CORES))


# Writing a tree takes hundreds of files: the two common ones are built once.
@pytest.fixture(scope="module")
def plain_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sysfs(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def gpu_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sysfs(tmp_path_factory.mktemp("gpus"), gpus=EIGHT_GPUS)


@pytest.fixture(scope="module")
def cpu_only(plain_root: Path) -> Topology:
    return read_topology(plain_root, allowed_cpus=ALL)


def allowing(topology: Topology, cpus: set[int] | frozenset[int]) -> Topology:
    return replace(topology, allowed_cpus=frozenset(cpus))


# Eight GPUs, two per node, listed out of order on the bus to check the sorting.
EIGHT_GPUS = [(f"0000:{0x18 + 0x10 * i:02x}:00.0", i // 2) for i in reversed(range(8))]


@pytest.fixture(scope="module")
def eight_gpus(gpu_root: Path) -> Topology:
    return read_topology(gpu_root, allowed_cpus=ALL)


# ----------------------------------------------------------------------------- cpu lists


def test_format_cpu_list_compacts_runs_into_ranges() -> None:
    assert format_cpu_list({0, 1, 2, 5}) == "0-2,5"
    assert format_cpu_list([7, 3, 4]) == "3-4,7"
    assert format_cpu_list({4}) == "4"
    assert format_cpu_list(set()) == ""


def test_parse_cpu_list_reads_kernel_lists() -> None:
    assert parse_cpu_list("0-2,5\n") == {0, 1, 2, 5}
    assert parse_cpu_list("") == set()
    with pytest.raises(ValueError):
        parse_cpu_list("3-1")
    with pytest.raises(ValueError):
        parse_cpu_list("a")


@given(st.sets(st.integers(min_value=0, max_value=512)))
def test_cpu_list_format_then_parse_round_trips(cpus: set[int]) -> None:
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


# ----------------------------------------------------------------------------- topology


def test_read_topology_finds_nodes_sockets_siblings_and_l3_groups(cpu_only: Topology) -> None:
    assert {n: set(c) for n, c in cpu_only.node_cpus.items()} == {n: node_cpus(n) for n in range(4)}
    assert cpu_only.cpu_socket[5] == 0
    assert cpu_only.cpu_socket[8 + SMT_OFFSET] == 1
    assert cpu_only.cpu_siblings[3] == core(3)
    # The highest data/unified cache (L3, the complex), not the level-4 instruction one.
    assert cpu_only.cpu_cache_group[2] == cores(2, 3)
    assert cpu_only.allowed_cpus == ALL
    assert cpu_only.gpu_nodes == ()


def test_read_topology_orders_gpus_by_pci_address_and_skips_other_devices(
    eight_gpus: Topology,
) -> None:
    assert eight_gpus.gpu_nodes == (0, 0, 1, 1, 2, 2, 3, 3)


def test_read_topology_counts_unknown_gpu_node_as_node_zero(tmp_path: Path) -> None:
    topology = read_topology(make_sysfs(tmp_path, gpus=[("0000:18:00.0", -1)]), allowed_cpus=ALL)
    assert topology.gpu_nodes == (0,)


def test_read_topology_honours_integer_cuda_visible_devices(gpu_root: Path) -> None:
    root = gpu_root
    topology = read_topology(root, allowed_cpus=ALL, visible_devices="6,1")
    assert topology.gpu_nodes == (3, 0)
    # CUDA stops at the first index that does not exist.
    assert read_topology(root, allowed_cpus=ALL, visible_devices="2,9,0").gpu_nodes == (1,)


def test_read_topology_rejects_uuid_cuda_visible_devices(gpu_root: Path) -> None:
    with pytest.raises(ConfigError, match="UUID"):
        read_topology(gpu_root, allowed_cpus=ALL, visible_devices="GPU-1234abcd")


def test_read_topology_gpu_nodes_override_replaces_the_pci_scan(gpu_root: Path) -> None:
    assert read_topology(gpu_root, allowed_cpus=ALL, gpu_nodes=[3, 2]).gpu_nodes == (3, 2)


def test_read_topology_without_numa_support_is_one_node_of_online_cpus(tmp_path: Path) -> None:
    topology = read_topology(make_sysfs(tmp_path, with_nodes=False), allowed_cpus=ALL)
    assert dict(topology.node_cpus) == {0: ALL}


def test_read_topology_of_an_empty_tree_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--numa-binding"):
        read_topology(tmp_path, allowed_cpus=ALL)


def test_read_topology_defaults_allowed_cpus_to_this_process_affinity(plain_root: Path) -> None:
    topology = read_topology(plain_root)
    assert topology.allowed_cpus == frozenset(os.sched_getaffinity(0))


# ----------------------------------------------------------------------------- node


def test_node_mode_without_gpus_spreads_local_ranks_round_robin_over_nodes(
    cpu_only: Topology,
) -> None:
    for rank in range(6):
        assert select_cpus("node", cpu_only, rank, 6) == node_cpus(rank % 4)


def test_node_mode_with_gpus_binds_to_the_gpu_node(eight_gpus: Topology) -> None:
    assert select_cpus(AffinityMode.NODE, eight_gpus, 3, 8) == node_cpus(1)
    assert select_cpus(AffinityMode.NODE, eight_gpus, 7, 8) == node_cpus(3)


def test_node_mode_keeps_only_allowed_cpus(cpu_only: Topology) -> None:
    topology = allowing(cpu_only, ALL - {0, 1, SMT_OFFSET})
    assert select_cpus("node", topology, 0, 1) == node_cpus(0) - {0, 1, SMT_OFFSET}


def test_cpu_only_round_robin_skips_nodes_without_allowed_cpus(cpu_only: Topology) -> None:
    topology = allowing(cpu_only, node_cpus(1) | node_cpus(3))
    assert select_cpus("node", topology, 0, 2) == node_cpus(1)
    assert select_cpus("node", topology, 1, 2) == node_cpus(3)


def test_gpu_on_a_node_without_allowed_cpus_is_a_config_error(eight_gpus: Topology) -> None:
    topology = allowing(eight_gpus, node_cpus(0))
    with pytest.raises(ConfigError, match="NUMA node 1"):
        select_cpus("node", topology, 2, 8)


def test_local_rank_without_a_gpu_is_a_config_error(eight_gpus: Topology) -> None:
    with pytest.raises(ConfigError, match="local rank 8 has no GPU"):
        select_cpus("node", eight_gpus, 8, 9)


def test_no_allowed_cpu_anywhere_is_a_config_error(cpu_only: Topology) -> None:
    topology = allowing(cpu_only, {999})
    with pytest.raises(ConfigError, match="no NUMA node"):
        select_cpus("node", topology, 0, 1)


def test_local_rank_outside_the_local_world_is_a_value_error(cpu_only: Topology) -> None:
    with pytest.raises(ValueError, match="outside"):
        select_cpus("node", cpu_only, 2, 2)


def test_unknown_mode_is_a_config_error(cpu_only: Topology) -> None:
    with pytest.raises(ConfigError, match="expected one of"):
        select_cpus("llc", cpu_only, 0, 1)


# ----------------------------------------------------------------------------- socket


def test_socket_mode_binds_to_every_node_of_the_socket(eight_gpus: Topology) -> None:
    assert select_cpus("socket", eight_gpus, 0, 8) == node_cpus(0) | node_cpus(1)
    assert select_cpus("socket", eight_gpus, 5, 8) == node_cpus(2) | node_cpus(3)


def test_socket_mode_without_socket_information_is_a_config_error(cpu_only: Topology) -> None:
    topology = replace(cpu_only, cpu_socket={})
    with pytest.raises(ConfigError, match="socket of CPU"):
        select_cpus("socket", topology, 0, 1)


# ----------------------------------------------------------------------------- exclusive


def test_exclusive_splits_the_node_physical_cores_between_its_workers(
    eight_gpus: Topology,
) -> None:
    # Node 0 has cores 0-3 and GPUs 0 and 1: two cores (four threads) each.
    assert select_cpus("exclusive", eight_gpus, 0, 8) == cores(0, 1)
    assert select_cpus("exclusive", eight_gpus, 1, 8) == cores(2, 3)
    assert select_cpus("exclusive", eight_gpus, 6, 8) == cores(12, 13)


def test_exclusive_shares_among_started_workers_not_every_gpu(eight_gpus: Topology) -> None:
    # Only GPU 0 of node 0 has a worker: it gets the whole node.
    assert select_cpus("exclusive", eight_gpus, 0, 1) == node_cpus(0)


def test_exclusive_gives_leftover_cores_to_lower_ranks(cpu_only: Topology) -> None:
    topology = replace(cpu_only, gpu_nodes=(0, 0, 0))
    picks = [select_cpus("exclusive", topology, rank, 3) for rank in range(3)]
    assert picks == [cores(0, 1), cores(2), cores(3)]


def test_exclusive_without_gpus_splits_each_node_among_its_round_robin_ranks(
    cpu_only: Topology,
) -> None:
    # Eight workers on four nodes: ranks r and r + 4 share node r.
    assert select_cpus("exclusive", cpu_only, 1, 8) == cores(4, 5)
    assert select_cpus("exclusive", cpu_only, 5, 8) == cores(6, 7)


def test_exclusive_groups_threads_by_core_even_if_one_thread_is_not_allowed(
    cpu_only: Topology,
) -> None:
    topology = allowing(cpu_only, ALL - {SMT_OFFSET})
    # Core 0 still counts as a core; only its allowed thread is used.
    picks = [select_cpus("exclusive", topology, rank, 8) for rank in (0, 4)]
    assert picks == [{0} | core(1), cores(2, 3)]


def test_exclusive_with_fewer_cores_than_workers_is_a_config_error(cpu_only: Topology) -> None:
    # 20 workers round-robin over 4 nodes: 5 per node of 4 cores.
    with pytest.raises(ConfigError, match="4 usable physical cores for 5 workers"):
        select_cpus("exclusive", cpu_only, 0, 20)


def test_exclusive_workers_never_share_a_cpu(cpu_only: Topology) -> None:
    picks = [select_cpus("exclusive", cpu_only, rank, 12) for rank in range(12)]
    assert sum(len(p) for p in picks) == len(set().union(*picks)) == 2 * CORES


# ----------------------------------------------------------------------------- core-complex


def test_core_complex_gives_each_worker_of_a_node_its_own_complex(eight_gpus: Topology) -> None:
    assert select_cpus("core-complex", eight_gpus, 0, 8) == cores(0, 1)
    assert select_cpus("core-complex", eight_gpus, 1, 8) == cores(2, 3)
    assert select_cpus("core-complex", eight_gpus, 3, 8) == cores(6, 7)


def test_core_complex_wraps_around_when_workers_outnumber_complexes(cpu_only: Topology) -> None:
    # Twelve workers: node 0 hosts ranks 0, 4, 8 -> complexes A, B, A.
    picks = [select_cpus("core-complex", cpu_only, rank, 12) for rank in (0, 4, 8)]
    assert picks == [cores(0, 1), cores(2, 3), cores(0, 1)]


def test_core_complex_prefers_the_complex_with_more_allowed_cpus(cpu_only: Topology) -> None:
    topology = allowing(cpu_only, ALL - {0})
    assert select_cpus("core-complex", topology, 0, 8) == cores(2, 3)
    assert select_cpus("core-complex", topology, 4, 8) == cores(0, 1) - {0}


def test_core_complex_without_cache_information_is_a_config_error(tmp_path: Path) -> None:
    topology = read_topology(make_sysfs(tmp_path, with_cache=False), allowed_cpus=ALL)
    with pytest.raises(ConfigError, match="no cache information"):
        select_cpus("core-complex", topology, 0, 1)


# ----------------------------------------------------------------------------- options


def test_affinity_mode_values_are_torch_flag_values() -> None:
    assert [m.value for m in AffinityMode] == ["node", "socket", "exclusive", "core-complex"]


def test_numa_options_accept_mode_strings_and_reject_unknown_ones() -> None:
    # arg-type: a mode string, which NumaOptions converts at run time
    assert NumaOptions("socket").affinity_mode is AffinityMode.SOCKET  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--numa-binding"):
        NumaOptions("everything")  # type: ignore[arg-type]  # an unknown mode string: refused


def test_numa_options_from_converts_strings_and_torch_like_options() -> None:
    assert numa_options_from(None) is None
    assert numa_options_from("node") == NumaOptions(AffinityMode.NODE)
    torch_like = SimpleNamespace(
        affinity_mode=SimpleNamespace(value="exclusive"), should_fall_back_if_binding_fails=True
    )
    assert numa_options_from(torch_like) == NumaOptions(AffinityMode.EXCLUSIVE, True)
    with pytest.raises(ConfigError):
        numa_options_from(42)


def test_binding_cpus_is_none_without_options(cpu_only: Topology) -> None:
    assert binding_cpus(None, 0, 1, cpu_only) is None


def test_binding_cpus_reads_the_topology_lazily(cpu_only: Topology) -> None:
    got = binding_cpus(NumaOptions(AffinityMode.NODE), 1, 2, lambda: cpu_only)
    assert got == frozenset(node_cpus(1))


def test_binding_cpus_raises_when_impossible_without_fallback(cpu_only: Topology) -> None:
    with pytest.raises(ConfigError, match="exclusive binding needs"):
        binding_cpus(NumaOptions(AffinityMode.EXCLUSIVE), 0, 20, cpu_only)


def test_binding_cpus_falls_back_to_no_binding_when_asked(
    cpu_only: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    options = NumaOptions(AffinityMode.EXCLUSIVE, should_fall_back_if_binding_fails=True)
    with caplog.at_level(logging.WARNING):
        assert binding_cpus(options, 0, 20, cpu_only) is None
    assert "NUMA binding skipped for local rank 0" in caplog.text


# ----------------------------------------------------------------------------- numactl


def test_wrap_command_prefixes_numactl_with_the_cpu_ranges() -> None:
    argv = wrap_command(["python", "train.py"], {0, 1, 2, 5}, which=lambda _: "/usr/bin/numactl")
    assert argv == ("numactl", "--physcpubind=0-2,5", "python", "train.py")


def test_wrap_command_without_numactl_names_the_option() -> None:
    with pytest.raises(ConfigError, match=r"--numa-binding.*numactl"):
        wrap_command(["train"], {0}, which=lambda _: None)


def test_wrap_command_without_numactl_falls_back_when_asked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        assert wrap_command(["train"], {0}, fallback=True, which=lambda _: None) == ("train",)
    assert "numactl" in caplog.text


def test_wrap_command_refuses_an_empty_cpu_set() -> None:
    with pytest.raises(ConfigError, match="empty"):
        wrap_command(["train"], set(), which=lambda _: "/usr/bin/numactl")
