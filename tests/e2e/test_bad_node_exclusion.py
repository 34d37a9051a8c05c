"""A node whose workers keep failing sits out a cool-down: a spare takes its place, the
job finishes, and the node comes back once its cool-down is over. The scripts import
nothing heavy (no torch): each attempt costs little."""

from __future__ import annotations

import itertools
import json
import subprocess
import time
from pathlib import Path

from _helpers import finish, free_port, start, wait_for, write_script

# Each worker leaves a mark (its node's tag and pid). On the bad node it fails, with
# another message each time (a flaky node, not a crash loop): the first time at once (no
# spare yet: one strike, and the group re-forms with it), the second time once the test
# says go (a spare waits by then: the second strike excludes the node).
SCRIPT = """
import os, sys, time
where, tag = sys.argv[1], os.environ["NODE_TAG"]
open(os.path.join(where, f"ran_{tag}_{os.getpid()}"), "w").close()
if tag == "bad":
    second = len([f for f in os.listdir(where) if f.startswith("ran_bad")]) > 1
    while second and not os.path.exists(os.path.join(where, "go")):
        time.sleep(0.05)
    raise RuntimeError(f"bad node, pid {os.getpid()}")
time.sleep(float(sys.argv[2]))
"""


def _node(tmp_path: Path, endpoint: str, tag: str, script: Path, seconds: str,
          nnodes: str = "2", extra: tuple[str, ...] = (),
          env: dict[str, str] | None = None) -> subprocess.Popen[str]:  # fmt: skip
    args = ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "exclusion", "--local-addr", "127.0.0.1",
            "--rdzv-conf", "last_call_timeout=1,join_timeout=60", "--no-template",
            "--max-restarts", "5", "--exclude-after", "2", "--exclude-cooldown", "2",
            "--event-log-handler", f"file:{tmp_path / tag}.jsonl", *extra,
            str(script), str(tmp_path), seconds]  # fmt: skip
    return start(args, cwd=tmp_path, env={"NODE_TAG": tag, **(env or {})})


def _runs(directory: Path) -> dict[str, int]:
    """How many workers each node started (their marks)."""
    tags = [p.name.split("_")[1] for p in directory.glob("ran_*")]
    return {tag: tags.count(tag) for tag in ("good", "bad", "spare")}


def test_a_failing_node_is_excluded_a_spare_replaces_it_and_it_rejoins(tmp_path: Path) -> None:
    script = write_script(tmp_path / "work.py", SCRIPT)
    endpoint = f"127.0.0.1:{free_port()}"
    good = _node(tmp_path, endpoint, "good", script, "5")  # serves the rendezvous store
    time.sleep(0.3)
    bad = _node(tmp_path, endpoint, "bad", script, "5")
    wait_for(lambda: _runs(tmp_path)["bad"] == 2, 60, "the second round")
    spare = _node(tmp_path, endpoint, "spare", script, "5")
    assert spare.stderr is not None
    for line in spare.stderr:  # (its first progress line comes after some seconds)
        if "this node is a spare" in line:
            break
    (tmp_path / "go").touch()
    results = {name: finish(p, 120) for name, p in (("good", good), ("spare", spare), ("bad", bad))}
    err = "\n".join(f"--- {n}\n{r.stderr[-3000:]}" for n, r in results.items())
    assert results["good"].returncode == 0, err
    assert results["spare"].returncode == 0, err
    # Two failures of the bad node (two restarts), then the spare in its place. (The good
    # node's first workers may be stopped before they leave their mark.)
    runs = _runs(tmp_path)
    assert (runs["bad"], runs["spare"]) == (2, 1), err
    bad_err = results["bad"].stderr
    assert "is kept out of the job's rounds (its workers failed 2 times within 600s)" in bad_err
    assert "cool-down is over: it joins the job again" in bad_err, err
    events = [json.loads(x) for x in (tmp_path / "bad.jsonl").read_text().splitlines()]
    told = [e for e in events if e["name"] in ("agent.excluded", "agent.readmitted")]
    assert [e["name"] for e in told] == ["agent.excluded", "agent.readmitted"]
    assert "failed 2 times" in told[0]["metadata"]["reason"]
    # It came back as a spare; the job ended while it waited for room: it ends as the
    # job did.
    assert "job finished while this node was kept out" in bad_err.split("cool-down is over")[-1]
    assert results["bad"].returncode == 0, err


def test_with_exclude_exit_an_excluded_node_leaves_with_replace_this_node(tmp_path: Path) -> None:
    script = write_script(tmp_path / "work.py", SCRIPT)
    (tmp_path / "go").touch()  # the bad node fails at once, every time
    endpoint = f"127.0.0.1:{free_port()}"
    # One strike is enough; the good node alone still makes the minimum of 1.
    extra = ("--exclude-exit", "--exclude-after", "1")
    good = _node(tmp_path, endpoint, "good", script, "3", "1:2", extra)
    time.sleep(0.3)
    bad = _node(tmp_path, endpoint, "bad", script, "3", "1:2", extra)
    results = {name: finish(p, 120) for name, p in (("bad", bad), ("good", good))}
    err = "\n".join(f"--- {n}\n{r.stderr[-3000:]}" for n, r in results.items())
    assert results["bad"].returncode == 75, err
    assert "exit status 75 (replace this node; --exclude-exit)" in results["bad"].stderr
    assert results["good"].returncode == 0, err  # the job went on without it
    assert _runs(tmp_path)["bad"] == 1, err


# Resumes from its node's progress file, as a job resumes from its checkpoint: a restart
# costs the healthy nodes little, but the job ends only once they have done the work.
RESUMING = """
import json, os, sys, time
where, tag = sys.argv[1], os.environ["NODE_TAG"]
open(os.path.join(where, f"ran_{tag}_{os.getpid()}"), "w").close()
if tag == "bad":
    raise RuntimeError(f"bad node, pid {os.getpid()}")

def held():
    # HOLD: the healthy nodes go on until the bad node was readmitted twice and sits
    # out again (its events), however long its checks take on a loaded machine.
    if not os.environ.get("HOLD"):
        return False
    try:
        with open(os.path.join(where, "bad.jsonl")) as fh:
            names = [json.loads(line)["name"] for line in fh if line.strip()]
    except (OSError, ValueError):
        return True
    told = [n for n in names if n in ("agent.excluded", "agent.readmitted")]
    return told.count("agent.readmitted") < 2 or told[-1] != "agent.excluded"

path = os.path.join(where, f"progress_{tag}")
done = int(open(path).read()) if os.path.exists(path) else 0
while done < int(sys.argv[2]) or held():
    time.sleep(0.25)
    done += 1
    with open(path + ".tmp", "w") as fh:
        fh.write(str(done))
    os.replace(path + ".tmp", path)
"""


def test_a_node_that_always_fails_goes_out_for_longer_each_time_and_the_job_finishes(
    tmp_path: Path,
) -> None:
    # Three nodes (--nnodes 2:3), one of which fails at once every time. Its second strike
    # excludes it; each time it comes back it fails at once, and goes out for twice as
    # long. Those failures cost no restart: with a budget of 3 the two healthy nodes
    # finish (a constant cool-down drained the budget and failed the whole job).
    script = write_script(tmp_path / "work.py", RESUMING)
    endpoint = f"127.0.0.1:{free_port()}"
    extra = ("--max-restarts", "3")
    nodes = {}
    for tag in ("good", "spare", "bad"):  # (the spare is a second healthy node here)
        nodes[tag] = _node(tmp_path, endpoint, tag, script, "48", "2:3", extra)
        time.sleep(0.3)
    results = {name: finish(p, 150) for name, p in nodes.items()}
    err = "\n".join(f"--- {n}\n{r.stderr[-4000:]}" for n, r in results.items())
    assert [r.returncode for r in results.values()] == [0, 0, 0], err
    bad_err = results["bad"].stderr
    assert "excluded 2 times in a row, 4s this time" in bad_err, err
    assert "restart budget exhausted" not in err
    events = [json.loads(x) for x in (tmp_path / "bad.jsonl").read_text().splitlines()]
    cooldowns = [e["metadata"]["cooldown_s"] for e in events if e["name"] == "agent.excluded"]
    assert len(cooldowns) >= 2, err
    assert all(b > a * 1.5 for a, b in itertools.pairwise(cooldowns)), (cooldowns, err)


# The bad node's own check: healthy the first time, failing from then on.
CHECK = """#!/bin/sh
echo run >> {where}/checks
[ "$(wc -l < {where}/checks)" -le 1 ]
"""


def test_a_node_back_from_its_cool_down_is_checked_again_before_it_joins(tmp_path: Path) -> None:
    script = write_script(tmp_path / "work.py", RESUMING)
    check = tmp_path / "check.sh"
    check.write_text(CHECK.format(where=tmp_path))
    check.chmod(0o755)
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = {}
    for tag in ("good", "spare", "bad"):
        extra: tuple[str, ...] = ("--max-restarts", "3")
        if tag == "bad":
            extra += ("--node-check", "--node-check-script", str(check))
        nodes[tag] = _node(tmp_path, endpoint, tag, script, "8", "2:3", extra, {"HOLD": "1"})
        time.sleep(0.3)
    results = {name: finish(p, 150) for name, p in nodes.items()}
    err = "\n".join(f"--- {n}\n{r.stderr[-4000:]}" for n, r in results.items())
    # Every node exits 0: the bad one sat out a job that succeeded.
    assert [r.returncode for r in results.values()] == [0, 0, 0], err
    assert "finished while this node was kept out of its rounds" in results["bad"].stderr
    events = [json.loads(x) for x in (tmp_path / "bad.jsonl").read_text().splitlines()]
    told = [e["name"] for e in events if e["name"].startswith(("agent.node_check", "agent.re"))]
    # Its workers fail once (the check passed before its first round), its check fails
    # after that failure; then every readmission is followed by a check, which fails.
    readmitted = [i for i, name in enumerate(told) if name == "agent.readmitted"]
    assert readmitted, (told, err)
    for i in readmitted[:-1]:
        assert told[i + 1] == "agent.node_check_failed", (told, err)
    assert (tmp_path / "checks").read_text().count("run") >= 3, err
