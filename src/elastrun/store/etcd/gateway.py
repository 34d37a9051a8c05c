"""etcd's v3 JSON gateway: its encodings, endpoints, TLS, and how its errors read.

The gateway answers ``POST /v3/...`` with JSON: keys and values in base64, 64-bit
numbers as strings, zero values left out, errors as ``{"code", "message"}`` (gRPC status
codes), and a streaming call's messages wrapped in ``{"result": ...}`` or
``{"error": ...}``. Errors are sorted here by what they mean for a retry: ``NotSent``
(nothing was applied, ask another member), ``MaybeApplied`` (the outcome is unknown),
``BadToken`` (authenticate again), or one of the store model's errors.
"""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import Sequence
from typing import Any, NoReturn

from elastrun.core.errors import (
    ConfigError,
    LeaseExpiredError,
    StoreAuthError,
    StoreCompactedError,
    StoreError,
)
from elastrun.core.values import parse_host_port

Json = dict[str, Any]

DEFAULT_PORT = 2379

# gRPC status codes that the gateway reports in its error bodies.
_INVALID_ARGUMENT = 3
_DEADLINE_EXCEEDED = 4
_NOT_FOUND = 5
_PERMISSION_DENIED = 7
_RESOURCE_EXHAUSTED = 8
_OUT_OF_RANGE = 11
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16

#: Sent as gRPC metadata: a member that has lost its leader refuses the request at once
#: ("etcdserver: no leader"), before proposing anything, instead of hanging until a
#: timeout whose outcome nobody knows. That refusal is what makes failover safe.
REQUIRE_LEADER = {"Grpc-Metadata-hasleader": "true"}


class NotSent(Exception):
    """The request was not applied: any member may be asked again."""


class MaybeApplied(Exception):
    """The request reached a member and its outcome is unknown."""


class BadToken(Exception):
    """etcd's auth token expired; authenticate again and repeat (nothing was applied)."""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def to_int(value: object) -> int:
    """A 64-bit number as the gateway writes it (a string, or absent for zero)."""
    return int(str(value)) if value not in (None, "") else 0


def prefix_end(prefix: bytes) -> bytes:
    """etcd's ``range_end`` for "every key starting with ``prefix``".

    ``b"\\0"`` means "to the end of the keyspace" (for an empty or all-0xff prefix).
    """
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def parse_endpoints(spec: str | Sequence[str], *, secure: bool = False) -> tuple[str, ...]:
    """Base URLs of the members: ``h1:2379,h2:2379``, ``https://h:2379``, ``[::1]:2379``.

    A missing port is 2379; a missing scheme is ``https`` when ``secure`` else ``http``.

    Raises:
        ConfigError: no endpoint, an unknown scheme, or a port that is not a number.
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    urls = tuple(_url(raw, secure) for raw in items if raw.strip())
    if not urls:
        raise ConfigError("etcd endpoint", spec, "give at least one host:port")
    return urls


def _url(raw: str, secure: bool) -> str:
    item, scheme = raw.strip(), "https" if secure else "http"
    if "://" in item:
        scheme, _, item = item.partition("://")
        if scheme not in ("http", "https"):
            raise ConfigError("etcd endpoint", raw, "the scheme must be http or https")
        item = item.rstrip("/")
    try:
        host, port = parse_host_port(item, "etcd endpoint", DEFAULT_PORT, allow_zero=False)
    except ConfigError as exc:
        raise ConfigError(exc.field, raw, exc.reason) from None
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"


def tls_context(cacert: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """A client TLS context: verify members against ``cacert`` (else the system's CAs),
    and present ``cert``/``key`` when etcd asks for client certificates.

    Raises:
        ConfigError: a file that cannot be read or does not hold what it should.
    """
    if key and not cert:
        raise ConfigError("key", key, "a client key needs its certificate (cert)")
    try:
        context = ssl.create_default_context(cafile=cacert)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("cacert", cacert, f"cannot be loaded: {exc}") from exc
    if cert:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("cert", cert, f"cannot be loaded with its key: {exc}") from exc
    return context


def host_of(url: str) -> str:
    """``host:port`` of a member's base URL, for messages."""
    return url.split("://", 1)[-1]


def describe(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if "Connection refused" in text:
        return "connection refused"
    return " ".join(text.split())


def decode(status: int, content: bytes, url: str) -> Json:
    """A gateway answer as JSON, or its error translated (see the module docstring)."""
    try:
        answer = json.loads(content) if content else {}
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise StoreError(f"{host_of(url)} did not answer as an etcd v3 gateway (HTTP {status})")
    error = answer.get("error")
    if status == 200 and error is None:
        return answer
    if isinstance(error, dict):  # a streaming call's error: {"error": {"grpc_code": ...}}
        stream_message(answer, url)
    if status == 404 and "code" not in answer:
        raise StoreError(f"{host_of(url)} is not an etcd v3 gateway (HTTP 404)")
    raise_for(to_int(answer.get("code")), str(answer.get("message") or error), url)


def stream_message(message: Json, url: str) -> Json:
    """One message of a watch stream: its result, or the error it carries raised."""
    error = message.get("error")
    if isinstance(error, dict):
        code = to_int(error.get("grpc_code", error.get("code")))
        raise_for(code, str(error.get("message")), url)
    result: Json = message.get("result", {})
    if result.get("canceled"):
        compacted = to_int(result.get("compact_revision"))
        if compacted:
            raise StoreCompactedError(
                f"etcd has compacted its history up to revision {compacted}; re-read and resume"
            )
        raise StoreError(f"etcd cancelled the watch: {result.get('cancel_reason', '?')}")
    return result


def raise_for(code: int, message: str, url: str) -> NoReturn:
    text = message.removeprefix("etcdserver: ")
    if "no leader" in text or code == _RESOURCE_EXHAUSTED:
        raise NotSent(text)  # refused before anything was proposed
    if code in (_UNAVAILABLE, _DEADLINE_EXCEEDED) or any(
        words in text for words in ("timed out", "leader changed", "deadline exceeded")
    ):
        raise MaybeApplied(text)
    if "invalid auth token" in text:
        raise BadToken(text)
    if code == _NOT_FOUND and "lease" in text:
        raise LeaseExpiredError(f"etcd: {text}")
    if code == _OUT_OF_RANGE and "compacted" in text:
        raise StoreCompactedError(f"etcd: {text}")
    if (
        code in (_UNAUTHENTICATED, _PERMISSION_DENIED)
        or "authentication failed" in text
        or (code == _INVALID_ARGUMENT and "user name" in text)
    ):
        raise StoreAuthError(f"etcd at {host_of(url)} refused this client: {text}")
    raise StoreError(f"etcd at {host_of(url)}: {text}")
