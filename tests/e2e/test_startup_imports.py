"""What a plain launch loads: only what it uses (DESIGN.md section 8, the agent starts fast).

The launcher runs in a child interpreter (``elastrun.launch.main.main`` called in
process, so that its ``sys.modules`` can be read when it returns); the workers are real.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

#: Loaded only when chosen: servers, asyncio, the other backends, tools and exporters.
NOT_ON_A_PLAIN_LAUNCH = (
    "asyncio",
    "http.server",
    "http.client",
    "ssl",
    "httpx",
    "prometheus_client",
    "elastrun.observe.prometheus",
    "elastrun.observe.health_http",
    "elastrun.observe.timeline",
    "elastrun.launch.k8s",
    "elastrun.launch.slurm",
    "elastrun.launch.commands",
    "elastrun.launch.dryrun",
    "elastrun.rendezvous.etcd",
    "elastrun.store.etcd",
    "elastrun.store.tcp.server",
    "elastrun.store.torchwire.server",
    "elastrun.timer",
    "elastrun.control_plane",
    # The worker template's own machinery runs in the template, never in the agent,
    # which needs only the channel's wire format (elastrun.wire.template).
    "elastrun.template.worker.serve",
    "elastrun.template.worker.fork",
    "elastrun.template.worker.child",
    "elastrun.worker.bootstrap",
    # Needed only by what a plain launch does not do: function workers (pickle), a
    # failure report's times (datetime), reading sysfs for --numa-binding (pathlib).
    "pickle",
    "datetime",
    "pathlib",
)

#: What a template with nothing to preload must not import: it is on the launch's
#: critical path (its start) and every forked worker inherits it.
NOT_IN_A_TEMPLATE = (
    "asyncio",
    "dataclasses",
    "elastrun.launch",
    "elastrun.agent",
    "elastrun.supervise",
    "elastrun.rendezvous",
    "elastrun.store",
    "elastrun.observe",
)

TEMPLATE_DRIVER = """
    import os, sys, time
    from elastrun.supervise.processes.spawn import ProcessSpec
    from elastrun.template.agent.starter import TemplateStarter
    script, out = sys.argv[1], sys.argv[2]
    argv = (sys.executable, "-u", "-m", "elastrun.worker.bootstrap", script, out)
    with TemplateStarter(auto_preload=False) as starter:
        proc = starter.start(ProcessSpec(0, dict(os.environ), argv=argv))
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        code = proc.poll()
        proc.release()
        assert code == 0 and starter.forked == 1, (code, starter)
"""

DRIVER = """
    import json, sys
    from elastrun.launch.main import main
    code = main(sys.argv[2:])
    with open(sys.argv[1], "w") as fh:
        json.dump({"code": code, "modules": sorted(sys.modules)}, fh)
"""


def _loaded(tmp_path: Path, *args: str) -> list[str]:
    script = tmp_path / "work.py"
    script.write_text("print('hello', flush=True)\n")
    out = tmp_path / "modules.json"
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DRIVER), str(out), *args, str(script)],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(out.read_text())
    assert result["code"] == 0
    modules: list[str] = result["modules"]
    return modules


def _offending(modules: list[str], banned: tuple[str, ...] = NOT_ON_A_PLAIN_LAUNCH) -> list[str]:
    return [m for m in modules if any(m == n or m.startswith(n + ".") for n in banned)]


def test_a_plain_eight_worker_launch_loads_no_server_backend_or_tool_it_does_not_use(
    tmp_path: Path,
) -> None:
    modules = _loaded(tmp_path, "--nproc-per-node", "8")
    assert "elastrun.launch.local_agent" in modules  # it did launch
    assert _offending(modules) == []


def test_a_dry_run_loads_neither_the_agent_nor_the_workers_store(tmp_path: Path) -> None:
    modules = _loaded(tmp_path, "--dry-run", "--nproc-per-node", "8")
    assert "elastrun.launch.local_agent" not in modules
    assert "elastrun.store.torchwire" not in modules
    assert [m for m in _offending(modules) if m != "elastrun.launch.dryrun"] == []


def test_a_template_with_nothing_to_preload_hands_its_workers_only_worker_side_modules(
    tmp_path: Path,
) -> None:
    # The worker's first line reads sys.modules: what the template imported, no more.
    script = tmp_path / "work.py"
    script.write_text("import json, sys\njson.dump(sorted(sys.modules), open(sys.argv[1], 'w'))\n")
    out = tmp_path / "modules.json"
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TEMPLATE_DRIVER), str(script), str(out)],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    modules: list[str] = json.loads(out.read_text())
    assert "elastrun.template.worker.child" in modules  # it was forked from the template
    assert _offending(modules, NOT_IN_A_TEMPLATE) == []
