"""The elastrun command line: torchrun 2.13 parity, our improvements, and every error."""

from __future__ import annotations

import argparse
import os
import stat
import sys
import types
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from elastrun.core.errors import ConfigError
from elastrun.launch.argv import build_parser
from elastrun.launch.cli import Launch, ScriptKind, parse_launch
from elastrun.launch.parsers import parse_nnodes, parse_nproc_per_node, parse_rdzv_conf
from elastrun.launch.probe import count_nvidia_gpus
from elastrun.supervise.processes.logs import DefaultLogsSpecs, Std
from elastrun.supervise.processes.numa.policy import NumaOptions

HAS_NVIDIA = Path("/proc/driver/nvidia/gpus").exists()
CPUS = len(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def _no_shutdown_timeout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # LaunchConfig resolves this variable from the process environment.
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


@pytest.fixture
def run(script: str) -> Callable[..., Launch]:
    """``run("--opt", env={...})`` parses ``[*options, script]``."""

    def _run(*options: str, env: Mapping[str, str] | None = None) -> Launch:
        return parse_launch([*options, script], {} if env is None else env)

    return _run


@pytest.fixture
def fail(script: str) -> Callable[..., ConfigError]:
    """``fail("--opt", env={...})``: the ConfigError raised for ``[*options, script]``."""

    def _fail(*options: str, env: Mapping[str, str] | None = None) -> ConfigError:
        with pytest.raises(ConfigError) as info:
            parse_launch([*options, script], {} if env is None else env)
        assert "\n" not in str(info.value)
        return info.value

    return _fail


def _spellings(option: str) -> list[str]:
    under = "--" + option[2:].replace("-", "_")
    return [option] if under == option else [option, under]


# --------------------------------------------------------------------------------------
# Defaults


def test_plain_script_gets_torchrun_defaults_and_runs_standalone(
    run: Callable[..., Launch],
) -> None:
    launch = run()
    config = launch.config
    assert launch.kind is ScriptKind.SCRIPT
    assert launch.standalone is True
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 1)
    assert config.rdzv_backend == "c10d"
    assert config.rdzv_endpoint == "localhost:0"
    uuid.UUID(config.run_id)
    assert config.rdzv_configs == {"timeout": "900"}
    assert config.max_restarts == 0
    assert config.monitor_interval == 0.1
    assert config.start_method == "spawn"
    assert config.role == "default"
    assert config.event_log_handler == "null"
    assert config.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert config.duplicate_stdout_filters is None
    assert config.duplicate_stderr_filters is None
    assert config.virtual_local_rank is False
    assert config.shutdown_timeout == 30.0
    assert config.node_rank == 0
    assert config.master_addr == "127.0.0.1"
    assert config.master_port == 29500
    assert config.local_addr is None
    assert config.log_line_prefix_template is None
    assert config.numa_options is None
    specs = config.logs_specs
    assert type(specs) is DefaultLogsSpecs
    assert (specs.log_dir, specs.redirects, specs.tee) == (None, Std.NONE, Std.NONE)
    assert specs.local_ranks_filter is None
    assert launch.python == sys.executable
    assert launch.dry_run is False
    assert launch.script_args == ()
    assert not any("OMP_NUM_THREADS" in n for n in launch.notices)


def test_script_is_kept_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rel.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert parse_launch(["rel.py"], {}).script == "rel.py"


def test_environ_is_read_only_and_os_environ_untouched(script: str) -> None:
    before = dict(os.environ)
    environ = types.MappingProxyType({"PET_NPROC_PER_NODE": "3"})
    launch = parse_launch([script], environ)
    assert launch.config.nproc_per_node == 3
    assert dict(os.environ) == before


# --------------------------------------------------------------------------------------
# Every value option: both spellings, "--opt value", "--opt=value", PET_<DEST>

Getter = Callable[[Launch], object]
VALUE_CASES: list[tuple[str, tuple[str, ...], str, Getter, object]] = [
    ("--nnodes", (), "1:1", lambda x: (x.config.min_nodes, x.config.max_nodes), (1, 1)),
    ("--nproc-per-node", (), "3", lambda x: x.config.nproc_per_node, 3),
    (
        "--rdzv-backend",
        (),
        "c10d",
        lambda x: (x.config.rdzv_backend, x.standalone),
        ("c10d", False),
    ),
    (
        "--rdzv-endpoint",
        ("--rdzv-backend=c10d",),
        "host:29400",
        lambda x: x.config.rdzv_endpoint,
        "host:29400",
    ),
    ("--rdzv-id", ("--rdzv-backend=c10d",), "job7", lambda x: x.config.run_id, "job7"),
    (
        "--rdzv-conf",
        ("--rdzv-backend=c10d",),
        "join_timeout=5,last_call_timeout=1",
        lambda x: x.config.rdzv_configs,
        {"join_timeout": "5", "last_call_timeout": "1", "timeout": "900"},
    ),
    ("--max-restarts", (), "2", lambda x: x.config.max_restarts, 2),
    ("--monitor-interval", (), "0.5", lambda x: x.config.monitor_interval, 0.5),
    ("--start-method", (), "fork", lambda x: x.config.start_method, "fork"),
    ("--event-log-handler", (), "null", lambda x: x.config.event_log_handler, "null"),
    ("--role", (), "trainer", lambda x: x.config.role, "trainer"),
    # union-attr: logs_specs is Optional; the CLI always sets it
    ("--log-dir", (), "/tmp/elogs", lambda x: x.config.logs_specs.log_dir, "/tmp/elogs"),  # type: ignore[union-attr]
    # union-attr: logs_specs is Optional; the CLI always sets it
    ("--redirects", (), "3", lambda x: x.config.logs_specs.redirects, Std.ALL),  # type: ignore[union-attr]
    (
        "--tee",
        ("--nproc-per-node=2",),
        "0:1,1:2",
        # union-attr: logs_specs is Optional; the CLI always sets it
        lambda x: x.config.logs_specs.tee,  # type: ignore[union-attr]
        {0: Std.OUT, 1: Std.ERR},
    ),
    (
        "--local-ranks-filter",
        ("--nproc-per-node=3",),
        "0,2",
        # union-attr: logs_specs is Optional; the CLI always sets it
        lambda x: x.config.logs_specs.local_ranks_filter,  # type: ignore[union-attr]
        {0, 2},
    ),
    (
        "--duplicate-stdout-filters",
        (),
        "loss,,acc,epoch",
        lambda x: x.config.duplicate_stdout_filters,
        ["loss,acc", "epoch"],
    ),
    (
        "--duplicate-stderr-filters",
        (),
        "warn",
        lambda x: x.config.duplicate_stderr_filters,
        ["warn"],
    ),
    (
        "--node-rank",
        ("--rdzv-backend=c10d",),
        "2",
        lambda x: x.config.node_rank,
        2,
    ),
    (
        "--master-addr",
        ("--master-port=1234",),
        "10.0.0.1",
        lambda x: (x.config.master_addr, x.config.rdzv_endpoint),
        ("10.0.0.1", "10.0.0.1:1234"),
    ),
    (
        "--master-port",
        (),
        "1234",
        lambda x: (x.config.master_port, x.config.rdzv_backend, x.config.rdzv_endpoint),
        (1234, "static", "127.0.0.1:1234"),
    ),
    ("--local-addr", (), "node7", lambda x: x.config.local_addr, "node7"),
    (
        "--signals-to-handle",
        (),
        "SIGTERM,SIGUSR1",
        lambda x: x.config.signals_to_handle,
        "SIGTERM,SIGUSR1",
    ),
    ("--shutdown-timeout", (), "2.5", lambda x: x.config.shutdown_timeout, 2.5),
]
VALUE_IDS = [case[0] for case in VALUE_CASES]


@pytest.mark.parametrize("case", VALUE_CASES, ids=VALUE_IDS)
def test_value_option_both_spellings_and_forms(
    run: Callable[..., Launch], case: tuple[str, tuple[str, ...], str, Getter, object]
) -> None:
    option, extra, value, get, expected = case
    for spelling in _spellings(option):
        assert get(run(*extra, spelling, value)) == expected, spelling
        assert get(run(*extra, f"{spelling}={value}")) == expected, spelling


@pytest.mark.parametrize("case", VALUE_CASES, ids=VALUE_IDS)
def test_value_option_falls_back_to_pet_variable(
    run: Callable[..., Launch], case: tuple[str, tuple[str, ...], str, Getter, object]
) -> None:
    option, extra, value, get, expected = case
    variable = "PET_" + option[2:].replace("-", "_").upper()
    assert get(run(*extra, env={variable: value})) == expected


def test_short_options_redirects_tee_and_module(run: Callable[..., Launch]) -> None:
    specs = run("-r", "1", "-t2").config.logs_specs
    assert specs is not None  # Optional: the CLI always sets it
    assert specs.redirects == Std.OUT
    assert specs.tee == Std.ERR
    assert parse_launch(["-m", "json.tool"], {}).kind is ScriptKind.MODULE


def test_pet_variables_are_converted_like_options(run: Callable[..., Launch]) -> None:
    launch = run(env={"PET_MAX_RESTARTS": "3", "PET_MONITOR_INTERVAL": "2", "PET_NNODES": "1"})
    assert launch.config.max_restarts == 3
    assert isinstance(launch.config.max_restarts, int)
    assert launch.config.monitor_interval == 2.0


def test_explicit_option_beats_pet_variable(run: Callable[..., Launch]) -> None:
    env = {"PET_MAX_RESTARTS": "5", "PET_ROLE": "env", "PET_START_METHOD": "bogus"}
    launch = run("--max-restarts=1", "--role", "cli", "--start-method=fork", env=env)
    assert (launch.config.max_restarts, launch.config.role) == (1, "cli")
    assert launch.config.start_method == "fork"


def test_empty_pet_variable_counts_as_unset(run: Callable[..., Launch]) -> None:
    launch = run(env={"PET_MAX_RESTARTS": "", "PET_MASTER_PORT": "", "PET_STANDALONE": ""})
    assert launch.config.max_restarts == 0
    assert launch.standalone is True


@pytest.mark.parametrize("variable", ["PET_LOGS_SPECS", "PET_NUMA_BINDING", "PET_DRY_RUN"])
def test_options_without_env_fallback_ignore_pet_variables(
    run: Callable[..., Launch], variable: str
) -> None:
    launch = run(env={variable: "1"})
    assert launch.dry_run is False
    assert type(launch.config.logs_specs) is DefaultLogsSpecs


# --------------------------------------------------------------------------------------
# Flags

FLAG_CASES: list[tuple[str, Getter]] = [
    ("--standalone", lambda x: x.notices[0].startswith("running standalone (--standalone)")),
    ("--module", lambda x: x.kind is ScriptKind.MODULE),
    ("--run-path", lambda x: x.kind is ScriptKind.RUN_PATH),
    ("--virtual-local-rank", lambda x: x.config.virtual_local_rank),
]


@pytest.mark.parametrize(("option", "is_on"), FLAG_CASES, ids=[c[0] for c in FLAG_CASES])
def test_flag_both_spellings_and_pet_zero_one(
    run: Callable[..., Launch],
    option: str,
    is_on: Getter,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if option == "--module":
        # "train_x27" names a script file and, with -m, the module train_x27.py.
        monkeypatch.chdir(tmp_path)
        for name in ("train_x27", "train_x27.py"):
            (tmp_path / name).write_text("print('hi')\n")

        def run(*options: str, env: Mapping[str, str] | None = None) -> Launch:
            return parse_launch([*options, "train_x27"], {} if env is None else env)

    for spelling in _spellings(option):
        assert is_on(run(spelling)), spelling
    variable = "PET_" + option[2:].replace("-", "_").upper()
    assert is_on(run(env={variable: "1"}))
    assert not is_on(run(env={variable: "0"}))
    assert not is_on(run())
    assert is_on(run(option, env={variable: "0"}))


@pytest.mark.parametrize(
    "variable",
    ["PET_STANDALONE", "PET_MODULE", "PET_NO_PYTHON", "PET_RUN_PATH", "PET_VIRTUAL_LOCAL_RANK"],
)
def test_bad_boolean_pet_variable_is_a_config_error(
    fail: Callable[..., ConfigError], variable: str
) -> None:
    error = fail(env={variable: "true"})
    assert error.field == variable
    assert "'true'" in str(error)


def test_no_python_both_spellings_and_env(tmp_path: Path) -> None:
    program = tmp_path / "prog"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    for spelling in ("--no-python", "--no_python"):
        assert parse_launch([spelling, str(program)], {}).kind is ScriptKind.BINARY
    assert parse_launch([str(program)], {"PET_NO_PYTHON": "1"}).kind is ScriptKind.BINARY


def test_dry_run_is_ours_both_spellings(run: Callable[..., Launch]) -> None:
    assert run("--dry-run").dry_run is True
    assert run("--dry_run").dry_run is True
    assert run().dry_run is False


# --------------------------------------------------------------------------------------
# Prefixes and pass-through


@pytest.mark.parametrize(
    ("options", "get", "expected"),
    [
        (
            ("--stand",),
            lambda x: x.notices[-1].startswith("running standalone (--standalone)"),
            True,
        ),
        (("--max-r=2",), lambda x: x.config.max_restarts, 2),
        (("--redirect=3",), lambda x: x.config.logs_specs.redirects, Std.ALL),
        (("--nproc=2",), lambda x: x.config.nproc_per_node, 2),  # torchrun: ambiguous
        (("--nproc_p", "2"), lambda x: x.config.nproc_per_node, 2),
        (("--virtual",), lambda x: x.config.virtual_local_rank, True),
    ],
)
def test_unambiguous_prefixes_are_accepted(
    run: Callable[..., Launch], options: tuple[str, ...], get: Getter, expected: object
) -> None:
    assert get(run(*options)) == expected


@pytest.mark.parametrize("prefix", ["--rdzv", "--m", "--duplicate"])
def test_ambiguous_prefix_is_a_config_error(fail: Callable[..., ConfigError], prefix: str) -> None:
    error = fail(f"{prefix}=x")
    assert error.field == prefix
    assert "ambiguous" in str(error)
    assert f"{prefix}=x" in str(error)


def test_everything_after_the_script_is_passed_through(script: str) -> None:
    tail = ["--nnodes=3", "--standalone", "-m", "x", "--", "-h", "--bogus"]
    launch = parse_launch(["--max-restarts=1", script, *tail], {})
    assert launch.script == script
    assert launch.script_args == tuple(tail)
    assert launch.config.max_nodes == 1
    assert launch.kind is ScriptKind.SCRIPT


def test_double_dash_before_script_is_allowed(script: str) -> None:
    launch = parse_launch(["--", script, "a"], {})
    assert (launch.script, launch.script_args) == (script, ("a",))


# --------------------------------------------------------------------------------------
# Standalone, static, rendezvous


def test_explicit_standalone_overrides_backend_endpoint_and_id(run: Callable[..., Launch]) -> None:
    launch = run("--standalone", "--rdzv-backend=static", "--rdzv-endpoint=h:1", "--rdzv-id=mine")
    assert launch.standalone is True
    assert launch.config.rdzv_backend == "c10d"
    assert launch.config.rdzv_endpoint == "localhost:0"
    assert launch.config.run_id != "mine"
    uuid.UUID(launch.config.run_id)
    ignored = [n for n in launch.notices if "ignoring" in n]
    assert ignored == ["--standalone: ignoring --rdzv-backend, --rdzv-endpoint, --rdzv-id"]


def test_standalone_ignores_an_unknown_backend_like_torchrun(run: Callable[..., Launch]) -> None:
    assert run("--standalone", "--rdzv-backend=nonsense").config.rdzv_backend == "c10d"


def test_each_standalone_launch_gets_a_fresh_run_id(run: Callable[..., Launch]) -> None:
    assert run("--standalone").config.run_id != run("--standalone").config.run_id


def test_implicit_standalone_is_announced(run: Callable[..., Launch]) -> None:
    launch = run()
    assert launch.standalone is True
    assert any("running standalone (one node" in n for n in launch.notices)


@pytest.mark.parametrize(
    ("options", "env"),
    [
        (("--master-port=1234",), {}),
        ((), {"PET_MASTER_PORT": "1234"}),
        (("--rdzv-endpoint=10.1.1.1:5000",), {}),
        (("--rdzv-backend=c10d",), {}),
    ],
)
def test_no_implicit_standalone_with_master_port_endpoint_or_other_backend(
    run: Callable[..., Launch], options: tuple[str, ...], env: dict[str, str]
) -> None:
    launch = run(*options, env=env)
    assert launch.standalone is False
    assert not any("standalone" in n for n in launch.notices)


def test_static_with_master_port_keeps_run_id_and_sets_rank(run: Callable[..., Launch]) -> None:
    launch = run("--master-port=1234", "--rdzv-conf=rank=5,timeout=60", "--master-addr=[::1]")
    config = launch.config
    assert config.rdzv_backend == "static"
    assert config.rdzv_endpoint == "[::1]:1234"
    assert config.run_id == "none"
    assert config.rdzv_configs == {"rank": "0", "timeout": "60"}


def test_static_with_explicit_endpoint_uses_it(run: Callable[..., Launch]) -> None:
    config = run("--rdzv-endpoint=h:7", "--master-addr=ignored").config
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "h:7")
    assert config.master_port == 29500


def test_static_node_rank_must_be_below_nnodes(fail: Callable[..., ConfigError]) -> None:
    error = fail("--master-port=1234", "--node-rank=1")
    assert error.field == "--node-rank"
    assert "1" in str(error)


def test_master_addr_and_node_rank_with_c10d_give_notices(run: Callable[..., Launch]) -> None:
    notices = run("--rdzv-backend=c10d", "--master-addr=h", "--node-rank=3").notices
    assert "--master-addr is only used by the static backend; ignored" in notices
    assert "--node-rank is only used by the static backend" in notices


def test_registered_rendezvous_backend_is_accepted(
    run: Callable[..., Launch], plugin_dist: str
) -> None:
    for name in ("plugin-rdzv", "plugin-rdzv-torch"):
        assert run(f"--rdzv-backend={name}").config.rdzv_backend == name


def test_log_line_prefix_template_comes_from_environ(run: Callable[..., Launch]) -> None:
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${rank}]"}
    assert run(env=env).config.log_line_prefix_template == "[${rank}]"


def test_shutdown_timeout_env_fallback_is_resolved_by_launch_config(
    run: Callable[..., Launch], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert run().config.shutdown_timeout == 7.0
    assert run("--shutdown-timeout=0").config.shutdown_timeout == 0.0


# --------------------------------------------------------------------------------------
# --nproc-per-node


def test_nproc_cpu_counts_the_affinity_mask(run: Callable[..., Launch]) -> None:
    launch = run("--nproc-per-node=cpu")
    assert launch.config.nproc_per_node == CPUS
    assert any("one per cpu" in n for n in launch.notices)


@pytest.mark.skipif(HAS_NVIDIA, reason="this machine has NVIDIA GPUs")
def test_nproc_auto_without_gpus_counts_cpus(run: Callable[..., Launch]) -> None:
    assert run("--nproc-per-node=auto").config.nproc_per_node == CPUS


@pytest.mark.skipif(HAS_NVIDIA, reason="this machine has NVIDIA GPUs")
def test_nproc_gpu_without_gpus_is_a_config_error(fail: Callable[..., ConfigError]) -> None:
    error = fail("--nproc-per-node=gpu")
    assert error.field == "--nproc-per-node"
    assert "no GPU found" in str(error)
    assert "'gpu'" in str(error)


@pytest.fixture
def gpus_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "gpus"
    directory.mkdir()
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"):
        (directory / bus).mkdir()
    return directory


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, 4),
        ("1,3", 2),
        ("", 0),
        ("0,0", 0),
        ("0,7,1", 1),
        ("2,abc,1", 1),
        ("-1", 0),
        ("GPU-8f3a,MIG-1", 2),
        (" 1 , 2 ", 2),
    ],
)
def test_gpu_count_is_narrowed_by_cuda_visible_devices(
    gpus_dir: Path, visible: str | None, expected: int
) -> None:
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert count_nvidia_gpus(environ, gpus_dir) == expected


def test_gpu_count_without_driver_is_zero(tmp_path: Path) -> None:
    assert count_nvidia_gpus({}, tmp_path / "absent") == 0


def test_nproc_gpu_and_auto_use_the_gpu_count(gpus_dir: Path) -> None:
    assert parse_nproc_per_node("gpu", {}, gpus_dir=gpus_dir) == (4, "gpu")
    assert parse_nproc_per_node("auto", {"CUDA_VISIBLE_DEVICES": "3"}, gpus_dir=gpus_dir) == (
        1,
        "gpu",
    )
    assert parse_nproc_per_node("auto", {"CUDA_VISIBLE_DEVICES": ""}, gpus_dir=gpus_dir) == (
        CPUS,
        "cpu",
    )
    assert parse_nproc_per_node("7", {}) == (7, None)


def test_omp_notice_only_for_several_workers_without_omp_num_threads(
    run: Callable[..., Launch],
) -> None:
    before = os.environ.get("OMP_NUM_THREADS")
    several = run("--nproc-per-node=2").notices
    assert any("OMP_NUM_THREADS=1" in n for n in several)
    assert os.environ.get("OMP_NUM_THREADS") == before
    assert not any("OMP" in n for n in run("--nproc-per-node=1").notices)
    with_omp = run("--nproc-per-node=2", env={"OMP_NUM_THREADS": "4"}).notices
    assert not any("OMP" in n for n in with_omp)


# --------------------------------------------------------------------------------------
# Bad inputs: one-line ConfigError naming the option (or variable) and the value

BAD_CASES: list[tuple[tuple[str, ...], dict[str, str], str, str]] = [
    (("--nnodes=4:2",), {}, "--nnodes", "4:2"),
    (("--nnodes=0",), {}, "--nnodes", "0"),
    (("--nnodes=a",), {}, "--nnodes", "a"),
    (("--nnodes=1:2:3",), {}, "--nnodes", "1:2:3"),
    (("--nnodes=:2",), {}, "--nnodes", ":2"),
    ((), {"PET_NNODES": "4:2"}, "PET_NNODES", "4:2"),
    (("--nproc-per-node=abc",), {}, "--nproc-per-node", "abc"),
    (("--nproc_per_node=0",), {}, "--nproc_per_node", "0"),
    (("--nproc-per-node=-2",), {}, "--nproc-per-node", "-2"),
    (("--nproc-per-node=xpu",), {}, "--nproc-per-node", "xpu"),
    ((), {"PET_NPROC_PER_NODE": "many"}, "PET_NPROC_PER_NODE", "many"),
    (("--max-restarts=-1",), {}, "--max-restarts", "-1"),
    (("--max-restarts", "-1"), {}, "--max-restarts", "-1"),
    (("--max_restarts=x",), {}, "--max_restarts", "x"),
    ((), {"PET_MAX_RESTARTS": "x"}, "PET_MAX_RESTARTS", "x"),
    (("--monitor-interval=0",), {}, "--monitor-interval", "0"),
    (("--monitor-interval=-1",), {}, "--monitor-interval", "-1"),
    (("--monitor-interval=nan",), {}, "--monitor-interval", "nan"),
    (("--monitor-interval=soon",), {}, "--monitor-interval", "soon"),
    (("--redirects=4",), {}, "--redirects", "4"),
    (("-r", "0:5"), {}, "-r", "0:5"),
    (("-t", "x"), {}, "-t", "x"),
    ((), {"PET_TEE": "9"}, "PET_TEE", "9"),
    (("--local-ranks-filter=a,b",), {}, "--local-ranks-filter", "a,b"),
    (("--start-method=thread",), {}, "--start-method", "thread"),
    (("--signals-to-handle=SIGFOO",), {}, "--signals-to-handle", "SIGFOO"),
    (("--signals-to-handle=SIGTERM,SIGKILL",), {}, "--signals-to-handle", "SIGKILL"),
    ((), {"PET_SIGNALS_TO_HANDLE": "NOPE"}, "PET_SIGNALS_TO_HANDLE", "NOPE"),
    (("--signals-to-handle=SIGTERM,SIGCHLD",), {}, "--signals-to-handle", "SIGCHLD"),
    (("--signals-to-handle=WINCH",), {}, "--signals-to-handle", "WINCH"),
    (("--signals-to-handle=SIGCONT",), {}, "--signals-to-handle", "SIGCONT"),
    ((), {"PET_SIGNALS_TO_HANDLE": "SIGTSTP"}, "PET_SIGNALS_TO_HANDLE", "SIGTSTP"),
    (("--shutdown-timeout=-1",), {}, "--shutdown-timeout", "-1"),
    (("--shutdown-timeout=later",), {}, "--shutdown-timeout", "later"),
    (("--rdzv-conf=a",), {}, "--rdzv-conf", "a"),
    (("--rdzv-conf=a=",), {}, "--rdzv-conf", "a="),
    (("--rdzv-conf==1",), {}, "--rdzv-conf", "=1"),
    (("--rdzv-conf=a=1,",), {}, "--rdzv-conf", "a=1,"),
    ((), {"PET_RDZV_CONF": "x"}, "PET_RDZV_CONF", "x"),
    (("--master-port=70000",), {}, "--master-port", "70000"),
    (("--master-port=-1",), {}, "--master-port", "-1"),
    (("--master_port=http",), {}, "--master_port", "http"),
    (("--nnodes=2", "--node-rank=0", "--master-port=0"), {}, "--master-port", "0"),
    ((), {"PET_NNODES": "2", "PET_MASTER_PORT": "0"}, "PET_MASTER_PORT", "0"),
    (("--standalone", "--nnodes=2"), {}, "--standalone", "True"),
    (("--nnodes=1:2",), {"PET_STANDALONE": "1"}, "PET_STANDALONE", "True"),
    (("--local-addr=node 7",), {}, "--local-addr", "node 7"),
    (("--local-addr=node7:29400",), {}, "--local-addr", "node7:29400"),
    ((), {"PET_LOCAL_ADDR": "n@de"}, "PET_LOCAL_ADDR", "n@de"),
    (("--nnodes=2", "--master-port=1", "--master-addr=my host"), {}, "--master-addr", "my host"),
    (
        ("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=my host:29400"),
        {},
        "--rdzv-endpoint",
        "my host:29400",
    ),
    (
        ("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29500", "--metrics-port=29500"),
        {},
        "--metrics-port",
        "29500",
    ),
    (
        ("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=h", "--metrics-port=29400"),
        {},
        "--metrics-port",
        "29400",
    ),
    (("--nnodes=2", "--master-port=9100", "--metrics-port=9100"), {}, "--metrics-port", "9100"),
    ((), {"PET_MASTER_PORT": "9100", "PET_METRICS_PORT": "9100"}, "PET_METRICS_PORT", "9100"),
    (("--node-rank=-1",), {}, "--node-rank", "-1"),
    (("--node-rank=first",), {}, "--node-rank", "first"),
    (("--event-log-handler=syslog",), {}, "--event-log-handler", "syslog"),
    (("--numa-binding=cpu",), {}, "--numa-binding", "cpu"),
    (("--rdzv-backend=zookeeper",), {}, "--rdzv-backend", "zookeeper"),
    ((), {"PET_RDZV_BACKEND": "zookeeper"}, "PET_RDZV_BACKEND", "zookeeper"),
    (("--logs-specs=fancy",), {}, "--logs-specs", "fancy"),
    (("-m", "--no-python"), {}, "--no-python", "True"),
    (("--bogus",), {}, "--bogus", "--bogus"),
    (("--bogus=3",), {}, "--bogus", "--bogus=3"),
    (("--standalone=1",), {}, "--standalone", "1"),
]


@pytest.mark.parametrize(
    ("options", "env", "field", "value"),
    BAD_CASES,
    ids=[" ".join(c[0]) or str(c[1]) for c in BAD_CASES],
)
def test_bad_input_names_option_and_value(
    fail: Callable[..., ConfigError],
    options: tuple[str, ...],
    env: dict[str, str],
    field: str,
    value: str,
) -> None:
    error = fail(*options, env=env)
    assert error.field == field
    assert str(error).startswith(f"{field}: ")
    assert value in str(error)


@pytest.mark.parametrize("source", ["--rdzv-id", "PET_RDZV_ID"])
def test_a_run_id_too_long_for_a_directory_name_is_refused_in_one_short_line(
    fail: Callable[..., ConfigError], source: str
) -> None:
    long_id = "x" * 10_000
    if source == "PET_RDZV_ID":
        error = fail("--master-port=1", env={"PET_RDZV_ID": long_id})
    else:
        error = fail("--master-port=1", f"--rdzv-id={long_id}")
    assert error.field == source
    assert "10000 bytes" in str(error) and len(str(error)) < 300


def test_a_run_id_of_200_bytes_still_names_a_log_directory(
    run: Callable[..., Launch], tmp_path: Path
) -> None:
    run_id = "\u00e9" * 100  # 200 bytes in UTF-8
    launch = run("--master-port=1", f"--rdzv-id={run_id}", f"--log-dir={tmp_path}")
    specs = launch.config.logs_specs
    assert isinstance(specs, DefaultLogsSpecs)
    specs.reify({0: {"TORCHELASTIC_RUN_ID": run_id}})
    assert specs.run_log_dir is not None and os.path.isdir(specs.run_log_dir)


def test_rdzv_conf_error_names_the_bad_item(fail: Callable[..., ConfigError]) -> None:
    error = fail("--rdzv-conf=a=1,b,c=2")
    assert (error.field, error.value) == ("--rdzv-conf", "b")


def test_missing_script_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        parse_launch(["--standalone"], {})
    assert info.value.field == "script"


def test_option_without_its_value_is_a_config_error(script: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_launch(["--nnodes", "--standalone", script], {})
    assert info.value.field == "--nnodes"
    assert "expects a value" in str(info.value)


def test_missing_script_file_is_a_config_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.py")
    for options in ([], ["--run-path"]):
        with pytest.raises(ConfigError, match="no such file") as info:
            parse_launch([*options, missing], {})
        assert info.value.value == missing


def _package(root: Path, name: str, init: str = "") -> Path:
    """``root/name/__init__.py`` (writing a marker file when imported) and ``train.py``."""
    package = root / name
    package.mkdir(parents=True)
    marker = root / f"{name}-imported"
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n{init}")
    (package / "train.py").write_text("print('train')\n")
    return marker


@pytest.mark.parametrize("name", ["", " ", "1x", "a..b", "pkg.", "my-pkg", "pkg/train"])
def test_a_module_name_that_is_not_one_is_refused(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_launch(["-m", name], {})
    assert (info.value.field, info.value.value) == ("-m", name)


def test_a_module_is_found_in_the_working_directory_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = _package(tmp_path, "mypkg_x27")
    monkeypatch.chdir(tmp_path)  # workers run with the cwd as sys.path[0], as python -m
    for name in ("mypkg_x27", "mypkg_x27.train"):
        assert parse_launch(["-m", name, "a"], {}).kind is ScriptKind.MODULE
    with pytest.raises(ConfigError, match="no such module") as info:
        parse_launch(["-m", "mypkg_x27.trian"], {})
    assert (info.value.field, info.value.value) == ("-m", "mypkg_x27.trian")
    assert not marker.exists(), "the launcher imported the package"
    assert "mypkg_x27" not in sys.modules


@pytest.mark.parametrize("name", ["surely_not_a_module_xyz", "json.surely_not", "json.tool.x"])
def test_a_missing_module_is_refused_without_importing_anything(name: str) -> None:
    before = set(sys.modules)
    with pytest.raises(ConfigError, match="no such module") as info:
        parse_launch(["-m", name, "a"], {})
    assert (info.value.field, info.value.value) == ("-m", name)
    top = name.partition(".")[0]
    assert not {m for m in set(sys.modules) - before if m.startswith(top)}


def test_a_submodule_of_an_old_style_namespace_package_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pkgutil.extend_path: the package's __path__ grows to every sys.path entry's pkg/.
    extend = "from pkgutil import extend_path\n__path__ = extend_path(__path__, __name__)\n"
    marker = _package(tmp_path / "one", "nspkg_x27", extend)
    other = tmp_path / "two" / "nspkg_x27"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text(extend)
    (other / "extra.py").write_text("")
    for entry in ("one", "two"):
        monkeypatch.syspath_prepend(str(tmp_path / entry))
    assert parse_launch(["-m", "nspkg_x27.extra"], {}).script == "nspkg_x27.extra"
    assert not marker.exists()


def test_a_module_is_not_looked_up_for_another_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {"PYTHON_EXEC": str(python)}
    assert parse_launch(["-m", "only_there_x27"], env).script == "only_there_x27"
    with pytest.raises(ConfigError, match="not a module name"):
        parse_launch(["-m", "a..b"], env)


@pytest.mark.parametrize("options", [[], ["--run-path"]])
def test_a_script_that_is_not_a_regular_file_is_refused(tmp_path: Path, options: list[str]) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for script, why in [("/dev/zero", "not a regular file"), (str(fifo), "not a regular file"),
                        (str(tmp_path), "a directory with no __main__.py")]:  # fmt: skip
        with pytest.raises(ConfigError, match=why) as info:
            parse_launch([*options, script], {})
        assert (info.value.field, info.value.value) == ("script", script)


def test_a_directory_with_a_main_module_is_a_script(tmp_path: Path) -> None:
    (tmp_path / "__main__.py").write_text("print('hi')\n")
    assert parse_launch([str(tmp_path)], {}).kind is ScriptKind.SCRIPT


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "bin"
    directory.mkdir()
    program = directory / "trainer"
    program.write_text("#!/bin/sh\n")
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    (directory / "notexec").write_text("")
    return directory


def test_binary_is_found_on_environ_path(bin_dir: Path) -> None:
    launch = parse_launch(["--no-python", "trainer", "-x"], {"PATH": str(bin_dir)})
    assert (launch.kind, launch.script, launch.script_args) == (
        ScriptKind.BINARY,
        "trainer",
        ("-x",),
    )
    assert parse_launch(["--no-python", str(bin_dir / "trainer")], {}).kind is ScriptKind.BINARY


@pytest.mark.parametrize(
    ("program", "path"),
    [("trainer", "/nonexistent"), ("sh-not-there", None), ("notexec", "BIN"), ("BIN/notexec", "")],
)
def test_binary_must_be_executable(bin_dir: Path, program: str, path: str | None) -> None:
    program = program.replace("BIN", str(bin_dir))
    environ = {} if path is None else {"PATH": path.replace("BIN", str(bin_dir))}
    with pytest.raises(ConfigError) as info:
        parse_launch(["--no-python", program], environ)
    assert (info.value.field, info.value.value) == ("script", program)


def test_python_comes_from_python_exec(run: Callable[..., Launch], tmp_path: Path) -> None:
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    assert run(env={"PYTHON_EXEC": str(python)}).python == str(python)
    assert run(env={"PYTHON_EXEC": ""}).python == sys.executable
    with pytest.raises(ConfigError, match="PYTHON_EXEC"):
        run(env={"PYTHON_EXEC": "/opt/no-such-py/bin/python3"})


@pytest.mark.parametrize("program", ["/bin/true", "/bin/echo", "/bin/false"])
def test_a_python_exec_that_runs_no_python_is_refused(
    run: Callable[..., Launch], program: str
) -> None:
    with pytest.raises(ConfigError, match="is not a Python interpreter") as info:
        run(env={"PYTHON_EXEC": program})
    assert (info.value.field, info.value.value) == ("PYTHON_EXEC", program)


def test_a_python_exec_that_does_not_answer_is_given_the_benefit_of_the_doubt(
    tmp_path: Path,
) -> None:
    from elastrun.launch.script import check_python

    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\nsleep 30 &\nwait\n")  # a child too: killed with it
    slow.chmod(0o755)
    check_python(str(slow), {"PATH": os.defpath}, timeout=0.5)


def test_run_path_takes_precedence_over_module_with_a_notice(run: Callable[..., Launch]) -> None:
    launch = run("--run-path", "-m")
    assert launch.kind is ScriptKind.RUN_PATH
    assert any("--run-path takes precedence" in n for n in launch.notices)


# --------------------------------------------------------------------------------------
# etcd backends


def test_the_etcd_backend_is_accepted_with_several_endpoints(
    run: Callable[..., Launch],
) -> None:
    launch = run("--nnodes=2", "--rdzv-backend=etcd", "--rdzv-endpoint=h1:2379,h2:2379,h3:2379",
                 "--rdzv-conf=prefix=/jobs,ttl=5")  # fmt: skip
    assert launch.config.rdzv_backend == "etcd"
    assert launch.config.rdzv_endpoint == "h1:2379,h2:2379,h3:2379"
    assert launch.config.rdzv_configs["ttl"] == "5"


def test_etcd_v2_is_refused_pointing_to_etcd(fail: Callable[..., ConfigError]) -> None:
    error = fail("--rdzv_backend=etcd-v2")
    assert (error.field, error.value) == ("--rdzv_backend", "etcd-v2")
    assert "etcd 3.6 removed" in str(error) and "use --rdzv-backend etcd" in str(error)


def test_numa_events_metrics_and_template_options(run: Callable[..., Launch]) -> None:
    launch = run("--numa-binding=exclusive", "--event-log-handler=file:/tmp/ev.jsonl",
                 "--metrics-port=9100", "--preload=numpy, torch", "--no-template")  # fmt: skip
    cfg = launch.config
    assert isinstance(cfg.numa_options, NumaOptions)
    assert cfg.numa_options.affinity_mode.value == "exclusive"
    assert cfg.event_log_handler == "file:/tmp/ev.jsonl"
    assert cfg.metrics_port == 9100
    assert cfg.preload == ("numpy", "torch")
    assert cfg.use_template is False
    assert run().config.use_template is True


@pytest.mark.parametrize("value", ["file:", "syslog", "console2"])
def test_bad_event_log_handler_is_a_config_error(run: Callable[..., Launch], value: str) -> None:
    with pytest.raises(ConfigError, match="--event-log-handler"):
        run(f"--event-log-handler={value}")


def test_multi_node_launches_are_accepted(run: Callable[..., Launch]) -> None:
    launch = run("--nnodes=1:4", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400")
    assert (launch.config.min_nodes, launch.config.max_nodes) == (1, 4)
    static = run("--nnodes=2", "--master-port=1234", "--node-rank=1")
    assert static.config.rdzv_backend == "static"
    assert static.config.rdzv_configs["rank"] == "1"


# --------------------------------------------------------------------------------------
# --logs-specs and plugins


@pytest.fixture
def plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An installed distribution (on sys.path) declaring our entry points."""
    module = f"elastrun_cli_plugin_{uuid.uuid4().hex[:8]}"
    root = tmp_path / "site"
    root.mkdir()
    (root / f"{module}.py").write_text(
        "from elastrun.supervise.processes.logs import DefaultLogsSpecs\n"
        "class Custom(DefaultLogsSpecs):\n"
        "    pass\n"
        "class NotSpecs:\n"
        "    def __init__(self, **kwargs):\n"
        "        self.kwargs = kwargs\n"
    )
    info = root / "elastrun_cli_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: elastrun-cli-plugin\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[elastrun.logs_specs]\n"
        f"custom = {module}:Custom\n"
        f"wrong = {module}:NotSpecs\n"
        f"broken = {module}_missing:Custom\n"
        "[torchrun.logs_specs]\n"
        f"torchy = {module}:Custom\n"
        "[elastrun.rendezvous]\n"
        f"plugin-rdzv = {module}:handler\n"
        "[torchrun.handlers]\n"
        f"plugin-rdzv-torch = {module}:handler\n"
    )
    monkeypatch.syspath_prepend(str(root))
    yield module
    sys.modules.pop(module, None)


def test_logs_specs_default_and_absent_give_default_logs_specs(run: Callable[..., Launch]) -> None:
    for options in ((), ("--logs-specs=default",), ("--logs_specs", "default")):
        launch = run(*options, "-r3", "--log-dir=/tmp/x", "--local-ranks-filter=1", "--nproc=2")
        specs = launch.config.logs_specs
        assert type(specs) is DefaultLogsSpecs
        assert (specs.log_dir, specs.redirects, specs.local_ranks_filter) == (
            "/tmp/x",
            Std.ALL,
            {1},
        )


@pytest.mark.parametrize("name", ["custom", "torchy"])
def test_logs_specs_plugin_is_loaded_and_built(
    run: Callable[..., Launch], plugin_dist: str, name: str
) -> None:
    specs = run(f"--logs-specs={name}", "-t", "2").config.logs_specs
    assert type(specs).__module__ == plugin_dist
    assert type(specs).__name__ == "Custom"
    assert specs is not None  # Optional: the CLI always sets it
    assert specs.tee == Std.ERR


@pytest.mark.parametrize(
    ("name", "reason"), [("wrong", "not a LogsSpecs"), ("broken", "cannot load")]
)
def test_bad_logs_specs_plugin_is_a_config_error(
    fail: Callable[..., ConfigError], plugin_dist: str, name: str, reason: str
) -> None:
    error = fail(f"--logs-specs={name}")
    assert (error.field, error.value) == ("--logs-specs", name)
    assert reason in str(error)


# --------------------------------------------------------------------------------------
# Value parsers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {}),
        ("   ", {}),
        ("a=1", {"a": "1"}),
        (" a = 1 , b=2 ", {"a": "1", "b": "2"}),
        ("url=h:1/x=y", {"url": "h:1/x=y"}),
        ("a=1,a=2", {"a": "2"}),
        ("is_host=true,read_timeout=60", {"is_host": "true", "read_timeout": "60"}),
    ],
)
def test_rdzv_conf_parsing(text: str, expected: dict[str, str]) -> None:
    assert parse_rdzv_conf(text) == expected


@pytest.mark.parametrize(
    ("text", "item"),
    [
        ("a", "a"),
        ("a=", "a="),
        ("b= ,a=1", "b= "),
        ("=1", "=1"),
        ("a=1,", ""),
        (",a=1", ""),
        ("a=1,,b=2", ""),
    ],
)
def test_rdzv_conf_errors_name_the_item(text: str, item: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_rdzv_conf(text, "PET_RDZV_CONF")
    assert (info.value.field, info.value.value) == ("PET_RDZV_CONF", item)


def test_parse_nnodes() -> None:
    assert parse_nnodes("3") == (3, 3)
    assert parse_nnodes("1:4") == (1, 4)
    with pytest.raises(ConfigError, match="4:2"):
        parse_nnodes("4:2")


# --------------------------------------------------------------------------------------
# The parser itself


def test_help_prints_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_launch(["--help"], {})
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--dry-run" in text and "[elastrun]" in text
    for action in build_parser()._actions:
        for option in action.option_strings:
            if "_" not in option:
                assert option in text, option


def test_help_states_each_options_default_once() -> None:
    # The parser appends "(default: N; env: ...)": a help text that also says
    # "(default N)" printed it twice.
    for action in build_parser()._actions:
        assert (action.help or "").count("(default") <= 1, action.help


def test_every_torchrun_option_is_known() -> None:
    known = {o for a in build_parser()._actions for o in a.option_strings}
    torchrun = {
        "--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
        "--rdzv-conf", "--standalone", "--max-restarts", "--monitor-interval", "--start-method",
        "--event-log-handler", "--role", "-m", "--module", "--no-python", "--run-path",
        "--log-dir", "-r", "--redirects", "-t", "--tee", "--local-ranks-filter",
        "--duplicate-stdout-filters", "--duplicate-stderr-filters", "--node-rank",
        "--master-addr", "--master-port", "--local-addr", "--logs-specs", "--numa-binding",
        "--signals-to-handle", "--shutdown-timeout", "--virtual-local-rank",
    }  # fmt: skip
    underscores = {"--" + o[2:].replace("-", "_") for o in torchrun if o.startswith("--")}
    assert torchrun | underscores <= known


def test_parser_error_raises_config_error() -> None:
    parser = build_parser()
    assert isinstance(parser, argparse.ArgumentParser)
    with pytest.raises(ConfigError):
        parser.parse_args(["--no-such-option", "x.py", "--also"])
    with pytest.raises(ConfigError):
        parser.parse_args([])


# --------------------------------------------------------------------------------------
# Checked before anything starts (tests/e2e/test_bad_input.py runs the command itself)


def test_a_bare_ipv6_master_addr_gets_brackets_in_the_static_endpoint(
    run: Callable[..., Launch], fail: Callable[..., ConfigError]
) -> None:
    assert run("--master-addr", "::1", "--master-port", "29517").config.rdzv_endpoint == (
        "[::1]:29517"
    )
    assert fail("--nnodes=2", "--master-addr", "h:5", "--master-port", "1").field == (
        "--master-addr"
    )


def test_the_rendezvous_is_checked_as_its_backend_reads_it(
    fail: Callable[..., ConfigError],
) -> None:
    err = fail("--rdzv-conf", "last_call_timeout=inf", "--nnodes=2", "--rdzv-backend=c10d")
    assert (err.field, err.value) == ("--rdzv-conf last_call_timeout", "inf")
    err = fail(env={"PET_RDZV_CONF": "read_timeout=nan", "PET_NNODES": "2"})
    assert (err.field, err.value) == ("PET_RDZV_CONF read_timeout", "nan")


def test_loglevel_is_a_level_name_or_a_number_up_to_50() -> None:
    from elastrun.launch.main import parse_log_level

    assert parse_log_level("debug") == 10 and parse_log_level(" WARN ") == 30
    assert parse_log_level("25") == 25
    for bad in ("LOUD", "51", "-1", "nan"):
        with pytest.raises(ConfigError, match="LOGLEVEL"):
            parse_log_level(bad)


def test_exclusion_is_off_by_default_and_set_by_its_options(
    run: Callable[..., Launch], fail: Callable[..., ConfigError]
) -> None:
    from elastrun.rendezvous.exclusion import ExclusionRule

    assert run().config.exclusion == ExclusionRule() and not run().config.exclusion.enabled
    rule = run("--exclude-after", "3", "--exclude-window", "60", "--exclude_cooldown", "5")
    assert rule.config.exclusion == ExclusionRule(after=3, window=60.0, cooldown=5.0)
    env = run(env={"PET_EXCLUDE_AFTER": "2"}).config.exclusion
    assert env.after == 2 and not env.exits
    assert run("--exclude-exit").config.exclusion.exits
    assert fail("--exclude-cooldown", "0").field == "--exclude-cooldown"
    assert fail("--exclude-after", "-1").field == "--exclude-after"


def test_the_node_check_is_off_by_default_and_set_by_its_options(
    run: Callable[..., Launch], fail: Callable[..., ConfigError]
) -> None:
    from elastrun.nodecheck.agent.verdicts import NodeCheckRule

    assert run().config.node_check == NodeCheckRule() and not run().config.node_check.enabled
    on = run("--node-check", "--node-check-timeout", "30", "--node_check_slowdown", "2.5")
    assert on.config.node_check == NodeCheckRule(enabled=True, timeout=30.0, slowdown=2.5)
    env = run(env={"PET_NODE_CHECK": "1", "PET_NODE_CHECK_SCRIPT": __file__})
    assert env.config.node_check.enabled and env.config.node_check.script == __file__
    assert fail("--node-check-script", "/no/such/check.py").field == "--node-check-script"
    assert fail("--node-check-timeout", "0").field == "--node-check-timeout"
    assert fail("--node-check-slowdown", "1").field == "--node-check-slowdown"
