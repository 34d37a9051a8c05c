"""The agent's options: one frozen value, its settings parsed once from the mapping it
is given, bad values refused with the field named."""

from __future__ import annotations

import dataclasses
import math

import pytest

from elastrun.agent.options import (
    DEFAULT_INPROCESS_JOIN_TIMEOUT,
    AgentOptions,
)
from elastrun.core.errors import ConfigError
from elastrun.wire.env import (
    INPROCESS_ENV,
    INPROCESS_JOIN_TIMEOUT_ENV,
    INPROCESS_TIMEOUT_ENV,
    SIGNALS_TO_HANDLE_ENV,
)


def test_the_settings_come_from_the_mapping_given_not_the_process() -> None:
    environ = {
        INPROCESS_ENV: "0",
        SIGNALS_TO_HANDLE_ENV: "SIGTERM,SIGUSR1",
        INPROCESS_TIMEOUT_ENV: "20",
        "PATH": "/bin",
    }
    options = AgentOptions.from_environ(environ, hang_timeout=5.0, shutdown_timeout=3)
    assert not options.inprocess
    assert options.signals_to_handle == "SIGTERM,SIGUSR1"
    assert options.inprocess_timeout == 5.0  # a fixed --hang-timeout is shorter
    assert options.inprocess_join_timeout == DEFAULT_INPROCESS_JOIN_TIMEOUT
    assert options.shutdown_timeout == 3
    assert dict(options.environ) == environ


def test_the_options_and_their_environment_cannot_change() -> None:
    environ = {"A": "1"}
    options = AgentOptions(environ=environ)
    environ["A"] = "2"
    assert options.environ["A"] == "1"
    with pytest.raises(TypeError):
        options.environ["A"] = "3"  # type: ignore[index]  # a Mapping: the set must raise
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.shutdown_timeout = 1  # type: ignore[misc]  # frozen: the set must raise
    assert "environ=<1 variables>" in repr(options)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"start_method": "thread"}, "start_method"),
        ({"shutdown_timeout": -1.0}, "shutdown_timeout"),
        ({"exit_barrier_timeout": math.nan}, "exit_barrier_timeout"),
        ({"inprocess_timeout": 0.0}, "inprocess_timeout"),
    ],
)
def test_a_bad_option_is_refused_with_its_name(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        AgentOptions(**fields)  # type: ignore[arg-type]  # bad values, refused at run time


def test_a_bad_variable_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match=INPROCESS_JOIN_TIMEOUT_ENV):
        AgentOptions.from_environ({INPROCESS_JOIN_TIMEOUT_ENV: "soon"})


def test_the_agents_face_refuses_settings_given_beside_the_options_that_hold_them() -> None:
    from elastrun.agent.spec import WorkerSpec
    from elastrun.launch.local_agent import LocalElasticAgent

    spec = WorkerSpec(local_world_size=1, entrypoint="/bin/true")
    options = AgentOptions.from_environ({})
    with pytest.raises(ConfigError, match=r"set them in options \(got 'shutdown_timeout, start"):
        LocalElasticAgent(spec, options=options, shutdown_timeout=5, start_method="fork")


def test_the_agents_face_refuses_logs_given_both_as_its_argument_and_in_its_world() -> None:
    from elastrun.agent.parts import World
    from elastrun.agent.spec import WorkerSpec
    from elastrun.launch.local_agent import LocalElasticAgent
    from elastrun.supervise.processes.logs import DefaultLogsSpecs

    spec = WorkerSpec(local_world_size=1, entrypoint="/bin/true")
    world = World(logs=DefaultLogsSpecs())
    with pytest.raises(ConfigError, match=r"logs_specs.*given together with world\.logs"):
        LocalElasticAgent(spec, DefaultLogsSpecs(), options=AgentOptions(), world=world)


def test_a_launch_config_gives_its_agent_options_and_zero_turns_a_check_off() -> None:
    from elastrun.launch.config import LaunchConfig

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, start_method="fork",
        exit_barrier_timeout=7, shutdown_timeout=3, stuck_exit_timeout=0,
        stalled_restarts=0, crash_loop_stop=False, hang_timeout="9",
    )  # fmt: skip
    options = config.agent_options({INPROCESS_JOIN_TIMEOUT_ENV: "4"})
    assert (options.start_method, options.exit_barrier_timeout) == ("fork", 7)
    assert (options.shutdown_timeout, options.hang_timeout) == (3, 9)
    assert options.stuck_exit_timeout is None and options.stalled_restarts is None
    assert options.crash_loop_stop is False and options.inprocess_join_timeout == 4
    assert options.inprocess_timeout == 9  # a fixed hang timeout bounds an in-process round
    assert dict(options.environ) == {INPROCESS_JOIN_TIMEOUT_ENV: "4"}
