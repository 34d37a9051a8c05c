"""The worker template serves every thread configuration users run.

``import torch`` imports numpy, whose OpenBLAS starts its thread pool as it loads unless
a thread variable is 1; the template imports with that pool quieted and each forked
worker gets the pools a fresh interpreter with its environment and affinity has. Each
case compares a forked worker with a fresh ``python`` started with the same environment.
"""

from __future__ import annotations

import json
import os
import select
import sys
import textwrap
from pathlib import Path

import pytest

from elastrun.supervise.processes.spawn import ProcessSpec, ProcessStarter, SubprocessStarter
from elastrun.template.agent.starter import TemplateStarter
from elastrun.worker import threadpools

pytestmark = pytest.mark.torch

PY = sys.executable
BOOT = "elastrun.worker.bootstrap"

# What a user could observe of the thread pools, in the order a script would meet it:
# the process's threads just after its imports, then torch's and OpenBLAS's sizes.
PROBE = """\
import json, os
import numpy
import torch
from elastrun.worker import threadpools

threads = len(os.listdir("/proc/self/task"))
blas = {os.path.basename(p): threadpools._OpenBlas.of(p).threads()
        for p in threadpools._loaded_openblas()}
print(json.dumps({
    "threads_after_imports": threads,
    "torch_threads": torch.get_num_threads(),
    "torch_interop_threads": torch.get_num_interop_threads(),
    "openblas": blas,
    "cuda_initialized": torch.cuda.is_initialized(),
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "cuda_devices": torch.cuda.device_count(),
    "affinity": sorted(os.sched_getaffinity(0)),
}))
"""

_THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_VARIABLES}
    env.update(extra)
    return env


def _start(
    starter: ProcessStarter, tmp: Path, env: dict[str, str], tag: str, cpus: frozenset[int] | None
) -> dict[str, object]:
    script = tmp / "probe.py"
    if not script.exists():
        script.write_text(textwrap.dedent(PROBE))
    out_path, err_path = tmp / f"{tag}.out", tmp / f"{tag}.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        spec = ProcessSpec(
            0,
            env,
            argv=(PY, "-u", "-m", BOOT, str(script)),
            stdout_fd=out.fileno(),
            stderr_fd=err.fileno(),
            cpus=cpus,
        )
        proc = starter.start(spec)
    ready, _, _ = select.select([proc.exit_fd()], [], [], 120)
    assert ready, f"{tag} did not exit"
    code = proc.poll()
    proc.release()
    assert code == 0, err_path.read_text()
    result: dict[str, object] = json.loads(out_path.read_text())
    return result


CONFIGURATIONS = {
    # One worker per node: elastrun leaves OMP_NUM_THREADS unset, as torchrun does.
    "one-worker-unset": {},
    # Users' own thread counts (OMP_NUM_THREADS=1 is what elastrun sets for several
    # workers; the other template tests run with it).
    "omp-8": {"OMP_NUM_THREADS": "8"},
    "omp-3-mkl-2": {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "2"},
    "openblas-2": {"OPENBLAS_NUM_THREADS": "2"},
}


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_a_forked_worker_has_the_thread_pools_of_a_fresh_interpreter(
    tmp_path: Path, name: str
) -> None:
    env = _env(**CONFIGURATIONS[name])
    with TemplateStarter(preload=["torch", "numpy"]) as starter:
        forked = _start(starter, tmp_path, env, "forked", None)
        assert (starter.forked, starter.fell_back) == (1, 0), starter.unusable_reason
    fresh = _start(SubprocessStarter(), tmp_path, env, "fresh", None)
    assert forked == fresh
    assert forked["cuda_initialized"] is False


def test_a_worker_bound_to_fewer_cpus_gets_the_pools_of_a_fresh_one_so_bound(
    tmp_path: Path,
) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two usable CPUs to bind a worker to one")
    env = _env()
    with TemplateStarter(preload=["torch", "numpy"]) as starter:
        forked = _start(starter, tmp_path, env, "forked", frozenset(cpus[:1]))
        assert starter.forked == 1
    fresh = _start(SubprocessStarter(), tmp_path, env, "fresh", frozenset(cpus[:1]))
    assert forked == fresh
    assert forked["affinity"] == cpus[:1]


def test_one_template_serves_ranks_with_their_own_cuda_visible_devices(
    tmp_path: Path,
) -> None:
    with TemplateStarter(preload=["torch", "numpy"]) as starter:
        forked = [
            _start(starter, tmp_path, _env(CUDA_VISIBLE_DEVICES=str(r)), f"rank{r}", None)
            for r in range(2)
        ]
        assert (starter.forked, starter.templates_started) == (2, 1)
    fresh = [
        _start(SubprocessStarter(), tmp_path, _env(CUDA_VISIBLE_DEVICES=str(r)), f"f{r}", None)
        for r in range(2)
    ]
    assert forked == fresh
    assert [f["cuda_visible_devices"] for f in forked] == ["0", "1"]


@pytest.mark.parametrize(
    ("env", "cpus", "expected"),
    [
        ({}, 16, 16),
        ({"OMP_NUM_THREADS": "4"}, 16, 4),
        ({"OMP_NUM_THREADS": "64"}, 16, 16),
        ({"OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "8"}, 16, 2),
        ({"GOTO_NUM_THREADS": "3", "OMP_NUM_THREADS": "8"}, 16, 3),
        ({"OPENBLAS_NUM_THREADS": "0", "OMP_NUM_THREADS": "5"}, 16, 5),
        ({"OPENBLAS_NUM_THREADS": "x", "OMP_NUM_THREADS": " 6,2"}, 16, 6),
        ({"OMP_NUM_THREADS": "-3"}, 16, 16),
        ({}, 128, 64),  # the build's MAX_THREADS
    ],
)
def test_openblas_picks_its_pool_size_from_the_environment_and_the_cpus(
    env: dict[str, str], cpus: int, expected: int
) -> None:
    assert threadpools.openblas_default_threads(env, cpus, 64) == expected


def test_the_template_quiets_openblas_only_while_it_imports() -> None:
    environ = {"OPENBLAS_NUM_THREADS": "4", "OMP_NUM_THREADS": "8"}
    previous = threadpools.quiet_for_import(environ)
    assert environ == {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "8"}
    threadpools.restore(environ, previous)
    assert environ == {"OPENBLAS_NUM_THREADS": "4", "OMP_NUM_THREADS": "8"}
    unset: dict[str, str] = {}
    threadpools.restore(unset, threadpools.quiet_for_import(unset))
    assert unset == {}


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, 6), ("", 6), ("4", None), ("4,2", None), (" 3 ", None), ("0", 6), ("x", 6), ("4x", 6)],
)
def test_an_openmp_runtime_counts_the_cpus_only_without_a_valid_omp_num_threads(
    value: str | None, expected: int | None
) -> None:
    env = {} if value is None else {"OMP_NUM_THREADS": value}
    assert threadpools.openmp_default_threads(env, 6) == expected
