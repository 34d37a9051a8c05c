"""Suite-wide guards: every test must leave no process and no descriptor behind.

Each test runs with a unique ``ELASTRUN_TEST_TAG`` in its environment. Every process a
test starts inherits it (elastrun passes the agent's environment to workers), so after
the test any live process whose environment still carries the tag is a leak -- even
one that escaped into its own session or was re-parented to init. Leaked processes are
killed by pid (they are ours) and the test fails.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest

TAG = "ELASTRUN_TEST_TAG"
GRACE = 5.0


def _tagged_pids(tag: str) -> list[int]:
    needle = f"{TAG}={tag}".encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state == b"Z":
            continue  # a zombie holds no resources; its parent will reap it
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def _our_fds() -> set[tuple[int, str]]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("pipe:", "anon_inode:[pidfd]")):
            out.add((int(fd), target))
    return out


@pytest.fixture(scope="session", autouse=True)
def uvloop_warmed() -> None:
    """uvloop keeps a pipe open for the life of the process from its first loop on
    (libuv's signal wake-up), and the workers' store runs on uvloop when it is
    installed: open that pipe before any test's descriptor accounting starts."""
    try:
        import uvloop
    except ImportError:
        return
    uvloop.new_event_loop().close()


@pytest.fixture(autouse=True)
def no_leaks(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG, tag)
    # Temporary files of the processes a test starts (log directories kept after a
    # failure, on purpose) land in pytest's own rotated temporary area, not in /tmp.
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("proc-tmp")))
    fds_before = _our_fds()
    yield tag
    deadline = time.monotonic() + GRACE
    leaked = _tagged_pids(tag)
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = _tagged_pids(tag)
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    fds_leaked = _our_fds() - fds_before
    assert not leaked, f"processes left running by this test: {leaked}"
    assert not fds_leaked, f"descriptors left open by this test: {sorted(fds_leaked)}"


@pytest.fixture(autouse=True)
def elastrun_logging_restored() -> Iterator[None]:
    """A test that runs the launcher in-process (``main()``) configures the ``elastrun``
    logger for the command line: a handler on that test's captured stderr, level INFO,
    no propagation. Later tests must get the logger as it was."""
    import logging

    logger = logging.getLogger("elastrun")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
