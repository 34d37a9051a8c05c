"""The launch plan: ranks, worker environment and command lines (pure functions)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.agent.plan import (
    NodeSlot,
    RoundFacts,
    assign_ranks,
    build_plan,
    substitute_local_rank,
    with_bootstrap,
    worker_env,
)
from elastrun.core.errors import ConfigError

FACTS = RoundFacts(
    run_id="job",
    round=0,
    group_rank=0,
    group_world_size=1,
    master_addr="127.0.0.1",
    master_port=1234,
    restart_count=2,
    max_restarts=5,
)

nodes_strategy = st.lists(
    st.builds(NodeSlot, st.sampled_from(["trainer", "reader"]), st.integers(1, 8)),
    min_size=1,
    max_size=12,
)


@given(nodes_strategy)
def test_ranks_cover_the_world_exactly_once(nodes: list[NodeSlot]) -> None:
    all_ranks = [r for g in range(len(nodes)) for r in assign_ranks(g, nodes)]
    world = sum(n.local_world_size for n in nodes)
    assert sorted(r.global_rank for r in all_ranks) == list(range(world))
    assert all(r.world_size == world for r in all_ranks)
    for role in {n.role for n in nodes}:
        role_ranks = [
            r.role_rank
            for g, n in enumerate(nodes)
            if n.role == role
            for r in assign_ranks(g, nodes)
        ]
        assert sorted(role_ranks) == list(range(len(role_ranks)))


@given(nodes_strategy)
def test_global_ranks_follow_group_rank_order(nodes: list[NodeSlot]) -> None:
    firsts = [assign_ranks(g, nodes)[0].global_rank for g in range(len(nodes))]
    assert firsts == sorted(firsts)


def test_group_rank_outside_the_world_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="group_rank"):
        assign_ranks(3, [NodeSlot("a", 1)])


def test_environment_has_every_torchrun_variable() -> None:
    (ranks,) = assign_ranks(0, [NodeSlot("default", 1)])
    env = worker_env(FACTS, ranks, role="default", local_world_size=1, base_env={})
    assert env == {
        "LOCAL_RANK": "0",
        "RANK": "0",
        "GROUP_RANK": "0",
        "ROLE_RANK": "0",
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": "1",
        "WORLD_SIZE": "1",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_RUN_ID": "job",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def test_omp_threads_default_only_for_several_workers_and_unset() -> None:
    ranks = assign_ranks(0, [NodeSlot("d", 2)])[0]
    assert (
        worker_env(FACTS, ranks, role="d", local_world_size=2, base_env={})["OMP_NUM_THREADS"]
        == "1"
    )
    env = worker_env(FACTS, ranks, role="d", local_world_size=2, base_env={"OMP_NUM_THREADS": "4"})
    assert "OMP_NUM_THREADS" not in env  # inherited from the agent as it is
    nccl = worker_env(
        FACTS,
        ranks,
        role="d",
        local_world_size=2,
        base_env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
    )
    assert nccl["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_virtual_local_rank_narrows_visible_devices() -> None:
    ranks = assign_ranks(0, [NodeSlot("d", 2)])
    base = {"CUDA_VISIBLE_DEVICES": "3, 5"}
    envs = [
        worker_env(FACTS, r, role="d", local_world_size=2, base_env=base, virtual_local_rank=True)
        for r in ranks
    ]
    assert [(e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs] == [("0", "3"), ("0", "5")]
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        worker_env(
            FACTS,
            assign_ranks(0, [NodeSlot("d", 3)])[2],
            role="d",
            local_world_size=3,
            base_env=base,
            virtual_local_rank=True,
        )


@pytest.mark.parametrize(
    "args, expected",
    [
        (("-u", "t.py", "-m", "x"), ("-u", "-m", "elastrun.worker.bootstrap", "t.py", "-m", "x")),
        (("-u", "-m", "pkg.t", "a"), ("-u", "-m", "elastrun.worker.bootstrap", "-m", "pkg.t", "a")),
        (("-W", "error", "t.py"), ("-W", "error", "-m", "elastrun.worker.bootstrap", "t.py")),
        (("-c", "print(1)"), None),
        (("-u",), None),
        (("-m",), None),
    ],
)
def test_python_command_lines_get_the_bootstrap(args: tuple[str, ...], expected: object) -> None:
    assert with_bootstrap(args) == expected


def test_local_rank_macro_is_substituted_in_strings_only() -> None:
    assert substitute_local_rank(["--r=${local_rank}", 3, "$x"], 7) == ("--r=7", 3, "$x")


def test_plan_uses_the_bootstrap_only_for_our_own_interpreter() -> None:
    plan = functools.partial(
        build_plan,
        FACTS,
        role="d",
        local_world_size=1,
        nodes=[NodeSlot("d", 1)],
        args=["-u", "t.py"],
        base_env={},
    )
    ours = plan(entrypoint="/py", python="/py")
    other = plan(entrypoint="/other", python="/py")
    assert ours.workers[0].argv == ("/py", "-u", "-m", "elastrun.worker.bootstrap", "t.py")
    assert other.workers[0].argv == ("/other", "-u", "t.py")


def test_the_plan_names_every_variable_the_agent_provides_at_run_time() -> None:
    from elastrun.agent.plan import RunTimeValue, WorkerServices

    services = WorkerServices(file_timer=True, inprocess=True, signals_to_handle="SIGTERM")
    plan = build_plan(
        FACTS, role="d", local_world_size=1, nodes=[NodeSlot("d", 1)], entrypoint="/py",
        args=("x.py",), base_env={}, python="/py", services=services,
    )  # fmt: skip
    worker = plan.workers[0]
    assert worker.env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM"
    assert worker.runtime == {
        "TORCHELASTIC_ERROR_FILE": RunTimeValue.ERROR_FILE,
        "ELASTRUN_STACKS_FILE": RunTimeValue.STACKS_FILE,
        "ELASTRUN_PROGRESS_FILE": RunTimeValue.PROGRESS_FILE,
        "ELASTRUN_PROGRESS_SLOT": RunTimeValue.PROGRESS_SLOT,
        "TORCHELASTIC_TIMER_FILE": RunTimeValue.TIMER_FILE,
        "ELASTRUN_INPROCESS_SOCKET": RunTimeValue.INPROCESS_SOCKET,
        "ELASTRUN_CHECKPOINT_DIR": RunTimeValue.CHECKPOINT_DIR,
    }
    given = build_plan(
        FACTS, role="d", local_world_size=1, nodes=[NodeSlot("d", 1)], entrypoint="/py",
        args=("x.py",), base_env={"TORCHELASTIC_TIMER_FILE": "/f"}, python="/py",
        services=services,
    ).workers[0]  # fmt: skip
    assert given.env["TORCHELASTIC_TIMER_FILE"] == "/f"
    assert "TORCHELASTIC_TIMER_FILE" not in given.runtime


def test_the_executor_can_fill_in_only_the_run_time_variables_the_plan_names() -> None:
    from elastrun.agent.plan import resolve_env

    worker = build_plan(
        FACTS, role="d", local_world_size=1, nodes=[NodeSlot("d", 1)], entrypoint="/py",
        args=("x.py",), base_env={}, python="/py",
    ).workers[0]  # fmt: skip
    env = resolve_env(
        {"HOME": "/h", "RANK": "9"},
        worker,
        {"ELASTRUN_PROGRESS_FILE": "/b", "ELASTRUN_PROGRESS_SLOT": "0", "OTHER": "x"},
    )
    assert env["HOME"] == "/h" and env["RANK"] == "0"  # the plan's over the agent's
    assert env["ELASTRUN_PROGRESS_FILE"] == "/b" and "OTHER" not in env
    assert "ELASTRUN_STACKS_FILE" not in env  # not provided: left out


def test_every_variable_the_plan_and_a_worker_share_is_named_once_in_the_wire() -> None:
    # The names live in elastrun.wire; no other module spells one out.
    from elastrun.wire import checkpoint, env, inprocess, progress

    names = {
        *(v for n in env.__all__ if isinstance(v := getattr(env, n), str)),
        progress.PROGRESS_FILE_ENV,
        progress.PROGRESS_SLOT_ENV,
        inprocess.SOCKET_ENV,
        checkpoint.CHECKPOINT_DIR_ENV,
    }
    src = Path(env.__file__).resolve().parent.parent
    spelled = [
        f"{path.relative_to(src)}: {name}"
        for path in sorted(src.rglob("*.py"))
        if path.parent.name != "wire"
        for name in sorted(names)
        if re.search(rf"^[A-Z_]+ = \"{name}\"", path.read_text(), re.MULTILINE)
    ]
    assert spelled == []
