"""The ``etcd`` rendezvous backend: its ``--rdzv-conf`` keys, and a round on a real etcd."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from etcd_cluster import EtcdCluster, closed_port

from elastrun.core.errors import ConfigError, RendezvousConnectionError
from elastrun.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousParameters
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler
from elastrun.rendezvous.registry import rendezvous_handler_registry
from elastrun.store.etcd import EtcdStore


def params(endpoint: str, nodes: int = 1, **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd", endpoint, "job1", nodes, nodes, "127.0.0.1", **conf)


def create(endpoint: str, nodes: int = 1, **conf: str) -> RendezvousHandler:
    return rendezvous_handler_registry.create_handler(params(endpoint, nodes, **conf))


UNUSED = "127.0.0.1:1"  # configuration errors are raised before etcd is asked anything


@pytest.mark.parametrize(
    ("conf", "field"),
    [
        ({"is_host": "true"}, "--rdzv-conf"),
        ({"ttl": "0"}, "--rdzv-conf ttl"),
        ({"ttl": "2", "heartbeat_timeout": "6"}, "--rdzv-conf ttl"),
        ({"read_timeout": "soon"}, "--rdzv-conf read_timeout"),
        ({"protocol": "ftp"}, "--rdzv-conf protocol"),
        ({"username": "root"}, "--rdzv-conf username"),
        ({"password": "pw"}, "--rdzv-conf username"),
        ({"username": "u", "password": "p", "password_file": "f"}, "--rdzv-conf password_file"),
        ({"username": "u", "password_file": "/nonexistent/pw"}, "--rdzv-conf password_file"),
        ({"cacert": "/nonexistent/ca.pem"}, "--rdzv-conf cacert"),
        ({"key": "/nonexistent/client.key"}, "--rdzv-conf key"),
    ],
)
def test_bad_conf_is_a_config_error_naming_the_key(conf: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        create(UNUSED, 1, **conf)
    assert info.value.field == field
    assert "\n" not in str(info.value)


def test_a_bad_endpoint_is_a_config_error_naming_the_option() -> None:
    with pytest.raises(ConfigError) as info:
        create("h1:2379,h2:port")
    assert (info.value.field, info.value.value) == ("--rdzv-endpoint", "h2:port")


def test_etcd_v2_is_refused_with_a_pointer_to_etcd() -> None:
    with pytest.raises(ConfigError, match=r"etcd 3\.6 removed; use --rdzv-backend etcd"):
        rendezvous_handler_registry.create_handler(
            RendezvousParameters("etcd-v2", "h:2379", "job1", 1, 1)
        )


def test_an_unreachable_etcd_is_a_connection_error_within_read_timeout() -> None:
    endpoints = f"127.0.0.1:{closed_port()},127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as info:
        create(endpoints, read_timeout="1")
    assert time.monotonic() - started < 3.0
    assert "cannot reach etcd" in str(info.value) and "\n" not in str(info.value)


def test_the_join_timeout_bounds_the_first_contact_too() -> None:
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError):
        create(f"127.0.0.1:{closed_port()}", join_timeout="1")
    assert time.monotonic() - started < 3.0


def test_a_round_on_etcd_lives_under_the_prefix_and_is_closed_on_shutdown(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    handlers = [
        create(",".join([UNUSED, *etcd.endpoints]), 2, prefix="/team-a/", ttl="3",
               last_call_timeout="1")
        for _ in range(2)
    ]  # fmt: skip
    assert all(isinstance(h, DynamicRendezvousHandler) for h in handlers)
    assert handlers[0].get_backend() == "etcd"
    first = handlers[0]
    assert isinstance(first, DynamicRendezvousHandler)
    assert first.settings.heartbeat_timeout == 3.0
    infos: list[RendezvousInfo] = []
    threads = [threading.Thread(target=lambda h=h: infos.append(h.next_rendezvous()))
               for h in handlers]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(i.rank for i in infos) == [0, 1]
    raw = EtcdStore(etcd.endpoints)
    try:
        keys, _ = raw.get_prefix("")
        assert keys and all(k.startswith("/team-a/elastrun/job1/") for k in keys)
        for h in handlers:
            h.shutdown()
        assert raw.get("/team-a/elastrun/job1/ctl/closed") == b"finished"
        # Leaving revoked the nodes' leases: their liveness keys are gone at once.
        assert not raw.get_prefix("/team-a/elastrun/job1/ctl/nodes/")[0]
    finally:
        raw.close()


def test_a_password_file_logs_in(etcd: EtcdCluster, tmp_path: Path) -> None:
    etcd.enable_auth("s3cret")
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    handler = create(etcd.endpoints[0], username="root", password_file=str(password))
    handler.shutdown()
    wrong = tmp_path / "wrong"
    wrong.write_text("nope\n")
    with pytest.raises(RendezvousConnectionError, match="refused"):
        create(etcd.endpoints[0], username="root", password_file=str(wrong))
