"""The ``etcd`` backend: the dynamic rendezvous over an etcd v3 cluster.

For jobs that must not lose their rendezvous with any one machine: give every agent all
the members (``--rdzv-endpoint h1:2379,h2:2379,h3:2379``) and the job carries on when
any of them, the leader included, goes away. Each agent's liveness is an etcd lease
(``ttl`` seconds), so a node that dies is dropped when its lease runs out.

``--rdzv-conf`` keys, besides the dynamic rendezvous ones (``join_timeout``,
``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout``...):

``prefix``          prepended to every key (runs live under ``<prefix>/elastrun/<run_id>/``)
``ttl``             the lease TTL in seconds (the same as ``heartbeat_timeout``)
``read_timeout``    how long one etcd call keeps trying every member (default 10 s)
``protocol``        ``http`` (default) or ``https`` for endpoints given without a scheme
``cacert``, ``cert``, ``key``              TLS (any of them implies ``https``)
``username``, ``password``/``password_file``  etcd authentication

``etcd-v2`` -- torch's backend for etcd's v2 API, which etcd 3.6 removed -- is answered
with a pointer to ``etcd``.
"""

from __future__ import annotations

import dataclasses
import ssl
from dataclasses import dataclass

from elastrun.core.errors import ConfigError
from elastrun.rendezvous.api import RendezvousHandler, RendezvousParameters
from elastrun.rendezvous.c10d import (
    DYNAMIC_KEYS,
    conf_seconds,
    dynamic_handler,
    read_conf_file,
    settings_from,
    validate_conf,
)
from elastrun.rendezvous.settings import RendezvousSettings
from elastrun.store.etcd import EtcdStore, parse_endpoints, tls_context

ETCD_V2_REASON = "speaks etcd's v2 API, which etcd 3.6 removed; use --rdzv-backend etcd"
DEFAULT_ENDPOINT = "localhost:2379"
DEFAULT_READ_TIMEOUT = 10.0
#: ``--rdzv-conf`` keys of the etcd backend: the dynamic rendezvous's, then etcd's own.
KNOWN_KEYS = DYNAMIC_KEYS | {
    "prefix", "ttl", "protocol", "cacert", "cert", "key", "username", "password", "password_file"
}  # fmt: skip


def create_etcd_v2(params: RendezvousParameters) -> RendezvousHandler:
    """Refuse ``etcd-v2`` with a pointer to ``etcd``.

    Raises:
        ConfigError: always.
    """
    raise ConfigError("--rdzv-backend", params.backend, ETCD_V2_REASON)


@dataclass(frozen=True)
class EtcdConf:
    """Everything the etcd backend reads from its parameters, checked."""

    settings: RendezvousSettings
    read_timeout: float
    endpoints: tuple[str, ...]
    ssl_context: ssl.SSLContext | None
    namespace: str
    username: str | None
    password: str | None


def parse_etcd_conf(params: RendezvousParameters) -> EtcdConf:
    """Parse and check the etcd backend's parameters; connects to nothing.

    Raises:
        ConfigError: unknown ``--rdzv-conf`` keys, bad values (naming the key),
            endpoints, or unreadable TLS or password files.
    """
    validate_conf(params, KNOWN_KEYS)
    settings = settings_from(params)
    if params.get("ttl") is not None:
        if params.get("heartbeat_timeout"):
            raise ConfigError("--rdzv-conf ttl", params.get("ttl"), "give ttl or heartbeat_timeout")
        ttl = conf_seconds(params, "ttl", settings.heartbeat_timeout)
        settings = dataclasses.replace(settings, heartbeat_timeout=ttl)
    read_timeout = conf_seconds(params, "read_timeout", DEFAULT_READ_TIMEOUT)
    protocol = (params.get("protocol") or "http").strip().lower()
    if protocol not in ("http", "https"):
        raise ConfigError("--rdzv-conf protocol", protocol, "must be http or https")
    cacert, cert, key = params.get("cacert"), params.get("cert"), params.get("key")
    secure = protocol == "https" or any((cacert, cert, key))
    try:
        endpoints = parse_endpoints(params.endpoint or DEFAULT_ENDPOINT, secure=secure)
    except ConfigError as exc:
        raise ConfigError("--rdzv-endpoint", exc.value, exc.reason) from None
    try:
        context = tls_context(cacert, cert, key) if secure else None
    except ConfigError as exc:
        raise ConfigError(f"--rdzv-conf {exc.field}", exc.value, exc.reason) from None
    username, password = _credentials(params)
    return EtcdConf(
        settings=settings,
        read_timeout=min(read_timeout, settings.join_timeout),
        endpoints=endpoints,
        ssl_context=context,
        namespace=(params.get("prefix") or "").rstrip("/"),
        username=username,
        password=password,
    )


def create_etcd_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the ``etcd`` handler: check that etcd answers, then the dynamic rendezvous.

    Raises:
        ConfigError: unknown ``--rdzv-conf`` keys, bad values, unreadable TLS or password
            files, or httpx missing.
        RendezvousConnectionError: no member answered, or etcd refused this client, within
            ``read_timeout`` (and the join timeout).
    """
    conf = parse_etcd_conf(params)
    store = _make_store(conf)
    return dynamic_handler(
        params, store, conf.settings, store.close, "etcd", label="etcd rendezvous: "
    )


def _make_store(conf: EtcdConf) -> EtcdStore:
    try:
        return EtcdStore(
            conf.endpoints,
            namespace=conf.namespace,
            ssl_context=conf.ssl_context,
            username=conf.username,
            password=conf.password,
            request_timeout=conf.read_timeout,
        )
    except ImportError as exc:  # httpx, imported when the store is made
        raise ConfigError(
            "--rdzv-backend", "etcd", "needs the httpx package: pip install 'elastrun[etcd]'"
        ) from exc


def _credentials(params: RendezvousParameters) -> tuple[str | None, str | None]:
    username, password, path = (
        params.get("username"), params.get("password"), params.get("password_file")
    )  # fmt: skip
    if password and path:
        raise ConfigError("--rdzv-conf password_file", path, "give password or password_file")
    if path:
        password = read_conf_file("password_file", path).rstrip("\r\n")
    if bool(username) != (password is not None):
        raise ConfigError(
            "--rdzv-conf username", username, "etcd authentication needs a username and a password"
        )
    return username or None, password
