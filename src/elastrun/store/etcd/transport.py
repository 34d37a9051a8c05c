"""Requests to an etcd cluster: its members, the one in use, authentication, failover.

A transport knows several members and sticks to the last one that answered. A request
that provably never reached a member (connection refused, or refused by a member that
has no leader before proposing anything) moves on to the next. A request that *may* have
been applied -- the connection broke after it was sent, or etcd timed out waiting for
consensus -- is retried only when repeating it is harmless (the caller says so with
``safe``: reads, keep-alives, revokes, watches, lease grants); every other write raises
``StoreError`` saying its outcome is unknown, because blindly repeating a put would
repeat its watch event and repeating a transaction could apply it twice.

A call ends by the deadline of its cancel scope (the one handed to it, else the thread's
current one) with ``StoreTimeoutError``: each answer is waited for no longer than the
time left, and no member is tried after it. httpx bounds each step of a request (the
connect, a write, a read) rather than the whole, so a call may overrun its deadline by
the time one step of an answer trickling in takes; a member that is silent does not
make it overrun.

The store model (keys, transactions, watches) is ``client``'s; this module only moves
JSON to and from whichever member answers.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import ssl
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, TypeVar

from elastrun.core.cancel import CancelScope, scope_or_default
from elastrun.core.clock import Deadline
from elastrun.core.errors import StoreAuthError, StoreError, StoreTimeoutError
from elastrun.store.etcd.gateway import (
    REQUIRE_LEADER,
    BadToken,
    Json,
    MaybeApplied,
    NotSent,
    decode,
    describe,
    host_of,
    parse_endpoints,
)

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("elastrun.store.etcd")

#: The shortest wait for one answer, and the longest for one that may be repeated.
_MIN_WAIT = 0.5
_SAFE_WAIT = 2.0
_BACKOFF_FIRST = 0.05
_BACKOFF_CAP = 1.0
T = TypeVar("T")


def past_deadline(what: str, last: str, *, unknown: bool) -> StoreTimeoutError:
    """A call that its scope's deadline ended; ``last``: the latest failure, if any
    (``unknown``: a write that may have been applied)."""
    note = "; it may or may not have been applied" if unknown else ""
    cause = f" (last: {last})" if last else ""
    return StoreTimeoutError(f"etcd {what}: no answer before the caller's deadline{cause}{note}")


class Transport:
    """One etcd cluster's JSON gateway as a single request channel (thread-safe).

    The arguments are ``EtcdStore``'s, but its ``namespace``. Constructing it does no I/O.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        ssl_context: ssl.SSLContext | None = None,
        username: str | None = None,
        password: str | None = None,
        connect_timeout: float = 2.0,
        request_timeout: float = 10.0,
    ) -> None:
        import httpx  # an optional dependency: only an etcd user needs it

        self.urls = parse_endpoints(endpoints, secure=ssl_context is not None)
        self.username = username
        self._password = password
        self.connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._client: httpx.Client = httpx.Client(
            verify=ssl_context if ssl_context is not None else True,
            trust_env=False,  # never send etcd traffic through a proxy from the environment
            timeout=httpx.Timeout(request_timeout, connect=connect_timeout),
        )
        self._current = 0
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self.closed = False

    @property
    def using(self) -> str:
        """The base URL of the member that answered last."""
        return self.urls[self._current]

    def call(self, path: str, body: Json, *, safe: bool, scope: CancelScope | None = None) -> Json:
        """POST ``body`` to ``path`` on a member that answers; its answer as JSON.

        Raises:
            StoreError: no member answered within the request timeout, or (``safe``
                false) the request may have been applied and is not repeated; or the
                store model's error that etcd's answer means (see ``gateway.decode``).
            StoreTimeoutError: ``scope``'s deadline (default: the current scope's)
                passed first.
        """
        attempt = functools.partial(self._post, path, body)  # (url, wait) for each member
        what = path.rsplit("/", 1)[-1]
        return self.with_failover(attempt, safe=safe, what=what, scope=scope)

    def with_failover(
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
        through well within its lease's TTL), and never past ``scope``'s deadline."""
        if self.closed:
            raise StoreError("the etcd store is closed")
        live = scope_or_default(scope)
        deadline = Deadline.after(max(self._request_timeout, window))
        delay, last = _BACKOFF_FIRST, ""
        while True:
            for step in range(len(self.urls)):  # every member, from the one in use
                index = (self._current + step) % len(self.urls)
                url = self.urls[index]
                if live.expired():
                    raise past_deadline(what, last, unknown=False)
                wait = min(deadline.remaining(), self._request_timeout / 2)
                if safe:
                    wait = min(wait, _SAFE_WAIT)
                wait = live.remaining(max(_MIN_WAIT, wait))
                try:
                    result = attempt(url, wait)
                except RuntimeError:  # httpx refuses to work once the client is closed
                    if self.closed:
                        raise StoreError("the etcd store is closed") from None
                    raise
                except (NotSent, MaybeApplied) as exc:
                    last = f"{exc} ({host_of(url)})"
                    if isinstance(exc, MaybeApplied) and not safe:
                        if live.expired():
                            raise past_deadline(what, last, unknown=True) from None
                        raise StoreError(
                            f"etcd {what}: outcome unknown ({host_of(url)}: {exc}); the request "
                            "may have been applied, so it is not repeated"
                        ) from None
                else:
                    if index != self._current:
                        log.info("etcd: now using %s", host_of(url))
                        self._current = index
                    return result
                if self.closed:
                    raise StoreError("the etcd store is closed")
                log.debug("etcd %s failed on %s", what, last)
            if deadline.remaining() <= delay:
                hosts = ", ".join(host_of(u) for u in self.urls)
                raise StoreError(f"cannot reach etcd at {hosts}: {last}")
            live.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, _BACKOFF_CAP)

    def stream(
        self, url: str, path: str, body: Json, wait: float
    ) -> AbstractContextManager[httpx.Response]:
        """A streaming POST of ``body`` to one member (no failover: the caller's
        ``with_failover`` attempt); ``wait`` bounds each read, ``connect_timeout`` the
        connect. httpx's own errors reach the caller, which knows what they mean."""
        import httpx

        timeout = httpx.Timeout(wait, connect=self.connect_timeout)
        return self._client.stream(
            "POST", url + path, content=json.dumps(body), headers=self._headers(url),
            timeout=timeout,
        )  # fmt: skip

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._client.close()

    def __repr__(self) -> str:
        return (
            f"Transport(endpoints={list(self.urls)}, using={self.using!r}, "
            f"user={self.username!r}, closed={self.closed})"
        )

    def _headers(self, url: str) -> dict[str, str]:
        headers = dict(REQUIRE_LEADER)
        if self.username is not None:
            headers["Authorization"] = self._auth_token(url)
        return headers

    def _post(self, path: str, body: Json, url: str, wait: float) -> Json:
        import httpx

        timeout = httpx.Timeout(wait, connect=min(wait, self.connect_timeout))
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
                body = {"name": self.username, "password": self._password or ""}
                try:
                    reply = self._client.post(url + "/v3/auth/authenticate", json=body)
                except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                    raise NotSent(describe(exc)) from None
                except httpx.TransportError as exc:
                    raise MaybeApplied(describe(exc)) from None  # authenticating is harmless
                try:
                    self._token = str(decode(reply.status_code, reply.content, url)["token"])
                except (BadToken, KeyError):
                    raise StoreAuthError(
                        f"etcd at {host_of(url)} refused user {self.username!r}"
                    ) from None
            return self._token
