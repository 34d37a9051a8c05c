"""The ``c10d`` backend: the dynamic rendezvous over elastrun's tcp store.

The agent on the endpoint's host serves the store (``is_host`` in ``--rdzv-conf``
overrides the guess); the others connect to it. For a store that outlives any agent, run
``elastrun store --host H --port P`` on a machine of your choice and point every agent at
it. A single node with no endpoint needs no store at all.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from elastrun.core.errors import ConfigError, RendezvousConnectionError, StoreError
from elastrun.core.values import parse_host_port, parse_int, parse_seconds
from elastrun.rendezvous.api import RendezvousHandler, RendezvousParameters
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler
from elastrun.rendezvous.keys import RunKeys
from elastrun.rendezvous.local import LOOPBACK, LocalRendezvousHandler
from elastrun.rendezvous.settings import NodeDesc, RendezvousSettings
from elastrun.store.api import Store
from elastrun.wire.env import STORE_TOKEN_ENV

log = logging.getLogger("elastrun.rendezvous")

DEFAULT_PORT = 29400
DEFAULT_READ_TIMEOUT = 60.0
MAX_KEEP_ALIVE_ATTEMPTS = 1000
#: ``--rdzv-conf`` keys of the dynamic rendezvous, whatever its store (torch's names).
DYNAMIC_KEYS = frozenset(
    {
        "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
        "keep_alive_interval", "keep_alive_max_attempt", "read_timeout",
        "exit_barrier_timeout", "timeout",
    }
)  # fmt: skip
#: ``--rdzv-conf`` keys the c10d backend understands (torch's names plus ours).
KNOWN_KEYS = DYNAMIC_KEYS | {"is_host", "token_file", "store_type"}


def parse_endpoint(
    endpoint: str, default_port: int, *, field: str = "--rdzv-endpoint"
) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]:port`` or a bare IPv6 address -> (host, port).

    An empty endpoint is ``localhost``; a missing port is ``default_port``.

    Raises:
        ConfigError: no host before the ``:``, nothing after it, an unclosed ``[``, or a
            port that is not a number in 0..65535.
    """
    if not endpoint.strip():
        return "localhost", default_port
    host, port = parse_host_port(endpoint, field, default_port)
    assert port is not None  # default_port is an int
    return host, port


def validate_conf(params: RendezvousParameters, known: frozenset[str] = KNOWN_KEYS) -> None:
    """Refuse unknown (often misspelt) ``--rdzv-conf`` keys, naming them."""
    unknown = sorted(set(params.config) - known)
    if unknown:
        raise ConfigError(
            "--rdzv-conf",
            ",".join(unknown),
            f"unknown key(s) for the {params.backend} backend; known: {', '.join(sorted(known))}",
        )


def conf_seconds(params: RendezvousParameters, key: str, default: float) -> float:
    """The ``--rdzv-conf`` duration ``key`` (finite, > 0, at most a year), or ``default``."""
    raw = params.get(key)
    return default if raw is None else parse_seconds(raw, f"--rdzv-conf {key}", low_open=True)


def conf_int(params: RendezvousParameters, key: str, default: int, low: int, high: int) -> int:
    """The ``--rdzv-conf`` integer ``key`` in ``[low, high]``, or ``default``."""
    raw = params.get(key)
    return default if raw is None else parse_int(raw, f"--rdzv-conf {key}", low=low, high=high)


def read_token(params: RendezvousParameters, environ: dict[str, str] | None = None) -> str | None:
    """The store token: ``token_file`` in ``--rdzv-conf``, else ``ELASTRUN_STORE_TOKEN``."""
    path = params.get("token_file")
    if path:
        token = read_conf_file("token_file", path).strip()
        if not token:
            raise ConfigError("--rdzv-conf token_file", path, "is empty")
        return token
    env = os.environ if environ is None else environ
    return env.get(STORE_TOKEN_ENV) or None


def read_conf_file(key: str, path: str) -> str:
    """The text of the file the ``--rdzv-conf`` ``key`` names; ``ConfigError`` naming
    the key when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"--rdzv-conf {key}", path, f"cannot be read: {exc.strerror}") from exc


def settings_from(params: RendezvousParameters) -> RendezvousSettings:
    """The dynamic rendezvous's settings from ``--rdzv-conf`` (torch's key names).

    Raises:
        ConfigError: a value that is not a finite number in its range, naming the key.
    """
    heartbeat = conf_seconds(params, "heartbeat_timeout", 0.0)
    interval = conf_seconds(params, "keep_alive_interval", 5.0)
    attempts = conf_int(params, "keep_alive_max_attempt", 3, 1, MAX_KEEP_ALIVE_ATTEMPTS)
    if not heartbeat:
        heartbeat = parse_seconds(
            interval * attempts,
            "--rdzv-conf keep_alive_interval x keep_alive_max_attempt",
            low_open=True,
        )
    return RendezvousSettings(
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout=conf_seconds(params, "join_timeout", 600.0),
        last_call_timeout=conf_seconds(params, "last_call_timeout", 30.0),
        close_timeout=conf_seconds(params, "close_timeout", 30.0),
        heartbeat_timeout=heartbeat,
    )


@dataclass(frozen=True)
class C10dConf:
    """Everything the c10d and static backends read from their parameters, checked.

    ``local``: a single node that needs no store (its handler is local).
    """

    host: str
    port: int
    local: bool
    is_host: bool | None
    fixed_rank: int | None
    token: str | None
    settings: RendezvousSettings
    read_timeout: float


def _conf(params: RendezvousParameters, host: str, port: int, rank: int | None) -> C10dConf:
    """What both backends read after the endpoint (and the rank), not yet local."""
    settings = settings_from(params)
    read_timeout = conf_seconds(params, "read_timeout", DEFAULT_READ_TIMEOUT)
    is_host = params.get_as_bool("is_host")
    store_type = params.get("store_type")
    if store_type is not None and store_type.strip().lower() != "tcp":
        raise ConfigError("--rdzv-conf store_type", store_type, "only tcp is supported by elastrun")
    return C10dConf(host, port, False, is_host, rank, read_token(params), settings, read_timeout)


def _refuse_port_zero(params: RendezvousParameters, port: int) -> None:
    if port == 0:
        raise ConfigError(
            "--rdzv-endpoint",
            params.endpoint,
            "port 0 (any free port) works for a single node only: the other nodes "
            "could not find it",
        )


def parse_c10d_conf(params: RendezvousParameters) -> C10dConf:
    """Parse and check the c10d backend's parameters; connects to nothing.

    One node with no endpoint, ``localhost:0`` or any ``host:0``, needs no store. With
    more nodes, port 0 is refused: the other nodes could not find a port chosen freely.

    Raises:
        ConfigError: unknown keys or bad values, naming them; an unreadable token file.
    """
    validate_conf(params)
    host, port = parse_endpoint(params.endpoint, DEFAULT_PORT)
    conf = _conf(params, host, port, None)
    if params.max_nodes == 1 and (port == 0 or not params.endpoint.strip()):
        # No endpoint: nothing to serve to anyone, and binding the default port would
        # make a second one-node job on this machine a client of the first's store.
        return dataclasses.replace(conf, local=True)
    _refuse_port_zero(params, port)
    return conf


def parse_static_conf(params: RendezvousParameters) -> C10dConf:
    """Parse and check the static backend's parameters; connects to nothing.

    Raises:
        ConfigError: as :func:`parse_c10d_conf`; also a missing or out-of-range rank,
            an endpoint without a port, or a node count that is a range.
    """
    validate_conf(params, STATIC_KEYS)
    raw_rank = params.get("rank")
    if raw_rank is None:
        raise ConfigError("--node-rank", None, "the static backend needs this node's rank")
    rank = parse_int(raw_rank, "--node-rank", low=0, high=params.max_nodes - 1)
    if not params.endpoint.strip():
        raise ConfigError("--rdzv-endpoint", "", "the static backend needs host:port")
    host, port = parse_endpoint(params.endpoint, -1)
    if port < 0:
        raise ConfigError("--rdzv-endpoint", params.endpoint, "static needs host:port")
    conf = _conf(params, host, port, rank)
    if params.max_nodes == 1:
        return dataclasses.replace(conf, local=True)
    if params.min_nodes != params.max_nodes:
        raise ConfigError(
            "--nnodes", f"{params.min_nodes}:{params.max_nodes}", "static needs a fixed count"
        )
    _refuse_port_zero(params, port)
    is_host = rank == 0 if conf.is_host is None else conf.is_host
    return dataclasses.replace(conf, is_host=is_host)


def looks_like_this_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, our hostname, or one of our IPs)."""
    if host in ("", socket.gethostname(), socket.getfqdn()) or _is_loopback_name(host):
        return True
    try:
        theirs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
        ours = {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return bool(theirs & ours) or any(ipaddress.ip_address(a).is_loopback for a in theirs)


def create_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the c10d handler: serve or join the tcp store, then the dynamic rendezvous.

    Raises:
        ConfigError: bad ``--rdzv-conf`` keys or values, or an unreadable token file.
        RendezvousConnectionError: ``is_host`` was forced and serving failed, or the
            store cannot be reached.
    """
    conf = parse_c10d_conf(params)
    if conf.local:
        return LocalRendezvousHandler(params.run_id, master_addr=params.local_addr or LOOPBACK)
    return _dynamic(params, conf, backend="c10d")


STATIC_KEYS = KNOWN_KEYS | {"rank"}


def create_static_handler(params: RendezvousParameters) -> RendezvousHandler:
    """``static``: a fixed world of ``--nnodes`` nodes, each with its ``--node-rank``.

    One node: MASTER_ADDR/PORT are the endpoint itself, as with torchrun. Several: the
    node of rank 0 serves the store at the endpoint and the round waits for every node.
    """
    conf = parse_static_conf(params)
    if conf.local:
        return LocalRendezvousHandler(
            params.run_id, master_addr=conf.host, master_port=conf.port, backend="static"
        )
    return _dynamic(params, conf, backend="static")


def _dynamic(params: RendezvousParameters, conf: C10dConf, *, backend: str) -> RendezvousHandler:
    host, port, token, forced = conf.host, conf.port, conf.token, conf.is_host
    serve = forced if forced is not None else looks_like_this_host(host)
    stop_server = _try_serve(host, port, token, strict=forced is True) if serve else None
    from elastrun.store.tcp.client import TcpStore

    # read_timeout bounds both: reconnecting, and waiting for an answer. A store that
    # stops answering is given up read_timeout after it went silent (see TcpStore).
    timeout = conf.read_timeout
    store = TcpStore(host, port, token=token, connect_timeout=timeout, request_timeout=timeout)

    def close() -> None:
        store.close()
        if stop_server is not None:
            stop_server()

    hosting = stop_server is not None
    return dynamic_handler(params, store, conf.settings, close, backend, conf.fixed_rank, hosting)


def dynamic_handler(
    params: RendezvousParameters,
    store: Store,
    settings: RendezvousSettings,
    close: Callable[[], None],
    backend: str,
    fixed_rank: int | None = None,
    hosting: bool = False,
    label: str = "",
) -> RendezvousHandler:
    """The dynamic rendezvous over ``store`` (``close`` releases it), once the store
    answers; ``RendezvousConnectionError`` (its message after ``label``) when not."""
    try:
        store.get(RunKeys.of_run(params.run_id).closed)  # fail now, in one line, if unusable
    except StoreError as exc:
        close()
        raise RendezvousConnectionError(f"{label}{exc}") from exc
    addr = params.local_addr or socket.getfqdn()
    node = NodeDesc.create(addr, "default", 0)
    if fixed_rank is not None:
        node = NodeDesc(f"static-rank-{fixed_rank:06d}", addr, "default", 0)
    return DynamicRendezvousHandler(
        store, settings, node, backend=backend, on_shutdown=close, fixed_rank=fixed_rank,
        hosting=hosting,
    )  # fmt: skip


def _try_serve(
    host: str, port: int, token: str | None, *, strict: bool
) -> Callable[[], None] | None:
    from elastrun.store.tcp.server import TcpStoreServer

    bind = host if _is_loopback_name(host) else "0.0.0.0"
    server = TcpStoreServer(host=bind, port=port, token=token)
    try:
        server.start()
    except (OSError, StoreError) as exc:
        if strict:
            raise RendezvousConnectionError(
                f"is_host=true but the store cannot serve on {host}:{port}: {exc}"
            ) from exc
        # Another agent (or `elastrun store`) on this machine already serves it.
        log.debug("not serving the store on port %d (%s); joining it instead", port, exc)
        return None
    log.info("serving the rendezvous store on port %d", server.port)
    return server.stop


def _is_loopback_name(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
