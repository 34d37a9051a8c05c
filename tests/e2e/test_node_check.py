"""The node check on loopback: four nodes and a spare, where one node fails its check
(the test-only fault hook): it is named and kept out, and the job forms with the other
four and finishes. The workers import nothing heavy; each check imports torch once."""

from __future__ import annotations

import json
import time
from pathlib import Path

from _helpers import finish, free_port, start, write_script

SCRIPT = """
import os, sys
open(os.path.join(sys.argv[1], f"ran_{os.environ['NODE_TAG']}"), "w").close()
"""


def _node(tmp_path: Path, endpoint: str, tag: str, script: Path, fault: str = ""):  # type: ignore[no-untyped-def]
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
    assert all(done[tag].returncode == 0 for tag in "abcd"), err
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
