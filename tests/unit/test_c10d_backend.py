"""The c10d/static backend's configuration: endpoints, keys, tokens, registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastrun.core.errors import ConfigError
from elastrun.rendezvous.api import RendezvousParameters
from elastrun.rendezvous.c10d import (
    create_c10d_handler,
    parse_c10d_conf,
    parse_endpoint,
    parse_static_conf,
    read_token,
    settings_from,
    validate_conf,
)
from elastrun.rendezvous.local import LocalRendezvousHandler
from elastrun.rendezvous.registry import RendezvousHandlerRegistry


def _params(**conf: str) -> RendezvousParameters:
    return RendezvousParameters("c10d", "127.0.0.1:1", "job", 1, 2, **conf)


@pytest.mark.parametrize(
    "text, port",
    [("h:5", ("h", 5)), ("h", ("h", 29400)), ("[::1]:7", ("::1", 7)), ("::1", ("::1", 29400))],
)
def test_endpoints_parse_like_torch_but_bare_ipv6_works(text: str, port: tuple[str, int]) -> None:
    assert parse_endpoint(text, 29400) == port


def test_a_misspelt_rdzv_conf_key_is_named() -> None:
    with pytest.raises(ConfigError, match="join_timeot"):
        validate_conf(_params(join_timeot="5"))


def test_timeouts_and_heartbeat_from_torch_keys() -> None:
    s = settings_from(
        _params(join_timeout="7", keep_alive_interval="2", keep_alive_max_attempt="4")
    )
    assert (s.join_timeout, s.heartbeat_timeout) == (7.0, 8.0)
    with pytest.raises(ConfigError, match="last_call_timeout"):
        settings_from(_params(last_call_timeout="-1"))


def test_token_from_file_or_environment(tmp_path: Path) -> None:
    token = tmp_path / "t"
    token.write_text("abc\n")
    assert read_token(_params(token_file=str(token))) == "abc"
    assert read_token(_params(), {"ELASTRUN_STORE_TOKEN": "xyz"}) == "xyz"
    with pytest.raises(ConfigError, match="token_file"):
        read_token(_params(token_file=str(tmp_path / "missing")))


def test_a_backend_registered_in_code_is_usable_by_name() -> None:
    registry = RendezvousHandlerRegistry()

    def create(params: RendezvousParameters) -> LocalRendezvousHandler:
        return LocalRendezvousHandler(params.run_id, backend="mine")

    registry.register("mine", create)
    handler = registry.create_handler(RendezvousParameters("mine", "", "r", 1, 1))
    assert handler.get_backend() == "mine" and handler.next_rendezvous().world_size == 1
    with pytest.raises(ConfigError, match="already registered"):
        # arg-type: not a creator: the name is refused before it is called
        registry.register("mine", LocalRendezvousHandler)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown rendezvous backend"):
        registry.create_handler(RendezvousParameters("nope", "", "r", 1, 1))


# -- checked before anything starts ------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["h:", "[::1", "[::1]:", ":29400", "h:99999", "h:abc"])
def test_a_malformed_endpoint_is_refused_naming_the_option(endpoint: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_c10d_conf(RendezvousParameters("c10d", endpoint, "job", 2, 2))
    assert (info.value.field, info.value.value) == ("--rdzv-endpoint", endpoint)


def test_no_endpoint_is_a_local_single_node_and_the_default_port_for_several() -> None:
    # One node with no endpoint serves nothing: two such jobs on a machine stay apart.
    assert parse_c10d_conf(RendezvousParameters("c10d", "", "job", 1, 1)).local
    several = parse_c10d_conf(RendezvousParameters("c10d", "", "job", 1, 2))
    assert (several.local, several.host, several.port) == (False, "localhost", 29400)


def test_port_0_is_a_local_single_node_and_refused_for_several() -> None:
    assert parse_c10d_conf(RendezvousParameters("c10d", "127.0.0.1:0", "job", 1, 1)).local
    assert isinstance(
        create_c10d_handler(RendezvousParameters("c10d", "127.0.0.1:0", "job", 1, 1)),
        LocalRendezvousHandler,
    )
    with pytest.raises(ConfigError, match="single node only"):
        parse_c10d_conf(RendezvousParameters("c10d", "127.0.0.1:0", "job", 1, 2))


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("join_timeout", "nan"),
        ("last_call_timeout", "inf"),
        ("close_timeout", "nan"),
        ("heartbeat_timeout", "-1"),
        ("keep_alive_interval", "1e12"),
        ("keep_alive_max_attempt", "-3"),
        ("keep_alive_max_attempt", "0"),
        ("read_timeout", "0"),
    ],
)
def test_numeric_keys_are_checked_even_for_a_local_single_node(key: str, bad: str) -> None:
    params = RendezvousParameters("c10d", "", "job", 1, 1, **{key: bad})
    with pytest.raises(ConfigError) as info:
        create_c10d_handler(params)
    assert (info.value.field, info.value.value) == (f"--rdzv-conf {key}", bad)


def test_the_heartbeat_from_interval_and_attempts_is_capped_too() -> None:
    with pytest.raises(ConfigError, match="keep_alive_interval x keep_alive_max_attempt"):
        settings_from(_params(keep_alive_interval="31536000", keep_alive_max_attempt="2"))


def test_only_the_tcp_store_type_is_accepted() -> None:
    assert parse_c10d_conf(_params(store_type="tcp")) is not None
    with pytest.raises(ConfigError, match="store_type"):
        parse_c10d_conf(_params(store_type="file"))


def test_the_static_rank_must_be_below_the_node_count() -> None:
    params = RendezvousParameters("static", "127.0.0.1:1", "job", 2, 2, rank="2")
    with pytest.raises(ConfigError) as info:
        parse_static_conf(params)
    assert (info.value.field, info.value.value) == ("--node-rank", "2")


def test_the_registry_checks_built_in_backends_without_connecting() -> None:
    registry = RendezvousHandlerRegistry()
    # Nothing listens on port 1: a check that connected would fail differently.
    registry.check(RendezvousParameters("c10d", "127.0.0.1:1", "job", 2, 2))
    with pytest.raises(ConfigError, match="join_timeout"):
        registry.check(RendezvousParameters("c10d", "127.0.0.1:1", "job", 2, 2, join_timeout="x"))
    # A backend registered in code checks its own parameters when created.
    registry.register("c10d", create_c10d_handler)
    registry.check(RendezvousParameters("c10d", "127.0.0.1:1", "job", 2, 2, join_timeout="x"))
