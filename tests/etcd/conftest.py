"""Fixtures for the etcd store: real etcd members on loopback, and the contract kit.

Starting a member takes a fraction of a second, so most tests get fresh members in
their own ``tmp_path``. The contract suite shares one member per module instead (it has
dozens of short tests): each test's keys live under a namespace of their own, and its
leases are revoked when it ends.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from etcd_cluster import EtcdCluster, find_etcd

from elastrun.store.api import Store
from elastrun.store.etcd import EtcdStore
from elastrun.store.memory import HISTORY

# The store contract suite lives in tests/contract; test_etcd_contract.py re-uses its
# tests, with the kit fixtures below in place of that directory's.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "contract"))


@pytest.fixture(scope="session")
def etcd_binary() -> str:
    binary: str | None = find_etcd()
    if binary is None:
        # In CI the setup installs etcd: its absence is a failure, never a quiet skip.
        if os.environ.get("CI"):
            pytest.fail("no etcd binary although CI set up the machine: scripts/install-etcd.sh")
        pytest.skip("no etcd binary: run scripts/install-etcd.sh")
    return binary


@pytest.fixture
def make_cluster(etcd_binary: str, tmp_path: Path) -> Iterator[Callable[[int], EtcdCluster]]:
    """Start clusters of N members (stopped, with their data removed, after the test)."""
    clusters: list[EtcdCluster] = []

    def make(size: int = 1) -> EtcdCluster:
        cluster = EtcdCluster(etcd_binary, tmp_path / f"etcd{len(clusters)}", size)
        clusters.append(cluster)
        return cluster.start()

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture
def etcd(make_cluster: Callable[[int], EtcdCluster]) -> EtcdCluster:
    """One etcd member."""
    return make_cluster(1)


@pytest.fixture
def etcd3(make_cluster: Callable[[int], EtcdCluster]) -> EtcdCluster:
    """Three etcd members: the cluster survives the loss of any one."""
    return make_cluster(3)


# -- the contract suite's kit --------------------------------------------------------------


class _BoundedHistory(EtcdStore):
    """A client that compacts after each write, keeping only the last ``history``
    revisions: etcd keeps every revision until compacted, the other kits a bounded log."""

    def __init__(self, endpoints: list[str], namespace: str, history: int) -> None:
        super().__init__(endpoints, namespace=namespace)
        self._history = history

    def set(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        revision = super().set(key, value, lease=lease)
        if revision > self._history:
            self.compact(revision - self._history)
        return revision


class EtcdKit:
    """The contract suite's view of one etcd: every ``client()`` is its own connection.

    Keys live under a random namespace, so the whole suite also exercises namespacing.
    """

    name = "etcd"

    def __init__(self, cluster: EtcdCluster, history: int) -> None:
        self.cluster = cluster
        self.history = history
        self.namespace = f"/contract-{uuid.uuid4().hex[:8]}/"
        self._clients: list[EtcdStore] = []

    def client(self) -> Store:
        client = (
            EtcdStore(self.cluster.endpoints, namespace=self.namespace)
            if self.history >= HISTORY
            else _BoundedHistory(self.cluster.endpoints, self.namespace, self.history)
        )
        self._clients.append(client)
        return client

    def close(self) -> None:
        for client in self._clients:
            client.close()


MakeKit = Callable[..., EtcdKit]


@pytest.fixture(scope="module")
def shared_etcd(
    etcd_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(etcd_binary, tmp_path_factory.mktemp("etcd"), 1).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def make_kit(shared_etcd: EtcdCluster) -> Iterator[MakeKit]:
    kits: list[EtcdKit] = []

    def make(history: int = HISTORY) -> EtcdKit:
        kit = EtcdKit(shared_etcd, history)
        kits.append(kit)
        return kit

    yield make
    for kit in kits:
        kit.close()
    shared_etcd.revoke_all_leases()


@pytest.fixture
def kit(make_kit: MakeKit) -> EtcdKit:
    return make_kit()


@pytest.fixture
def store(kit: EtcdKit) -> Store:
    return kit.client()
