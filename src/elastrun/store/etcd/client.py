"""The etcd store: the store model on an etcd v3 cluster (see the package docstring).

Failover. A store knows several members and sticks to the last one that answered. A
request that provably never reached a member (connection refused, or refused by a member
that has no leader before proposing anything) moves on to the next. A request that *may*
have been applied -- the connection broke after it was sent, or etcd timed out waiting
for consensus -- is retried only when repeating it is harmless (reads, keep-alives,
revokes, watches, lease grants, see ``grant_lease``); every other write raises
``StoreError`` saying its outcome is unknown, because blindly repeating a put would
repeat its watch event and repeating a transaction could apply it twice.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import random
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from elastrun.core.cancel import CancelScope, scope_or_default
from elastrun.core.clock import Deadline
from elastrun.core.errors import (
    LeaseExpiredError,
    StoreAuthError,
    StoreCompactedError,
    StoreError,
    StoreTimeoutError,
)
from elastrun.store.api import EventKind, WatchEvent, WatchResult
from elastrun.store.etcd.gateway import (
    REQUIRE_LEADER,
    BadToken,
    Json,
    MaybeApplied,
    NotSent,
    b64,
    decode,
    describe,
    host_of,
    parse_endpoints,
    prefix_end,
    stream_message,
    to_int,
    unb64,
)

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("elastrun.store.etcd")

#: etcd hands the history a new watch asks for to it from a background loop that runs
#: every 100 ms; only after that long is "no event" an answer to trust.
HISTORY_GRACE = 0.3
#: A member that does not acknowledge a new watch within this long is taken as hung
#: (a healthy one does in milliseconds; shorter waits are a caller's quick look).
_HANG = 0.5
#: The shortest wait for one answer, and the longest for one that may be repeated.
_MIN_WAIT = 0.5
_SAFE_WAIT = 2.0
_BACKOFF_FIRST = 0.05
_BACKOFF_CAP = 1.0
T = TypeVar("T")


class EtcdStore:
    """A ``Store`` on an etcd v3 cluster, through the members' JSON gateway (thread-safe).

    Args:
        endpoints: the members, as accepted by :func:`parse_endpoints`.
        namespace: prepended to every key (and removed from keys read back), so that
            several users share one cluster without seeing each other's keys.
        ssl_context: client TLS (see :func:`tls_context`); None uses the system's CAs
            for ``https`` endpoints.
        username, password: etcd authentication (the token is fetched on first use and
            again whenever etcd says it expired).
        connect_timeout: the longest wait for one member to accept a connection.
        request_timeout: the longest a call keeps trying (every member, with backoff)
            before it raises ``StoreError``; also bounds a single answer.

    Constructing it does no I/O; a wrong endpoint shows on the first call.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        namespace: str = "",
        ssl_context: ssl.SSLContext | None = None,
        username: str | None = None,
        password: str | None = None,
        connect_timeout: float = 2.0,
        request_timeout: float = 10.0,
    ) -> None:
        import httpx  # an optional dependency: only an etcd user needs it

        self._urls = parse_endpoints(endpoints, secure=ssl_context is not None)
        self._namespace = namespace.encode()
        self._username = username
        self._password = password
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._client: httpx.Client = httpx.Client(
            verify=ssl_context if ssl_context is not None else True,
            trust_env=False,  # never send etcd traffic through a proxy from the environment
            timeout=httpx.Timeout(request_timeout, connect=connect_timeout),
        )
        self._current = 0
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self._closed = False

    # -- keys ------------------------------------------------------------------------

    def _k(self, key: str) -> bytes:
        return self._namespace + key.encode()

    def _unk(self, raw: str | None) -> str:
        return unb64(raw)[len(self._namespace) :].decode(errors="replace")

    def _range_body(self, prefix: str) -> Json:
        start = self._k(prefix)
        return {"key": b64(start or b"\0"), "range_end": b64(prefix_end(start))}

    # -- the store model ---------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        kvs = self._call("/v3/kv/range", {"key": b64(self._k(key))}, safe=True).get("kvs")
        return unb64(kvs[0].get("value")) if kvs else None

    def set(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        put: Json = {"key": b64(self._k(key)), "value": b64(value)}
        if lease is not None:
            put["lease"] = str(lease)
        return to_int(self._call("/v3/kv/put", put, safe=False)["header"].get("revision"))

    def add(self, key: str, amount: int) -> int:
        k = b64(self._k(key))
        kv: Json | None = self._first_kv(self._call("/v3/kv/range", {"key": k}, safe=True))
        while True:
            raw = unb64(kv.get("value")) if kv else b"0"
            try:
                value = int(raw) + amount
            except ValueError:
                raise StoreError(f"add: value of {key!r} is not an integer: {raw!r}") from None
            put: Json = {"key": k, "value": b64(str(value).encode())}
            if kv and to_int(kv.get("lease")):
                put["lease"] = kv["lease"]  # a leased counter stays bound to its lease
            unchanged = (
                {"key": k, "target": "MOD", "mod_revision": kv["mod_revision"]}
                if kv
                else {"key": k, "target": "CREATE", "create_revision": "0"}
            )
            try:
                answer = self._txn(unchanged, put, k)
            except LeaseExpiredError:  # the counter's lease ended meanwhile, and the key with it
                kv = self._first_kv(self._call("/v3/kv/range", {"key": k}, safe=True))
                continue
            if answer.get("succeeded"):
                return value
            kv = self._first_kv(answer["responses"][0]["response_range"])

    def compare_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: int | None = None
    ) -> tuple[bool, bytes | None]:
        k = b64(self._k(key))
        compare = (
            {"key": k, "target": "CREATE", "create_revision": "0"}
            if expected is None
            else {"key": k, "target": "VALUE", "value": b64(expected)}
        )
        put: Json = {"key": k, "value": b64(value)}
        if lease is not None:
            put["lease"] = str(lease)
        answer = self._txn(compare, put, k)
        if answer.get("succeeded"):
            return True, bytes(value)
        kv = self._first_kv(answer["responses"][0]["response_range"])
        return False, unb64(kv.get("value")) if kv else None

    def delete(self, key: str) -> bool:
        answer = self._call("/v3/kv/deleterange", {"key": b64(self._k(key))}, safe=False)
        return to_int(answer.get("deleted")) > 0

    def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        answer = self._call("/v3/kv/range", self._range_body(prefix), safe=True)
        found = {self._unk(kv["key"]): unb64(kv.get("value")) for kv in answer.get("kvs", [])}
        return found, to_int(answer["header"].get("revision"))

    def grant_lease(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds, rounded up to whole seconds (etcd's unit).

        etcd also raises a TTL below its minimum (about 1.5 election timeouts) to that
        minimum. The lease id is chosen here, so that a grant whose answer was lost can
        be repeated: "lease already exists" then means the first attempt took effect.
        """
        if not ttl > 0:
            raise StoreError(f"a lease needs a positive ttl, got {ttl}")
        lease = random.SystemRandom().randrange(1, 2**62)
        body = {"TTL": str(max(1, math.ceil(ttl))), "ID": str(lease)}
        try:
            self._call("/v3/lease/grant", body, safe=True)
        except StoreError as exc:
            if "lease already exists" not in str(exc):
                raise
        return lease

    def keep_alive(self, lease: int) -> bool:
        try:
            answer = self._call("/v3/lease/keepalive", {"ID": str(lease)}, safe=True)
        except LeaseExpiredError:
            return False
        # The gateway wraps a stream's messages in "result"; an unknown lease has TTL 0.
        return to_int(answer.get("result", answer).get("TTL")) > 0

    def revoke_lease(self, lease: int) -> None:
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease)}, safe=True)
        except LeaseExpiredError:
            pass  # unknown, expired, or revoked by an attempt whose answer was lost

    def compact(self, revision: int) -> None:
        """Discard the history before ``revision`` (watches from earlier then fail with
        ``StoreCompactedError``); etcd operators usually let auto-compaction do this."""
        try:
            self._call("/v3/kv/compaction", {"revision": str(revision)}, safe=True)
        except StoreCompactedError:
            pass  # already compacted at or past that revision

    def watch(
        self,
        prefix: str,
        after_revision: int,
        timeout: float,
        *,
        scope: CancelScope | None = None,
    ) -> WatchResult:
        """Changes under ``prefix`` after ``after_revision`` (see ``Store.watch``).

        An empty answer resumes from ``after_revision`` itself, not from the cluster's
        newer revision: a one-shot gateway stream has no progress marker proving that
        etcd already delivered everything up to that revision, and skipping ahead could
        lose an event it had not yet sent.

        Cancelling ``scope`` shuts the stream's connection down, which ends the read at
        once (the connect itself is bounded by ``connect_timeout``).
        """
        live = scope_or_default(scope)
        live.raise_if_cancelled()
        deadline = Deadline.after(timeout)
        body = {
            "create_request": {
                **self._range_body(prefix),
                "start_revision": str(after_revision + 1),
            }
        }

        def attempt(url: str, wait: float) -> WatchResult:
            return self._watch_stream(url, body, after_revision, deadline, live)

        # Connection trouble gets the usual failover window even for a short watch.
        return self._with_failover(
            attempt, safe=True, what="watch", window=max(timeout, 0), scope=live
        )

    def wait(self, keys: list[str], timeout: float, *, scope: CancelScope | None = None) -> None:
        deadline = Deadline.after(timeout)
        while True:
            missing, revision = [], math.inf
            for key in keys:
                answer = self._call(
                    "/v3/kv/range", {"key": b64(self._k(key)), "count_only": True}, safe=True
                )
                revision = min(revision, to_int(answer["header"].get("revision")))
                if not to_int(answer.get("count")):
                    missing.append(key)
            if not missing:
                return
            if deadline.expired():
                raise StoreTimeoutError(f"timed out after {timeout}s waiting for {missing}")
            self.watch(_common_prefix(missing), int(revision), deadline.remaining(), scope=scope)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()

    def __repr__(self) -> str:
        return (
            f"EtcdStore(endpoints={list(self._urls)}, using={self._urls[self._current]!r}, "
            f"namespace={self._namespace.decode()!r}, user={self._username!r}, "
            f"closed={self._closed})"
        )

    # -- transactions --------------------------------------------------------------------

    def _txn(self, compare: Json, put: Json, key: str) -> Json:
        body = {
            "compare": [{"result": "EQUAL", **compare}],
            "success": [{"request_put": put}],
            "failure": [{"request_range": {"key": key}}],
        }
        return self._call("/v3/kv/txn", body, safe=False)

    @staticmethod
    def _first_kv(answer: Json) -> Json | None:
        kvs = answer.get("kvs")
        return kvs[0] if kvs else None

    # -- requests and failover -----------------------------------------------------------

    def _call(self, path: str, body: Json, *, safe: bool) -> Json:
        def attempt(url: str, wait: float) -> Json:
            return self._post(url, path, body, wait)

        return self._with_failover(attempt, safe=safe, what=path.rsplit("/", 1)[-1])

    def _with_failover(
        self,
        attempt: Callable[[str, float], T],
        *,
        safe: bool,
        what: str,
        window: float = 0.0,
        scope: CancelScope | None = None,
    ) -> T:
        """Run ``attempt(url, wait)`` on the current member, then the others, until it
        works or the request timeout (at least ``window``) passes; see the module
        docstring. ``wait`` bounds one answer, so that a member that hangs (a machine
        gone without a word) leaves time to ask another: half the request timeout, and
        at most ``_SAFE_WAIT`` for a call that may be repeated (a keep-alive must get
        through well within its lease's TTL)."""
        if self._closed:
            raise StoreError("the etcd store is closed")
        deadline = Deadline.after(max(self._request_timeout, window))
        delay, last = _BACKOFF_FIRST, ""
        while True:
            for index in self._rotation():
                url = self._urls[index]
                wait = min(deadline.remaining(), self._request_timeout / 2)
                if safe:
                    wait = min(wait, _SAFE_WAIT)
                wait = max(_MIN_WAIT, wait)
                try:
                    result = attempt(url, wait)
                except RuntimeError:  # httpx refuses to work once the client is closed
                    if self._closed:
                        raise StoreError("the etcd store is closed") from None
                    raise
                except NotSent as exc:
                    last = f"{exc} ({host_of(url)})"
                except MaybeApplied as exc:
                    if not safe:
                        raise StoreError(
                            f"etcd {what}: outcome unknown ({host_of(url)}: {exc}); the request "
                            "may have been applied, so it is not repeated"
                        ) from None
                    last = f"{exc} ({host_of(url)})"
                else:
                    if index != self._current:
                        log.info("etcd: now using %s", host_of(url))
                        self._current = index
                    return result
                if self._closed:
                    raise StoreError("the etcd store is closed")
                log.debug("etcd %s failed on %s", what, last)
            if deadline.remaining() <= delay:
                hosts = ", ".join(host_of(u) for u in self._urls)
                raise StoreError(f"cannot reach etcd at {hosts}: {last}")
            scope_or_default(scope).sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, _BACKOFF_CAP)

    def _rotation(self) -> Iterator[int]:
        start = self._current
        for step in range(len(self._urls)):
            yield (start + step) % len(self._urls)

    def _headers(self, url: str) -> dict[str, str]:
        headers = dict(REQUIRE_LEADER)
        if self._username is not None:
            headers["Authorization"] = self._auth_token(url)
        return headers

    def _post(self, url: str, path: str, body: Json, wait: float) -> Json:
        import httpx

        timeout = httpx.Timeout(wait, connect=min(wait, self._connect_timeout))
        for _ in range(2):  # a second time only after re-authenticating
            try:
                reply = self._client.post(
                    url + path, content=json.dumps(body), headers=self._headers(url),
                    timeout=timeout,
                )  # fmt: skip
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                raise NotSent(describe(exc)) from None
            except httpx.TransportError as exc:
                raise MaybeApplied(describe(exc)) from None
            try:
                return decode(reply.status_code, reply.content, url)
            except BadToken:
                self._token = None
        raise StoreAuthError(f"etcd at {host_of(url)} keeps refusing fresh auth tokens")

    def _auth_token(self, url: str) -> str:
        import httpx

        with self._auth_lock:
            if self._token is None:
                body = {"name": self._username, "password": self._password or ""}
                try:
                    reply = self._client.post(url + "/v3/auth/authenticate", json=body)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    raise NotSent(describe(exc)) from None
                except httpx.TransportError as exc:
                    raise MaybeApplied(describe(exc)) from None  # authenticating is harmless
                try:
                    self._token = str(decode(reply.status_code, reply.content, url)["token"])
                except (BadToken, KeyError):
                    raise StoreAuthError(
                        f"etcd at {host_of(url)} refused user {self._username!r}"
                    ) from None
            return self._token

    def _watch_stream(
        self, url: str, body: Json, after: int, deadline: Deadline, scope: CancelScope
    ) -> WatchResult:
        import httpx

        try:
            return self._read_watch(url, body, after, deadline, scope)
        except (httpx.TransportError, MaybeApplied, NotSent):
            scope.raise_if_cancelled()  # the cancellation cut the stream: say so
            raise

    def _read_watch(
        self, url: str, body: Json, after: int, deadline: Deadline, scope: CancelScope
    ) -> WatchResult:
        import httpx

        # A read waits at least one history-delivery period (see HISTORY_GRACE).
        wait = max(deadline.remaining(), HISTORY_GRACE)
        timeout = httpx.Timeout(wait, connect=self._connect_timeout)
        created = synced = False
        try:
            with self._client.stream(
                "POST", url + "/v3/watch", content=json.dumps(body),
                headers=self._headers(url), timeout=timeout,
            ) as reply, scope.wakes(functools.partial(_cut, reply)):  # fmt: skip
                if reply.status_code != 200:
                    decode(reply.status_code, reply.read(), url)
                for line in reply.iter_lines():
                    if not line.strip():
                        continue
                    result = stream_message(json.loads(line), url)
                    if result.get("created"):
                        created = True
                        # Nothing older than the watch's start is pending: etcd sends
                        # only live changes to a watch that starts past its revision.
                        synced = after >= to_int(result.get("header", {}).get("revision"))
                    events = tuple(self._event(e) for e in result.get("events", ()))
                    if events:
                        return WatchResult(events, events[-1].revision)
                    if synced and deadline.expired():
                        break
        except httpx.ReadTimeout:
            # Nothing happened in time -- unless the member never even opened the watch:
            # then it hangs, and another member should be asked.
            if not created and wait >= _HANG:
                raise MaybeApplied(f"no answer in {wait:.1f}s") from None
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise NotSent(describe(exc)) from None
        except httpx.TransportError as exc:
            raise MaybeApplied(describe(exc)) from None
        return WatchResult((), after)

    def _event(self, raw: Json) -> WatchEvent:
        kv = raw["kv"]
        if raw.get("type") == "DELETE":
            return WatchEvent(
                EventKind.DELETE, self._unk(kv["key"]), None, to_int(kv["mod_revision"])
            )
        return WatchEvent(
            EventKind.PUT, self._unk(kv["key"]), unb64(kv.get("value")), to_int(kv["mod_revision"])
        )


def _cut(reply: httpx.Response) -> None:
    """Shut a streaming reply's connection down: a read blocked on it returns at once
    (closing the descriptor from another thread would not wake it)."""
    stream = reply.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _common_prefix(keys: list[str]) -> str:
    first, last = min(keys), max(keys)
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    return first[:size]
