"""The node check on loopback: four nodes and a spare, where one node fails its check
(the test-only fault hook): it is named and kept out, and the job forms with the other
four and finishes. The workers import nothing heavy; each check imports torch once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from _helpers import finish, free_port, start, write_script

SCRIPT = """
import os, sys
open(os.path.join(sys.argv[1], f"ran_{os.environ['NODE_TAG']}"), "w").close()
"""


def _node(
    tmp_path: Path, endpoint: str, tag: str, script: Path, fault: str = ""
) -> subprocess.Popen[str]:
    args = ["--nnodes", "4", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "nodecheck", "--local-addr", "127.0.0.1",
            "--rdzv-conf", "join_timeout=90", "--no-template", "--max-restarts", "0",
            "--node-check", "--node-check-timeout", "60", "--exclude-cooldown", "600",
            "--event-log-handler", f"file:{tmp_path / tag}.jsonl",
            str(script), str(tmp_path)]  # fmt: skip
    env = {"NODE_TAG": tag, "ELASTRUN_TEST_NODE_CHECK": fault}
    return start(args, cwd=tmp_path, env=env)


def test_a_node_that_fails_its_check_is_named_and_kept_out_and_the_job_finishes(
    tmp_path: Path,
) -> None:
    script = write_script(tmp_path / "work.py", SCRIPT)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = {"a": _node(tmp_path, endpoint, "a", script)}  # serves the rendezvous store
    time.sleep(0.3)
    nodes["bad"] = _node(tmp_path, endpoint, "bad", script, fault="fail")
    for tag in "bcd":
        nodes[tag] = _node(tmp_path, endpoint, tag, script)
    done = {tag: finish(nodes[tag], 150) for tag in "abcd"}
    # The job is over: the bad node ends its cool-down with the run.
    done["bad"] = finish(nodes["bad"], 60)
    err = "\n".join(f"--- {n}\n{r.stderr[-4000:]}" for n, r in done.items())
    # All exit 0: the node kept out sat out a job that succeeded.
    assert all(done[tag].returncode == 0 for tag in [*"abcd", "bad"]), err
    ran = sorted(p.name for p in tmp_path.glob("ran_*"))
    assert ran == ["ran_a", "ran_b", "ran_c", "ran_d"], err
    bad_err = done["bad"].stderr
    assert "failed its check: its compute check failed: failure injected" in bad_err, err
    assert "it is kept out of the rounds for a cool-down" in bad_err, err
    for tag in "abcd":
        assert "node check passed" in done[tag].stderr, err
    # The checks met: the healthy nodes name the bad one as a peer that failed.
    assert "peer node" in "".join(done[tag].stderr for tag in "abcd"), err
    events = [json.loads(x) for x in (tmp_path / "bad.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["name"] == "agent.node_check_failed"]
    assert len(failed) == 1 and "failure injected" in failed[0]["metadata"]["reason"], err
    assert any(e["name"] == "agent.excluded" for e in events), err


# A check script that starts a child in a session of its own, then prints 50 MB with no
# newline (a progress bar's worth of redraws without \r), and fails.
FLOOD = """
import os, subprocess, sys
child = subprocess.Popen(["sleep", "311"], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
open(os.path.join(sys.argv[0] + ".child"), "w").write(str(child.pid))
block = b"#" * (1 << 20)
for _ in range(50):
    sys.stdout.buffer.write(block)
sys.stdout.buffer.write(b"disk 3 is bad")
sys.exit(1)
"""


def _sleep_311(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().split(b"\0")[:2] == [b"sleep", b"311"]
    except OSError:
        return False


def test_a_check_script_that_floods_its_output_fails_in_one_short_line_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    check = write_script(tmp_path / "check.py", FLOOD)
    script = write_script(tmp_path / "work.py", "pass\n")
    args = ["--nproc-per-node", "1", "--no-template", "--node-check", "--node-check-timeout",
            "120", "--node-check-script", str(check), str(script)]  # fmt: skip
    child = tmp_path / "check.py.child"
    try:
        done = finish(start(args, cwd=tmp_path), 150)
    finally:
        if child.exists() and _sleep_311(int(child.read_text())):
            os.kill(int(child.read_text()), signal.SIGKILL)
    err = done.stderr
    # Alone (the minimum is one node) it joins anyway, and the job runs.
    assert done.returncode == 0, err[-4000:]
    (line,) = [x for x in err.splitlines() if "failed its check" in x]
    assert f"its check script {check} exited 1: ...####" in line, line[:1000]
    assert "disk 3 is bad; it joins anyway" in line and len(line) < 1000, line[:1000]
    assert "did not finish within" not in err
    assert len(err) < 100_000, f"{len(err)} bytes of stderr"
    # The child the script started in a session of its own ended with the check.
    assert not _sleep_311(int(child.read_text()))


def test_a_node_kept_out_by_its_check_exits_0_when_the_job_finishes_without_it(
    tmp_path: Path,
) -> None:
    script = write_script(tmp_path / "work.py", SCRIPT)
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", endpoint, "--rdzv-id", "satout", "--local-addr", "127.0.0.1",
              "--rdzv-conf", "join_timeout=60,last_call_timeout=1", "--no-template",
              "--node-check", "--node-check-timeout", "60",
              "--exclude-cooldown", "600"]  # fmt: skip
    tail = [str(script), str(tmp_path)]
    nodes = {"good": start([*common, *tail], cwd=tmp_path, env={"NODE_TAG": "good"})}
    time.sleep(0.3)  # the good node serves the rendezvous store
    fail = {"ELASTRUN_TEST_NODE_CHECK": "fail"}
    nodes["sits-out"] = start([*common, *tail], cwd=tmp_path, env={**fail, "NODE_TAG": "s"})
    nodes["leaves"] = start(
        [*common, "--exclude-exit", *tail], cwd=tmp_path, env={**fail, "NODE_TAG": "l"}
    )
    done = {tag: finish(proc, 120) for tag, proc in nodes.items()}
    err = "\n".join(f"--- {n}\n{r.stderr[-4000:]}" for n, r in done.items())
    assert sorted(p.name for p in tmp_path.glob("ran_*")) == ["ran_good"], err
    # The job succeeded; the node that sat it out says so with 0, as a scheduler should
    # see; the one asked to leave at once said "replace this node" (75).
    assert {tag: r.returncode for tag, r in done.items()} == {
        "good": 0, "sits-out": 0, "leaves": 75,
    }, err  # fmt: skip
    assert "it is kept out of the rounds for a cool-down" in done["sits-out"].stderr, err
    assert "the job finished while this node was kept out" in done["sits-out"].stderr, err
    assert "has ended" not in done["sits-out"].stderr, err
