"""Every bad number, path or value is refused before anything starts.

The project rule (DESIGN.md section 6): a configuration error exits with status 2 and
ONE line on stderr that names the option or variable and shows the bad value; no
traceback, no worker, no store, no rendezvous; within 2 seconds. Each case runs the
real command with a script that would leave a marker file behind if a worker ever
started, and a timeout, so that a value that hangs fails instead of blocking. The 2
seconds are checked as the CPU time the command used: on a loaded machine its wall time
is mostly the wait for a core (a refusal takes a few tenths of a CPU-second).

Bad ``--rdzv-conf`` values are checked for every numeric key of every built-in backend
in-process (through ``main``) as well: the same code path, without 100 interpreters.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from _helpers import ELASTRUN, run, write_script
from elastrun.launch.main import main

#: The rule's bound on the whole command (interpreter start included), taken as the CPU
#: time it used: its wall time is also the time it waited for a core, which on a loaded
#: 2-core machine is several times as long.
WITHIN = 2.0
#: A command still running after this waits for something (a store, a peer): a hang, not
#: a refusal. Each wait a missed check would start lasts longer (the store's connect
#: window, the rendezvous' timeouts).
HANG = 20.0
SCRIPT = "would_start.py"
MARKER = "worker-started"
#: A multi-node c10d job whose endpoint nothing serves: only a check can end it early.
MULTI = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-id", "job"]
C10D = [*MULTI, "--rdzv-endpoint", "127.0.0.1:1"]
ETCD = ["--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-id", "job"]
K8S = ["k8s", "manifest", "--name", "a", "--image", "i", "--nnodes", "1:2"]


@dataclass(frozen=True)
class Case:
    """``args`` (``{dir}`` is the test's directory), extra ``env``; the one stderr
    line must contain ``names`` and ``shows``."""

    id: str
    args: list[str]
    names: str
    shows: str
    env: dict[str, str] = field(default_factory=dict)
    read_only_dir: bool = False  # needs a directory this process really cannot write


def _v(value: str) -> str:
    return repr(value)  # how ConfigError shows a value: "(got 'nan')"


CASES = [
    # --log-dir and PET_LOG_DIR
    Case("log-dir-is-a-file", ["--log-dir", "afile", SCRIPT], "--log-dir", _v("afile")),
    Case("log-dir-under-a-file", ["--log-dir", "afile/x", SCRIPT], "--log-dir", _v("afile/x")),
    Case("pet-log-dir-is-a-file", [SCRIPT], "PET_LOG_DIR", _v("afile"), {"PET_LOG_DIR": "afile"}),
    Case(
        "log-dir-read-only",
        ["--log-dir", "ro", SCRIPT],
        "--log-dir",
        _v("ro"),
        read_only_dir=True,
    ),
    Case(
        "log-dir-under-read-only",
        ["--log-dir", "ro/logs", SCRIPT],
        "--log-dir",
        _v("ro/logs"),
        read_only_dir=True,
    ),
    # Unwritable even for root: the write probe, not os.access, finds it.
    Case(
        "log-dir-in-proc",
        ["--log-dir", "/proc/elastrun-logs", SCRIPT],
        "--log-dir",
        _v("/proc/elastrun-logs"),
    ),
    # --rdzv-conf values
    *(
        Case(
            f"rdzv-conf-{conf}",
            [*extra, "--rdzv-conf", conf, SCRIPT],
            f"--rdzv-conf {conf.split('=')[0]}",
            _v(conf.split("=")[1]),
        )
        for extra, conf in [
            ([], "exit_barrier_timeout=abc"),
            ([], "exit_barrier_timeout=-5"),
            ([], "join_timeout=nan"),
            (C10D, "join_timeout=nan"),
            (C10D, "last_call_timeout=inf"),
            (C10D, "heartbeat_timeout=nan"),
            (C10D, "keep_alive_max_attempt=-3"),
            ([], "close_timeout=nan"),
            (C10D, "close_timeout=nan"),
            (C10D, "read_timeout=0"),
        ]
    ),
    Case(
        "rdzv-conf-from-pet-variable",
        [SCRIPT],
        "PET_RDZV_CONF join_timeout",
        _v("nan"),
        {"PET_RDZV_CONF": "join_timeout=nan"},
    ),
    Case(
        "rdzv-conf-store-type-file",
        ["--rdzv-conf", "store_type=file", SCRIPT],
        "--rdzv-conf store_type",
        _v("file"),
    ),
    # sizes
    Case(
        "nproc-per-node-huge-dry-run",
        ["--nproc-per-node", "99999999", "--dry-run", SCRIPT],
        "--nproc-per-node",
        "from 1 to 1024 (got '99999999')",
    ),
    Case(
        "nproc-per-node-huge",
        ["--nproc-per-node", "99999999", SCRIPT],
        "--nproc-per-node",
        _v("99999999"),
    ),
    Case("nnodes-huge", ["--nnodes", "1:999999999", SCRIPT], "--nnodes", _v("1:999999999")),
    # endpoints
    *(
        Case(
            f"rdzv-endpoint-{ep}",
            [*MULTI, "--rdzv-endpoint", ep, SCRIPT],
            "--rdzv-endpoint",
            _v(ep),
        )
        for ep in ["host:", "[::1", "[::1]:", ":29400", "host:99999", "host:abc", "127.0.0.1:0"]
    ),
    Case(
        "etcd-endpoint-without-port",
        [*ETCD, "--rdzv-endpoint", "h:", SCRIPT],
        "--rdzv-endpoint",
        _v("h:"),
    ),
    Case(
        "master-addr-unclosed",
        ["--nnodes", "2", "--master-addr", "[::1", "--master-port", "1", SCRIPT],
        "--master-addr",
        _v("[::1"),
    ),
    # host names are spelt right, checked without a lookup (these failed after 41 s)
    Case(
        "rdzv-endpoint-host-with-a-space",
        [*MULTI, "--rdzv-endpoint", "my host:29400", SCRIPT],
        "--rdzv-endpoint",
        _v("my host:29400"),
    ),
    Case("local-addr-junk", [*C10D, "--local-addr", "n@de!", SCRIPT], "--local-addr", "n@de!"),
    Case(
        "metrics-port-is-the-rendezvous-port",
        [*MULTI, "--rdzv-endpoint", "127.0.0.1:29555", "--metrics-port", "29555", SCRIPT],
        "--metrics-port",
        "(got 29555)",
    ),
    Case(
        "master-port-0-for-two-nodes",
        ["--nnodes", "2", "--node-rank", "0", "--master-port", "0", SCRIPT],
        "--master-port",
        "(got 0)",
    ),
    Case("standalone-two-nodes", ["--standalone", "--nnodes", "2", SCRIPT], "--standalone", "2"),
    Case(
        "empty-run-id-multi-node",
        [*C10D, "--rdzv-id", "", SCRIPT],
        "--rdzv-id",
        _v(""),
    ),
    # torch's environment variables
    *(
        Case(f"env-{name}", [SCRIPT], name, _v(value), {name: value})
        for name, value in [
            ("TORCHELASTIC_HEALTH_CHECK_PORT", "abc"),
            ("TORCHELASTIC_HEALTH_CHECK_PORT", "70000"),
            ("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "abc"),
            ("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "inf"),
            ("TORCHELASTIC_ENABLE_FILE_TIMER", "yes"),
            ("LOGLEVEL", "LOUD"),
            ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "nan"),
            ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "inf"),
            ("PYTHON_EXEC", "/nonexistent/bin/python3"),
            ("ELASTRUN_STORE_ENGINE", "fast"),
        ]
    ),
    Case(
        "env-TORCHELASTIC_TIMER_FILE-in-a-missing-directory",
        [SCRIPT],
        "TORCHELASTIC_TIMER_FILE",
        _v("no/such/dir/fifo"),
        {"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TORCHELASTIC_TIMER_FILE": "no/such/dir/fifo"},
    ),
    # logs
    Case(
        "local-ranks-filter-beyond-workers",
        ["--nproc-per-node", "2", "--local-ranks-filter", "99", SCRIPT],
        "--local-ranks-filter",
        _v("99"),
    ),
    Case(
        "redirects-for-a-rank-beyond-workers",
        ["--nproc-per-node", "2", "--redirects", "5:3", SCRIPT],
        "--redirects",
        _v("5:3"),
    ),
    Case(
        "event-log-under-a-file",
        ["--event-log-handler", "file:afile/events.jsonl", SCRIPT],
        "--event-log-handler",
        _v("file:afile/events.jsonl"),
    ),
    # durations
    Case(
        "shutdown-timeout-nan", ["--shutdown-timeout", "nan", SCRIPT], "--shutdown-timeout", "nan"
    ),
    Case(
        "monitor-interval-1e9", ["--monitor-interval", "1e9", SCRIPT], "--monitor-interval", "1e9"
    ),
    # scripts and modules the workers could not run
    Case("script-dev-zero", ["/dev/zero"], "script", _v("/dev/zero")),
    Case("script-a-directory", ["."], "script", "no __main__.py"),
    Case("module-empty", ["-m", ""], "-m", _v("")),
    Case("module-missing", ["-m", "surely_not_a_module_x27"], "-m", "no such module"),
    Case("python-exec-true", [SCRIPT], "PYTHON_EXEC", "/bin/true", {"PYTHON_EXEC": "/bin/true"}),
    # signals that do not ask a process to end (SIGCHLD: the first worker exit)
    Case(
        "signals-to-handle-sigchld",
        ["--signals-to-handle", "SIGTERM,SIGCHLD", SCRIPT],
        "--signals-to-handle",
        _v("SIGCHLD"),
    ),
    # a run id longer than a directory name may be (it names the log directory)
    Case(
        "rdzv-id-10000-characters",
        [*C10D, "--rdzv-id", "x" * 10_000, SCRIPT],
        "--rdzv-id",
        "10000 bytes",
    ),
    # subcommands
    Case(
        "store-disconnect-grace-nan",
        ["store", "--port", "0", "--disconnect-grace", "nan"],
        "--disconnect-grace",
        _v("nan"),
    ),
    Case("store-port-abc", ["store", "--port", "abc"], "--port", _v("abc")),
    Case(
        "store-max-frame-huge",
        ["store", "--port", "0", "--max-frame", "99999999999"],
        "--max-frame",
        _v("99999999999"),
    ),
    Case("stacks-timeout-inf", ["stacks", "--timeout", "inf", "."], "--timeout", _v("inf")),
    # the node check's script: a directory, or (not a .py, run as a program) not executable
    Case(
        "node-check-script-dir",
        ["--node-check-script", ".", SCRIPT],
        "--node-check-script",
        "is not a file (got '.')",
    ),
    Case(
        "node-check-script-not-executable",
        ["--node-check-script", "afile", SCRIPT],
        "--node-check-script",
        "is not executable (only a .py file is run with python) (got 'afile')",
    ),
    Case(
        "k8s-nproc-per-node-huge",
        [*K8S, "--nproc-per-node", "99999", "--", SCRIPT],
        "--nproc-per-node",
        _v("99999"),
    ),
]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    write_script(
        tmp_path / SCRIPT,
        f"""
        import pathlib
        pathlib.Path(__file__).with_name({MARKER!r}).write_text("started")
        """,
    )
    (tmp_path / "afile").write_text("a file, not a directory\n")
    return tmp_path


def _read_only_dir(workdir: Path) -> None:
    ro = workdir / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    # Root (tests may run as root) writes anyway; then there is nothing to refuse.
    if os.access(ro, os.W_OK):
        pytest.skip("this process can write in a read-only directory (root): nothing to refuse")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_bad_value_exits_2_with_one_line_before_anything_starts(
    workdir: Path, case: Case
) -> None:
    if case.read_only_dir:
        _read_only_dir(workdir)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(
        [*ELASTRUN, *case.args],
        cwd=workdir,
        env={**os.environ, **case.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=HANG)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"still running after {HANG}s (a hang, not a refusal); stderr:\n{err}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    lines = err.splitlines()
    assert proc.returncode == 2, err
    assert len(lines) == 1 and lines[0].strip(), f"expected one line, got:\n{err}"
    assert "Traceback" not in err
    assert case.names in lines[0] and case.shows in lines[0], lines[0]
    assert not (workdir / MARKER).exists(), "a worker started"
    assert cpu < WITHIN, f"the refusal took {cpu:.2f} CPU-s"


def test_an_empty_variable_counts_as_unset_and_the_job_runs(workdir: Path) -> None:
    # As torchrun takes an empty PET_* variable for unset, elastrun's own variables too.
    env = {"ELASTRUN_STORE_ENGINE": "", "PET_MAX_RESTARTS": ""}
    done = run(["--nproc-per-node", "1", "--no-template", SCRIPT], cwd=workdir, env=env)
    assert done.returncode == 0, done.stderr
    assert (workdir / MARKER).exists()


# --------------------------------------------------------------------------------------
# Every numeric --rdzv-conf key of every built-in backend, in-process.

DYNAMIC_KEYS = [
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
    "exit_barrier_timeout",
    "timeout",
]
BACKENDS = {
    "c10d": (C10D, DYNAMIC_KEYS),
    "static": (["--nnodes", "2", "--master-port", "1"], DYNAMIC_KEYS),
    "etcd": ([*ETCD, "--rdzv-endpoint", "h:1"], [*DYNAMIC_KEYS, "ttl"]),
}
MATRIX = [
    (backend, key, bad)
    for backend, (_, keys) in BACKENDS.items()
    for key in keys
    for bad in ("nan", "inf", "-5", "abc", "1e12")
]


@pytest.mark.parametrize(("backend", "key", "bad"), MATRIX)
def test_every_numeric_rdzv_conf_key_of_every_backend_is_checked(
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    backend: str,
    key: str,
    bad: str,
) -> None:
    monkeypatch.chdir(workdir)
    args = [*BACKENDS[backend][0], "--rdzv-conf", f"{key}={bad}", SCRIPT]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--rdzv-conf {key}: " in err and repr(bad) in err, err
    assert not (workdir / MARKER).exists()


def test_the_python_api_refuses_nan_too() -> None:
    from elastrun import LaunchConfig
    from elastrun.core.errors import ConfigError

    with pytest.raises(ConfigError, match="--monitor-interval"):
        LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, monitor_interval=float("nan"))
    with pytest.raises(ConfigError, match="--shutdown-timeout"):
        LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, shutdown_timeout=float("inf"))
