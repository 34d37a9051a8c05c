"""Real NUMA binding on this machine: numactl for commands, sched_setaffinity for functions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastrun.core.errors import ConfigError
from elastrun.supervise.api import start_processes
from elastrun.supervise.processes.logs import DefaultLogsSpecs
from elastrun.supervise.processes.numa import (
    AffinityMode,
    NumaOptions,
    apply_affinity,
    binding_cpus,
    read_topology,
    select_cpus,
    wrap_command,
)

REPORT_AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)))"


def run(argv: tuple[str, ...] | list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def test_this_machine_has_a_readable_topology() -> None:
    topology = read_topology()
    assert topology.node_cpus
    assert topology.allowed_cpus == frozenset(os.sched_getaffinity(0))
    # Every allowed CPU belongs to some node, so node binding covers them all.
    assert topology.allowed_cpus <= frozenset().union(*topology.node_cpus.values())


def test_node_binding_of_rank_zero_covers_its_node() -> None:
    topology = read_topology()
    node = topology.gpu_nodes[0] if topology.gpu_nodes else topology.usable_nodes()[0]
    assert select_cpus("node", topology, 0, 1) == set(topology.allowed_on(node))


@pytest.mark.skipif(shutil.which("numactl") is None, reason="numactl is not installed")
@pytest.mark.parametrize("mode", list(AffinityMode))
def test_wrapped_command_runs_on_exactly_the_selected_cpus(mode: AffinityMode) -> None:
    topology = read_topology()
    if mode is AffinityMode.EXCLUSIVE and len(topology.allowed_cpus) >= 2:
        # Two workers on a node of two or more CPUs: a real restriction, not "all".
        local_rank, local_world_size = 1, 2
    else:
        local_rank, local_world_size = 0, 1
    try:
        cpus = select_cpus(mode, topology, local_rank, local_world_size)
    except ConfigError as exc:
        pytest.skip(f"{mode.value} binding is impossible on this machine: {exc}")
    result = run(wrap_command([sys.executable, "-c", REPORT_AFFINITY], cpus))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == sorted(cpus)


@pytest.mark.skipif(shutil.which("numactl") is None, reason="numactl is not installed")
def test_wrapped_command_keeps_its_arguments_and_exit_code() -> None:
    cpus = binding_cpus(NumaOptions(AffinityMode.NODE), 0, 1)
    assert cpus is not None
    argv = [sys.executable, "-c", "import sys; sys.exit(int(sys.argv[1]))", "7"]
    assert run(wrap_command(argv, cpus)).returncode == 7


CHILD = """
    import json
    import os
    import sys
    import threading

    from elastrun.supervise.processes.numa import apply_affinity

    wanted = set(json.loads(sys.argv[1]))
    pinned_elsewhere = set(json.loads(sys.argv[2]))

    release = threading.Event()
    tids = {}

    def idle(name, pin):
        tids[name] = threading.get_native_id()
        if pin:
            os.sched_setaffinity(0, pin)
        release.wait()

    threads = [
        threading.Thread(target=idle, args=("plain", None)),
        threading.Thread(target=idle, args=("pinned", pinned_elsewhere)),
    ]
    for t in threads:
        t.start()
    while len(tids) < 2 or os.sched_getaffinity(tids["pinned"]) != pinned_elsewhere:
        pass
    apply_affinity(wanted)
    report = {
        "main": sorted(os.sched_getaffinity(0)),
        "plain": sorted(os.sched_getaffinity(tids["plain"])),
        "pinned": sorted(os.sched_getaffinity(tids["pinned"])),
    }
    # A thread started after binding inherits it.
    late = {}
    t = threading.Thread(target=lambda: late.update(cpus=sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
    report["late"] = late["cpus"]
    release.set()
    for t in threads:
        t.join()
    print(json.dumps(report))
"""


def test_apply_affinity_binds_the_process_and_its_unpinned_threads(tmp_path: Path) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs at least two CPUs to tell bound from unbound")
    wanted, pinned = [allowed[-1]], [allowed[0]]
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    result = run([sys.executable, str(script), json.dumps(wanted), json.dumps(pinned)])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "main": wanted,
        "plain": wanted,
        "pinned": pinned,  # a thread some library pinned on purpose is left alone
        "late": wanted,
    }


def test_apply_affinity_to_cpus_outside_the_machine_is_a_config_error(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            from elastrun.core.errors import ConfigError
            from elastrun.supervise.processes.numa import apply_affinity
            try:
                apply_affinity({100000})
            except ConfigError as exc:
                print("refused:", exc)
            """
        )
    )
    result = run([sys.executable, str(script)])
    assert result.returncode == 0, result.stderr
    assert "refused: --numa-binding" in result.stdout


def test_apply_affinity_refuses_an_empty_set() -> None:
    with pytest.raises(ConfigError, match="empty"):
        apply_affinity(set())


class _TorchLikeOptions:
    """What torch.numa.binding.NumaOptions looks like to start_processes."""

    def __init__(self, mode: str, fall_back: bool = False) -> None:
        self.affinity_mode = mode
        self.should_fall_back_if_binding_fails = fall_back


@pytest.mark.parametrize("entry", ["command", "function"])
def test_start_processes_binds_each_worker_to_its_numa_cpus(entry: str, tmp_path: Path) -> None:
    topology = read_topology()
    nprocs = 2 if len(topology.allowed_cpus) >= 2 else 1
    try:
        expected = {
            lr: sorted(select_cpus("exclusive", topology, lr, nprocs)) for lr in range(nprocs)
        }
    except ConfigError as exc:
        pytest.skip(f"exclusive binding is impossible on this machine: {exc}")
    outs = {lr: tmp_path / f"cpus{lr}.json" for lr in range(nprocs)}
    if entry == "command":
        script = (
            "import json, os, sys; "
            "open(sys.argv[1], 'w').write(json.dumps(sorted(os.sched_getaffinity(0))))"
        )
        entrypoint: object = sys.executable
        args: dict[int, tuple[str, ...]] = {
            lr: ("-c", script, str(outs[lr])) for lr in range(nprocs)
        }
    else:
        entrypoint = _write_affinity
        args = {lr: (str(outs[lr]),) for lr in range(nprocs)}
    ctx = start_processes(
        name="trainer",
        entrypoint=entrypoint,  # type: ignore[arg-type]  # a command or a function, by parameter
        args=args,
        envs={lr: {} for lr in range(nprocs)},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
        numa_options=_TorchLikeOptions("exclusive"),
    )
    result = ctx.wait(timeout=60)
    assert result is not None and not result.is_failed(), result
    assert {lr: json.loads(outs[lr].read_text()) for lr in range(nprocs)} == expected
    if nprocs == 2:  # a real restriction: the two workers share no CPU
        assert not set(expected[0]) & set(expected[1])


def _write_affinity(path: str) -> None:
    Path(path).write_text(json.dumps(sorted(os.sched_getaffinity(0))))


def test_start_processes_refuses_an_unknown_numa_mode_before_starting_anything(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="numa"):
        start_processes(
            name="trainer",
            entrypoint=sys.executable,
            args={0: ("-c", "pass")},
            envs={0: {}},
            logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
            numa_options="nearby",
        )
    assert not (tmp_path / "logs").exists()
