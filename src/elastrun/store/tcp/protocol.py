"""The wire protocol of the tcp store: framing, handshake and message encoding.

Every message is one **frame**: a 4-byte big-endian length, then that many bytes of
UTF-8 JSON holding one object. Values are bytes and travel base64-encoded. Nothing is
ever unpickled: a peer can at worst send JSON we reject.

A connection starts with a handshake, before which the server serves nothing:

1. server -> client ``{"type": "challenge", "version": 1, "nonce": <b64>, "auth": bool,
   "max_frame": int}`` (``nonce`` is 32 fresh random bytes);
2. client -> server ``{"type": "hello", "version": 1, "proof": <hex> | null,
   "resume": [lease ids]}``; ``proof`` is HMAC-SHA256 of the nonce keyed by the shared
   token, so the token itself never crosses the wire;
3. server -> client ``{"type": "welcome", "version": 1, "resumed": [ids], "lost": [ids]}``
   or ``{"type": "error", "code": "auth" | "version", "message": ...}`` and a close.

Then the client sends requests ``{"id": int, "op": str, ...arguments}`` and the server
answers each with ``{"id": int, "ok": true, "result": ...}`` or ``{"id": int, "ok":
false, "code": str, "message": str}``. Answers may come out of order (a blocked
``watch`` does not hold up a later ``get``), which is why every request has an id.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import socket
import struct
from collections.abc import Mapping

from elastrun.core.errors import (
    LeaseExpiredError,
    StoreAuthError,
    StoreCompactedError,
    StoreError,
    StoreTimeoutError,
)
from elastrun.store.api import EventKind, WatchEvent, WatchResult

#: Bumped on any incompatible change of the messages below.
PROTOCOL_VERSION = 1
#: Largest frame either side accepts unless configured otherwise. The largest answer a
#: rendezvous asks for is the read of every live node (a re-formation's decider reads
#: them): about 150 bytes a node, 7.3 MB at 50,000 nodes, which 4 MiB refused.
DEFAULT_MAX_FRAME = 64 * 1024 * 1024
#: Frames before authentication are tiny; a stranger cannot make us buffer megabytes.
HANDSHAKE_MAX_FRAME = 64 * 1024
HEADER = struct.Struct(">I")
NONCE_BYTES = 32

_PROOF_CONTEXT = b"elastrun-store-auth-v1:"

# Error codes on the wire and the exception each one becomes on the client.
CODE_AUTH = "auth"
CODE_VERSION = "version"
CODE_LEASE_EXPIRED = "lease_expired"
CODE_TIMEOUT = "timeout"
CODE_COMPACTED = "compacted"
CODE_STORE = "store"
CODE_BAD_REQUEST = "bad_request"
CODE_TOO_LARGE = "too_large"

_ERRORS: dict[str, type[StoreError]] = {
    CODE_AUTH: StoreAuthError,
    CODE_LEASE_EXPIRED: LeaseExpiredError,
    CODE_TIMEOUT: StoreTimeoutError,
    CODE_COMPACTED: StoreCompactedError,
}

Message = dict[str, object]


class FrameError(StoreError):
    """A frame is oversized or is not a JSON object: the connection must be closed."""


def error_code(exc: StoreError) -> str:
    """The wire code of a store error (the most specific class wins)."""
    for code, cls in _ERRORS.items():
        if isinstance(exc, cls):
            return code
    return CODE_STORE


def error_from_code(code: object, message: str) -> StoreError:
    """The client-side exception for an error answer."""
    cls = _ERRORS.get(code, StoreError) if isinstance(code, str) else StoreError
    return cls(message)


def proof(token: str, nonce: bytes) -> str:
    """The client's answer to a challenge: HMAC-SHA256(token, context + nonce), hex."""
    return hmac.new(token.encode(), _PROOF_CONTEXT + nonce, hashlib.sha256).hexdigest()


def check_proof(token: str, nonce: bytes, offered: object) -> bool:
    """Whether ``offered`` proves knowledge of ``token`` (compared in constant time)."""
    if not isinstance(offered, str):
        return False
    return hmac.compare_digest(proof(token, nonce).encode(), offered.encode())


# -- frames ------------------------------------------------------------------------------


def encode(message: Mapping[str, object], max_frame: int) -> bytes:
    """One frame holding ``message``; raises ``FrameError`` when it exceeds ``max_frame``."""
    return _frame(encode_json(message), max_frame)


def encode_ok(rid: int, result_json: bytes, max_frame: int) -> bytes:
    """The frame of a successful answer whose result is already encoded as JSON: what
    ``encode({"id": rid, "ok": True, "result": ...})`` makes, without encoding the result
    again (many watchers woken by one change share one result)."""
    return _frame(b'{"id":%d,"ok":true,"result":%s}' % (rid, result_json), max_frame)


def _frame(body: bytes, max_frame: int) -> bytes:
    if len(body) > max_frame:
        raise FrameError(f"message of {len(body)} bytes exceeds the {max_frame}-byte frame limit")
    return HEADER.pack(len(body)) + body


def encode_json(value: object) -> bytes:
    """``value`` as the JSON that ``encode`` writes inside a frame."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def frame_length(header: bytes, max_frame: int) -> int:
    """The body length announced by a header; raises ``FrameError`` when oversized."""
    (length,) = HEADER.unpack(header)
    if length > max_frame:
        raise FrameError(f"frame of {length} bytes exceeds the {max_frame}-byte limit")
    return int(length)


def decode(body: bytes) -> Message:
    """The JSON object in a frame body; raises ``FrameError`` for anything else."""
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FrameError(f"frame is not valid JSON: {exc}") from None
    except RecursionError:
        raise FrameError("frame nests too deeply") from None
    if not isinstance(message, dict):
        raise FrameError(f"frame holds a JSON {type(message).__name__}, not an object")
    return message


def recv_exact(sock: socket.socket, size: int, buf: bytearray) -> bytes:
    """Read exactly ``size`` bytes, keeping any read-ahead in ``buf``.

    Raises ``ConnectionError`` when the peer closes first.
    """
    while len(buf) < size:
        chunk = sock.recv(max(65_536, size - len(buf)))
        if not chunk:
            raise ConnectionError("connection closed by the peer")
        buf += chunk
    data = bytes(buf[:size])
    del buf[:size]
    return data


def recv_frame(sock: socket.socket, max_frame: int, buf: bytearray) -> Message:
    """Read one frame from a blocking socket."""
    length = frame_length(recv_exact(sock, HEADER.size, buf), max_frame)
    return decode(recv_exact(sock, length, buf))


def tune_socket(sock: socket.socket) -> None:
    """Low latency (no Nagle delay) and dead-peer detection (TCP keep-alives).

    Keep-alive probes after 10 s of silence, every 5 s, 3 times: a peer that vanished
    without closing (power loss, partition) is noticed within about 25 s, so its
    connection -- and with it its leases, or our reconnect -- is dealt with.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)  # Linux names; other systems keep defaults
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


# -- field helpers (shared by both sides; a bad field is a bad request) -----------------


class BadRequest(StoreError):
    """A well-formed frame with a missing or mistyped field."""


def b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


def unb64(text: object, field: str) -> bytes:
    if not isinstance(text, str):
        raise BadRequest(f"field {field!r} must be a base64 string")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error):
        raise BadRequest(f"field {field!r} is not valid base64") from None


def opt_b64(value: bytes | None) -> str | None:
    return None if value is None else b64(value)


def opt_unb64(text: object, field: str) -> bytes | None:
    return None if text is None else unb64(text, field)


def get_str(message: Message, field: str) -> str:
    value = message.get(field)
    if not isinstance(value, str):
        raise BadRequest(f"field {field!r} must be a string")
    return value


def get_int(message: Message, field: str) -> int:
    value = message.get(field)
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"field {field!r} must be an integer")
    return value


def get_opt_int(message: Message, field: str) -> int | None:
    return None if message.get(field) is None else get_int(message, field)


def get_float(message: Message, field: str) -> float:
    value = message.get(field)
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadRequest(f"field {field!r} must be a number")
    return float(value)


def get_timeout(message: Message, field: str) -> float:
    """A timeout in seconds; null on the wire means forever (JSON has no infinity)."""
    return float("inf") if message.get(field) is None else max(0.0, get_float(message, field))


def put_timeout(seconds: float) -> float | None:
    return None if seconds == float("inf") else max(0.0, seconds)


def get_str_list(message: Message, field: str) -> list[str]:
    value = message.get(field)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"field {field!r} must be a list of strings")
    return list(value)


def get_int_list(message: Message, field: str) -> list[int]:
    value = message.get(field, [])
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise BadRequest(f"field {field!r} must be a list of integers")
    return list(value)


# -- watch results -----------------------------------------------------------------------


def event_from_wire(data: object) -> WatchEvent:
    if not isinstance(data, dict):
        raise BadRequest("a watch event must be an object")
    try:
        kind = EventKind(data.get("kind"))
    except ValueError:
        raise BadRequest(f"unknown event kind {data.get('kind')!r}") from None
    return WatchEvent(
        kind, get_str(data, "key"), opt_unb64(data.get("value"), "value"), get_int(data, "revision")
    )


def watch_to_wire(result: WatchResult) -> Message:
    events = [
        {"kind": e.kind.value, "key": e.key, "value": opt_b64(e.value), "revision": e.revision}
        for e in result.events
    ]
    return {"events": events, "revision": result.revision}


def watch_from_wire(data: object) -> WatchResult:
    events = data.get("events") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(events, list):
        raise BadRequest("a watch result must be an object with a list of events")
    return WatchResult(tuple(event_from_wire(e) for e in events), get_int(data, "revision"))
