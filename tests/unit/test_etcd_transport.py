"""The etcd transport's reading of a failed request: not sent (repeatable on any member)
or maybe applied (a write that is not repeated). No etcd here: httpx's mock transport
answers, as etcd's JSON gateway would not."""

from __future__ import annotations

import httpx
import pytest

from elastrun.core.errors import StoreError
from elastrun.store.etcd.transport import Transport


def _transport(handler: httpx.MockTransport) -> Transport:
    t = Transport("127.0.0.1:2379", username="root", password="pw", request_timeout=0.4)
    t._client.close()
    t._client = httpx.Client(transport=handler)
    return t


def test_no_connection_from_the_pool_while_authenticating_leaves_a_write_unsent() -> None:
    # Waiting for a pooled connection to authenticate sends nothing: a write behind it
    # is tried again until the request timeout, not given up as maybe applied.
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        raise httpx.PoolTimeout("no connection free", request=request)

    t = _transport(httpx.MockTransport(handler))
    try:
        with pytest.raises(StoreError) as info:
            t.call("/v3/kv/put", {"key": "a2V5", "value": "dg=="}, safe=False)
        assert "may have been applied" not in str(info.value), info.value
        assert "may or may not" not in str(info.value), info.value
        assert len(asked) > 1 and set(asked) == {"/v3/auth/authenticate"}, asked
    finally:
        t.close()
