"""The examples: elastic data loading across world sizes, several agents on one machine.

The guide runs the elastic data example across a change of world size (3 workers, then
2: docs/elastic-scripts.md, through tests/docs), and the DDP demo on several local
agents (docs/quickstart.md); these tests pin the rest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from _helpers import ELASTRUN, REPO, finish, run, wait_for, write_script

EXAMPLES = REPO / "examples"
ELASTIC_DATA = EXAMPLES / "elastic_data.py"
MULTINODE = EXAMPLES / "multinode_local.sh"


def _load_elastic_data() -> ModuleType:
    spec = importlib.util.spec_from_file_location("elastic_data_example", ELASTIC_DATA)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.torch
def test_the_elastic_sampler_covers_an_epoch_once_while_the_world_size_changes() -> None:
    sampler = _load_elastic_data().ElasticSampler(num_samples=103, batch_size=4)
    seen: list[int] = []
    offset = 0
    for world in [3, 3, 5, 1, 2, 4, 4, 4, 7, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]:
        if offset == 103:
            break
        step = [sampler.indices(0, offset, r, world) for r in range(world)]
        assert sum(len(s) for s in step) == sampler.step_size(offset, world)
        seen += [i for s in step for i in s]
        offset += sampler.step_size(offset, world)
    assert offset == 103
    assert sorted(seen) == list(range(103))
    assert sampler.order(1) != sampler.order(0)  # a new order every epoch


@pytest.mark.torch
@pytest.mark.slow
def test_elastic_data_recovers_from_a_killed_rank(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    r = run(
        ["--nproc-per-node", "2", "--max-restarts", "1", str(ELASTIC_DATA),
         "--checkpoint-dir", str(tmp_path / "ck"), "--crash-at-step", "5", "--crash-rank", "1",
         "--result-file", str(result)],
        cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "injected crash at step 5" in r.stdout
    outcome = json.loads(result.read_text())
    assert outcome["exact"] is True
    assert outcome["restart_count"] == 1


ENV_DUMP = """
import json, os, sys
with open(os.path.join(sys.argv[1], "env_" + os.environ["RANK"] + ".json"), "w") as fh:
    json.dump({k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK")}, fh)
"""


def _multinode(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "ELASTRUN": " ".join(ELASTRUN), "PYTHON": sys.executable}
    return subprocess.Popen(
        ["bash", str(MULTINODE), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def test_multinode_local_forms_one_world_from_several_agents(tmp_path: Path) -> None:
    script = write_script(tmp_path / "env.py", ENV_DUMP)
    r = finish(_multinode(["-n", "3", "-p", "2", str(script), str(tmp_path)], tmp_path), 90)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    envs = [json.loads((tmp_path / f"env_{i}.json").read_text()) for i in range(6)]
    assert {e["WORLD_SIZE"] for e in envs} == {"6"}
    assert sorted(e["GROUP_RANK"] for e in envs) == ["0", "0", "1", "1", "2", "2"]
    for node in range(3):
        assert f"[node {node}] [elastrun]" in r.stdout


def test_multinode_local_exits_with_an_agents_failure(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "fail.py", "import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n"
    )
    r = finish(_multinode(["-n", "2", str(script)], tmp_path), 90)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "exitcode" in r.stdout or "exit code" in r.stdout


def test_multinode_local_stops_the_agents_it_started_on_sigterm(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "sleep.py",
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[1], 'up_' + os.environ['RANK']), 'w').close()\n"
        "time.sleep(120)\n",
    )
    proc = _multinode(["-n", "2", str(script), str(tmp_path)], tmp_path)
    wait_for(lambda: len(list(tmp_path.glob("up_*"))) == 2, 60, "both workers")
    os.kill(proc.pid, signal.SIGTERM)  # the script alone, not its process group
    r = finish(proc, 60)
    assert r.returncode == 143, r.stdout[-3000:]
    # No agent or worker is left: the suite's leak check fails the test otherwise.


def test_multinode_local_refuses_a_missing_script(tmp_path: Path) -> None:
    r = finish(_multinode(["-n", "2"], tmp_path), 30)
    assert r.returncode == 2
    assert "no script" in r.stderr
