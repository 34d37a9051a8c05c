"""The memory store's history by folder: a watch reads only the folders it looks at,
in revision order across them, and still reports history it no longer has."""

from __future__ import annotations

import pytest

from elastrun.core.errors import StoreCompactedError
from elastrun.store.memory import MemoryStore


def test_a_watch_across_folders_gets_their_changes_in_revision_order() -> None:
    store = MemoryStore()
    start = store.revision
    store.set("r/a/1", b"x")
    store.set("r/b/1", b"y")
    store.set("r/a/2", b"z")
    store.delete("r/b/1")
    result = store.watch("r/", start, 0)
    assert [(e.key, e.revision) for e in result.events] == [
        ("r/a/1", start + 1), ("r/b/1", start + 2), ("r/a/2", start + 3), ("r/b/1", start + 4),
    ]  # fmt: skip
    # A prefix inside a folder, and a key's own prefix.
    assert [e.key for e in store.watch("r/a/2", start, 0).events] == ["r/a/2"]


def test_a_quiet_folder_watched_from_before_many_changes_elsewhere_gets_only_its_own() -> None:
    store = MemoryStore()
    start = store.revision
    store.set("out/claim", b"c")
    for i in range(5000):  # thousands of joins elsewhere
        store.set(f"ctl/join/{i}", b"j")
    store.set("out/result", b"r")
    result = store.watch("out/", start, 0)
    assert [e.key for e in result.events] == ["out/claim", "out/result"]
    assert result.revision == store.revision


def test_history_it_no_longer_keeps_is_reported_as_compacted() -> None:
    store = MemoryStore(history=4)
    start = store.revision
    for i in range(10):
        store.set(f"f/{i}", b"v")
    with pytest.raises(StoreCompactedError):
        store.watch("f/", start, 0)
    recent = store.watch("f/", store.revision - 2, 0)
    assert [e.key for e in recent.events] == ["f/8", "f/9"]
