"""``--dry-run`` shows exactly the environment elastrun gives a worker.

The same command is run twice: with ``--dry-run``, and for real with a worker that dumps
its environment. Every variable elastrun set for the real worker (every one that is not
the launcher's own, unchanged) is in the dry run's ``env`` line, with the same value or a
``<run time: ...>`` placeholder, and every variable of that line reached the worker.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from _helpers import free_port, run

PLACEHOLDER = "<run time: "
#: What the shell that dumps the environment sets for itself.
SHELL_OWN = {"PWD", "OLDPWD", "SHLVL", "_"}


def _dry_run_envs(stdout: str) -> list[dict[str, str]]:
    """The ``env`` line of each worker of a dry run, parsed."""
    envs = []
    for line in stdout.splitlines():
        if line.startswith("  env : "):
            words = shlex.split(line.removeprefix("  env : "))
            envs.append(dict(word.split("=", 1) for word in words))
    return envs


def test_a_dry_run_lists_every_variable_elastrun_sets_for_a_worker(tmp_path: Path) -> None:
    # A shell, not a Python script: elastrun's Python bootstrap takes the progress
    # variables out of the worker's environment (its children must not report) before
    # any user code could look.
    dump = "env -0 > env_$LOCAL_RANK"
    # A fixed port (static rendezvous): standalone mode would pick a port and make up a
    # run id at each launch, so the two launches would differ there by design.
    port = free_port()
    args = [
        "--nproc-per-node", "2", "--max-restarts", "1", "--master-port", str(port),
        "--rdzv-id", "planned", "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    # The file timer adds its FIFO's path; a stray OMP_NUM_THREADS would hide the rule.
    launcher_env = {
        k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith("PET_")
    }
    launcher_env["TORCHELASTIC_ENABLE_FILE_TIMER"] = "1"

    shown = run(
        [*args, "--dry-run", "--no-python", "/bin/sh", "-c", dump], cwd=tmp_path, env=launcher_env
    )
    assert shown.returncode == 0, shown.stderr
    planned = _dry_run_envs(shown.stdout)
    assert len(planned) == 2

    done = run([*args, "--no-python", "/bin/sh", "-c", dump], cwd=tmp_path, env=launcher_env)
    assert done.returncode == 0, done.stderr
    for local_rank, plan in enumerate(planned):
        raw = (tmp_path / f"env_{local_rank}").read_text()
        got = dict(item.split("=", 1) for item in raw.split("\0") if item)
        launcher = {**os.environ, **launcher_env}
        set_by_elastrun = {
            k: v for k, v in got.items() if launcher.get(k) != v and k not in SHELL_OWN
        }
        assert set(set_by_elastrun) - set(plan) == set(), "not shown by --dry-run"
        assert set(plan) - set(got) == set(), "shown by --dry-run but not given"
        concrete = {k: v for k, v in plan.items() if not v.startswith(PLACEHOLDER)}
        assert {k: got[k] for k in concrete} == concrete
        run_time = {k for k in plan if k not in concrete}
        assert run_time == {
            "TORCHELASTIC_ERROR_FILE",
            "ELASTRUN_STACKS_FILE",
            "ELASTRUN_PROGRESS_FILE",
            "ELASTRUN_PROGRESS_SLOT",
            "TORCHELASTIC_TIMER_FILE",
            "ELASTRUN_INPROCESS_SOCKET",
            "ELASTRUN_CHECKPOINT_DIR",
        }
        assert got["TORCHELASTIC_ERROR_FILE"].startswith(str(tmp_path / "logs"))
        assert got["MASTER_PORT"] == str(port) and got["OMP_NUM_THREADS"] == "1"


def test_a_dry_run_says_where_the_rendezvous_is(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("")
    lines = {
        "(standalone, one node)": ["--nproc-per-node", "1"],
        "(one node, no endpoint: no store is served)": ["--rdzv-backend", "c10d"],
        "at 127.0.0.1:29400": ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400"],
    }
    for where, args in lines.items():
        shown = run([*args, "--dry-run", str(script)], cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert f"  rendezvous  : c10d {where}\n" in shown.stdout, shown.stdout
