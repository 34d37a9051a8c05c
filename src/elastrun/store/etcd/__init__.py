"""The store model on etcd v3, spoken through etcd's own JSON gateway (DESIGN.md section 3).

etcd serves its v3 API twice: as gRPC, and as JSON over HTTP (``POST /v3/kv/range`` and
so on). The JSON gateway needs nothing but an HTTP client, so a training environment
gets etcd without grpc or protobuf; httpx is the one (optional) dependency, imported
when an ``EtcdStore`` is made.

The model maps onto etcd directly: revisions are etcd's store-wide revisions, a lease is
an etcd lease, ``compare_set`` and ``add`` are transactions, a watch is a watch stream
opened from ``after_revision + 1`` and closed once it delivered something.

``client`` holds :class:`EtcdStore` (the store model: keys, transactions, watches);
``transport`` the requests, the members and failover between them; ``gateway`` the
gateway's encodings, endpoint and TLS settings, and the meaning of its errors.
"""

from __future__ import annotations

from elastrun.store.etcd.client import EtcdStore
from elastrun.store.etcd.gateway import DEFAULT_PORT, parse_endpoints, prefix_end, tls_context

__all__ = ["DEFAULT_PORT", "EtcdStore", "parse_endpoints", "prefix_end", "tls_context"]
