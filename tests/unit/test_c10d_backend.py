"""The c10d/static backend's configuration: endpoints, keys, tokens, registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastrun.core.errors import ConfigError
from elastrun.rendezvous.api import RendezvousParameters
from elastrun.rendezvous.c10d import parse_endpoint, read_token, settings_from, validate_conf
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
        registry.register("mine", LocalRendezvousHandler)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown rendezvous backend"):
        registry.create_handler(RendezvousParameters("nope", "", "r", 1, 1))
