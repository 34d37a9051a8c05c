"""The store contract suite (tests/contract/test_store_contract.py and
test_store_deadlines.py), run on a real etcd.

The tests are the contract modules' own functions, collected here again so that they
use this directory's fixtures (``store``, ``kit`` and ``make_kit`` on etcd); nothing is
copied. Only the lease timing differs: etcd counts lease TTLs in whole seconds, raises
a TTL to at least one and a half election timeouts, and looks for expired leases every
500 ms, so "a short TTL" is one second here and the wait after it longer.
"""

from __future__ import annotations

import pytest
import test_store_contract as contract
import test_store_deadlines as deadlines

# etcd rounds 0.3 s up to its 1 s minimum; expiry is then noticed within about 0.5 s more.
ETCD_TTL = 1.0
ETCD_AFTER_TTL = 2.2


@pytest.fixture(autouse=True)
def etcd_lease_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contract, "TTL", ETCD_TTL)
    monkeypatch.setattr(contract, "AFTER_TTL", ETCD_AFTER_TTL)


CONTRACT_TESTS = {
    name: fn
    for module in (contract, deadlines)
    for name, fn in vars(module).items()
    if name.startswith("test_")
}
globals().update(CONTRACT_TESTS)


def test_the_whole_contract_suite_is_collected_here() -> None:
    assert len(CONTRACT_TESTS) >= 30
    assert any(name in CONTRACT_TESTS for name in vars(deadlines))
    assert all(callable(fn) for fn in CONTRACT_TESTS.values())
