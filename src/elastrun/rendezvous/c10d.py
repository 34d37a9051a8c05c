"""The ``c10d`` backend: the dynamic rendezvous over elastrun's tcp store.

The agent on the endpoint's host serves the store (``is_host`` in ``--rdzv-conf``
overrides the guess); the others connect to it. For a store that outlives any agent, run
``elastrun store --host H --port P`` on a machine of your choice and point every agent at
it. A single node with no endpoint needs no store at all.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable

from elastrun.core.errors import ConfigError, RendezvousConnectionError, StoreError
from elastrun.rendezvous.api import RendezvousHandler, RendezvousParameters
from elastrun.rendezvous.dynamic import DynamicRendezvousHandler, NodeDesc, RendezvousSettings
from elastrun.rendezvous.local import LOOPBACK, LocalRendezvousHandler

log = logging.getLogger("elastrun.rendezvous")

DEFAULT_PORT = 29400
TOKEN_ENV = "ELASTRUN_STORE_TOKEN"
#: ``--rdzv-conf`` keys the c10d backend understands (torch's names plus ours).
KNOWN_KEYS = frozenset(
    {
        "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
        "keep_alive_interval", "keep_alive_max_attempt", "read_timeout", "is_host",
        "token_file", "exit_barrier_timeout", "store_type", "timeout",
    }
)  # fmt: skip


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]:port`` or a bare IPv6 address -> (host, port).

    Raises:
        ConfigError: a port that is not a number in 0..65535.
    """
    text = endpoint.strip()
    if not text:
        return "localhost", default_port
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") > 1:  # a bare IPv6 address: no port (torch mis-parses it)
        host, port_text = text, ""
    else:
        host, _, port_text = text.partition(":")
    if not port_text:
        return host, default_port
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError("--rdzv-endpoint", endpoint, "the port is not a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError("--rdzv-endpoint", endpoint, "the port must be in 0..65535")
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


def _seconds(params: RendezvousParameters, key: str, default: float) -> float:
    raw = params.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"--rdzv-conf {key}", raw, "must be a number of seconds") from None
    if value <= 0:
        raise ConfigError(f"--rdzv-conf {key}", raw, "must be > 0")
    return value


def read_token(params: RendezvousParameters, environ: dict[str, str] | None = None) -> str | None:
    """The store token: ``token_file`` in ``--rdzv-conf``, else ``ELASTRUN_STORE_TOKEN``."""
    path = params.get("token_file")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise ConfigError(
                "--rdzv-conf token_file", path, f"cannot be read: {exc.strerror}"
            ) from exc
        if not token:
            raise ConfigError("--rdzv-conf token_file", path, "is empty")
        return token
    env = os.environ if environ is None else environ
    return env.get(TOKEN_ENV) or None


def settings_from(params: RendezvousParameters) -> RendezvousSettings:
    heartbeat = _seconds(params, "heartbeat_timeout", 0.0)
    if not heartbeat:
        interval = _seconds(params, "keep_alive_interval", 5.0)
        attempts = params.get_as_int("keep_alive_max_attempt", 3) or 3
        heartbeat = interval * attempts
    return RendezvousSettings(
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout=_seconds(params, "join_timeout", 600.0),
        last_call_timeout=_seconds(params, "last_call_timeout", 30.0),
        close_timeout=_seconds(params, "close_timeout", 30.0),
        heartbeat_timeout=heartbeat,
    )


def looks_like_this_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, our hostname, or one of our IPs)."""
    if host in ("localhost", "", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
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
    validate_conf(params)
    if params.max_nodes == 1 and params.endpoint in ("", "localhost:0"):
        return LocalRendezvousHandler(params.run_id, master_addr=params.local_addr or LOOPBACK)
    forced = params.get_as_bool("is_host")
    return _dynamic(params, DEFAULT_PORT, forced, backend="c10d", fixed_rank=None)


STATIC_KEYS = KNOWN_KEYS | {"rank"}


def create_static_handler(params: RendezvousParameters) -> RendezvousHandler:
    """``static``: a fixed world of ``--nnodes`` nodes, each with its ``--node-rank``.

    One node: MASTER_ADDR/PORT are the endpoint itself, as with torchrun. Several: the
    node of rank 0 serves the store at the endpoint and the round waits for every node.
    """
    validate_conf(params, STATIC_KEYS)
    rank = params.get_as_int("rank")
    if rank is None:
        raise ConfigError("--node-rank", None, "the static backend needs this node's rank")
    if not params.endpoint:
        raise ConfigError("--rdzv-endpoint", "", "the static backend needs host:port")
    host, port = parse_endpoint(params.endpoint, -1)
    if port < 0:
        raise ConfigError("--rdzv-endpoint", params.endpoint, "static needs host:port")
    if params.max_nodes == 1:
        return LocalRendezvousHandler(
            params.run_id, master_addr=host, master_port=port, backend="static"
        )
    if params.min_nodes != params.max_nodes:
        raise ConfigError(
            "--nnodes", f"{params.min_nodes}:{params.max_nodes}", "static needs a fixed count"
        )
    forced = params.get_as_bool("is_host")
    return _dynamic(
        params, port, rank == 0 if forced is None else forced, backend="static", fixed_rank=rank
    )


def _dynamic(
    params: RendezvousParameters,
    default_port: int,
    forced: bool | None,
    *,
    backend: str,
    fixed_rank: int | None,
) -> RendezvousHandler:
    host, port = parse_endpoint(params.endpoint, default_port)
    token = read_token(params)
    settings = settings_from(params)
    read_timeout = _seconds(params, "read_timeout", 60.0)
    serve = forced if forced is not None else looks_like_this_host(host)
    stop_server: Callable[[], None] | None = None
    if serve:
        stop_server = _try_serve(host, port, token, strict=forced is True)
    from elastrun.store.tcp.client import TcpStore

    store = TcpStore(host, port, token=token, connect_timeout=read_timeout)
    try:
        store.get(f"/elastrun/{params.run_id}/ctl/closed")  # fail now, clearly, if unreachable
    except StoreError as exc:
        store.close()
        if stop_server is not None:
            stop_server()
        raise RendezvousConnectionError(str(exc)) from exc

    def close() -> None:
        store.close()
        if stop_server is not None:
            stop_server()

    addr = params.local_addr or socket.getfqdn()
    node = NodeDesc.create(addr, "default", 0)
    if fixed_rank is not None:
        node = NodeDesc(f"static-rank-{fixed_rank:06d}", addr, "default", 0)
    return DynamicRendezvousHandler(
        store,
        settings,
        node,
        backend=backend,
        on_shutdown=close,
        fixed_rank=fixed_rank,
        hosting=stop_server is not None,
    )


def _try_serve(
    host: str, port: int, token: str | None, *, strict: bool
) -> Callable[[], None] | None:
    from elastrun.store.tcp.server import TcpStoreServer

    bind = "" if not _is_loopback_name(host) else host
    server = TcpStoreServer(host=bind or "0.0.0.0", port=port, token=token)
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
    stop: Callable[[], None] = server.stop
    return stop


def _is_loopback_name(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
