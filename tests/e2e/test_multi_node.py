"""Several agents on loopback: one world, scale-down, scale-up, spares, budget, tokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from _helpers import REPO, finish, free_port, pid_alive, start, wait_for, write_script

DEMO = REPO / "examples" / "ddp_demo.py"

ENV_DUMP = """
import json, os, sys, time
keys = ["RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "ROLE_RANK", "ROLE_WORLD_SIZE"]
with open(os.path.join(sys.argv[1], "env_" + os.environ["RANK"] + ".json"), "w") as fh:
    json.dump({k: os.environ[k] for k in keys}, fh)
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""


def agent(
    cwd: Path, nnodes: str, endpoint: str, args: list[str], *, nproc: int = 2,
    conf: str = "", env: dict[str, str] | None = None, extra: list[str] | None = None,
) -> subprocess.Popen[str]:  # fmt: skip
    rdzv_conf = "last_call_timeout=1,join_timeout=60" + (f",{conf}" if conf else "")
    return start(
        ["--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", endpoint, "--rdzv-id", "job1", "--local-addr", "127.0.0.1",
         "--rdzv-conf", rdzv_conf, *(extra or []), *args],
        cwd=cwd,
        env=env,
    )  # fmt: skip


def test_two_agents_form_one_world(tmp_path: Path) -> None:
    script = write_script(tmp_path / "env.py", ENV_DUMP)
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [agent(tmp_path, "2", endpoint, [str(script), str(tmp_path)]) for _ in range(2)]
    results = [finish(p, 60) for p in procs]
    for r in results:
        assert r.returncode == 0, r.stderr
    envs = [json.loads((tmp_path / f"env_{i}.json").read_text()) for i in range(4)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"}
    assert sorted(e["GROUP_RANK"] for e in envs) == ["0", "0", "1", "1"]
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1


@pytest.fixture
def store_server(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A token-protected store: its endpoint and its token file's path."""
    port = free_port()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastrun", "store", "--host", "127.0.0.1", "--port", str(port),
         "--token-file", str(token)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "serving on" in line, line + proc.stderr.read() if proc.stderr else ""
    yield f"127.0.0.1:{port}", str(token)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=10)


def test_a_token_protected_store_refuses_a_wrong_token(
    tmp_path: Path, store_server: tuple[str, str]
) -> None:
    endpoint, token = store_server
    script = write_script(tmp_path / "env.py", ENV_DUMP)
    bad = tmp_path / "bad"
    bad.write_text("wrong")
    refused = finish(
        agent(tmp_path, "1:2", endpoint, [str(script), str(tmp_path)],
              conf=f"is_host=false,token_file={bad}"),
        30,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "authentication" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not list(tmp_path.glob("env_*.json"))
    ok = finish(
        agent(tmp_path, "1:2", endpoint, [str(script), str(tmp_path)],
              conf=f"is_host=false,token_file={token}"),
        60,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr


pytestmark = pytest.mark.slow


def _demo(tmp_path: Path, steps: int, extra: list[str] | None = None) -> list[str]:
    return [str(DEMO), "--steps", str(steps), "--checkpoint-every", "5", "--step-time", "0.1",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--result-file",
            str(tmp_path / "result.json"), *(extra or [])]  # fmt: skip


@pytest.mark.torch
def test_three_nodes_lose_one_and_finish_at_two(
    tmp_path: Path, store_server: tuple[str, str]
) -> None:
    endpoint, token = store_server
    conf = f"is_host=false,token_file={token}"
    procs = [
        agent(tmp_path, "2:3", endpoint, _demo(tmp_path, 60), nproc=1, conf=conf,
              extra=["--max-restarts", "2"])
        for _ in range(3)
    ]  # fmt: skip
    ckpt = tmp_path / "ckpt"
    wait_for(lambda: ckpt.exists() and any(ckpt.iterdir()), 120, "a first checkpoint")
    victim = procs[2]
    os.killpg(victim.pid, signal.SIGKILL)  # the agent and its workers, at once
    victim.communicate(timeout=10)
    results = [finish(p, 180) for p in procs[:2]]
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    outcome = json.loads((tmp_path / "result.json").read_text())
    assert outcome["identical"] is True and outcome["world_size"] == 2


@pytest.mark.torch
def test_four_nodes_lose_one_then_another_while_re_forming_and_train_on_at_two(
    tmp_path: Path, store_server: tuple[str, str]
) -> None:
    # A second node killed half a second after the first dies while the survivors
    # re-form, and they re-form once more. A loss the survivors see first as a lost
    # lease re-forms at once (the first to re-join decides for all the live members,
    # presumed joined); one a worker sees first (its peer's connection closed before
    # the store revoked the dead node's lease) fails the round, which re-forms from the
    # members that join (``RoundView.must_join``). The budget of 2 covers that race.
    endpoint, token = store_server
    conf = f"is_host=false,token_file={token}"
    procs = [
        agent(tmp_path, "2:4", endpoint, _demo(tmp_path, 80), nproc=1, conf=conf,
              extra=["--max-restarts", "2"])
        for _ in range(4)
    ]  # fmt: skip
    ckpt = tmp_path / "ckpt"
    wait_for(lambda: ckpt.exists() and any(ckpt.iterdir()), 120, "a first checkpoint")
    for victim in (procs[3], procs[2]):
        os.killpg(victim.pid, signal.SIGKILL)  # the agent and its workers, at once
        time.sleep(0.5)
    for victim in procs[2:]:
        victim.communicate(timeout=10)
    results = [finish(p, 180) for p in procs[:2]]
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    outcome = json.loads((tmp_path / "result.json").read_text())
    assert outcome["identical"] is True and outcome["world_size"] == 2


@pytest.mark.torch
def test_one_node_grows_to_two_without_spending_restarts(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    first = agent(tmp_path, "1:2", endpoint, _demo(tmp_path, 80), nproc=1,
                  extra=["--max-restarts", "0"])  # fmt: skip
    ckpt = tmp_path / "ckpt"
    wait_for(lambda: ckpt.exists() and any(ckpt.iterdir()), 120, "a first checkpoint")
    second = agent(tmp_path, "1:2", endpoint, _demo(tmp_path, 80), nproc=1,
                   extra=["--max-restarts", "0"])  # fmt: skip
    results = [finish(p, 180) for p in (first, second)]
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    outcome = json.loads((tmp_path / "result.json").read_text())
    assert outcome["identical"] is True
    assert outcome["world_size"] == 2
    assert outcome["restart_count"] == 0


def test_a_spare_at_max_waits_then_replaces_a_lost_node(
    tmp_path: Path, store_server: tuple[str, str]
) -> None:
    endpoint, token = store_server
    conf = f"is_host=false,token_file={token}"
    script = write_script(tmp_path / "env.py", ENV_DUMP)
    members = [agent(tmp_path, "1:2", endpoint, [str(script), str(tmp_path), "8"], nproc=1,
                     conf=conf, extra=["--max-restarts", "3"]) for _ in range(2)]  # fmt: skip
    wait_for(lambda: len(list(tmp_path.glob("env_*.json"))) == 2, 60, "two members")
    spare = agent(tmp_path, "1:2", endpoint, [str(script), str(tmp_path), "1"], nproc=1,
                  conf=conf, extra=["--max-restarts", "3"])  # fmt: skip
    time.sleep(2)
    assert spare.poll() is None  # waiting, not failing
    assert len(list(tmp_path.glob("env_*.json"))) == 2  # and not disturbing anyone
    os.killpg(members[1].pid, signal.SIGKILL)
    members[1].communicate(timeout=10)
    for p in (members[0], spare):
        r = finish(p, 90)
        assert r.returncode == 0, r.stderr[-3000:]


def test_join_timeout_fails_clearly(tmp_path: Path) -> None:
    script = write_script(tmp_path / "env.py", ENV_DUMP)
    endpoint = f"127.0.0.1:{free_port()}"
    r = finish(agent(tmp_path, "2", endpoint, [str(script), str(tmp_path)],
                     conf="join_timeout=2"), 60)  # fmt: skip
    assert r.returncode != 0
    assert "timed out" in r.stderr and "at least 2 needed" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_restart_budget_is_job_wide(tmp_path: Path) -> None:
    script = write_script(
        tmp_path / "fail.py",
        """
        import os, sys, time
        if os.environ["GROUP_RANK"] == "1":
            sys.exit(5)
        time.sleep(30)
        """,
    )
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [agent(tmp_path, "2", endpoint, [str(script)], nproc=1,
                   extra=["--max-restarts", "2"]) for _ in range(2)]  # fmt: skip
    results = [finish(p, 120) for p in procs]
    assert all(r.returncode != 0 for r in results)
    err = "".join(r.stderr for r in results)
    # Two restarts for the whole job, not two per agent.
    assert err.count("restarting all workers") == 2, err[-4000:]
    assert "restart budget exhausted: 2 of 2" in err


def test_no_agent_or_worker_survives(tmp_path: Path) -> None:
    # A node's agent SIGKILLed alone: its workers die with it (parent-death guarantee).
    script = write_script(
        tmp_path / "pid.py",
        f"import os, time\nopen(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close()\n"
        "time.sleep(60)\n",
    )
    endpoint = f"127.0.0.1:{free_port()}"
    p = agent(tmp_path, "1", endpoint, [str(script)], nproc=2)
    wait_for(lambda: len([f for f in tmp_path.iterdir() if f.name.isdigit()]) == 2, 30, "workers")
    pids = [int(f.name) for f in tmp_path.iterdir() if f.name.isdigit()]
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=10)
    wait_for(lambda: not any(pid_alive(x) for x in pids), 5, "workers to die")


def test_an_unreachable_store_is_one_clear_line(tmp_path: Path) -> None:
    script = write_script(tmp_path / "env.py", ENV_DUMP)
    endpoint = f"127.0.0.1:{free_port()}"  # nobody serves it
    r = finish(agent(tmp_path, "1:2", endpoint, [str(script), str(tmp_path)],
                     conf="is_host=false,read_timeout=2"), 60)  # fmt: skip
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.startswith("elastrun: error:")]
    assert len(lines) == 1 and "cannot reach the store" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not list(tmp_path.glob("env_*.json"))
