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


def pytest_configure(config: pytest.Config) -> None:
    # A shell starts a background job (``bash scripts/test.sh &``, some CI runners) with
    # SIGINT ignored, and every launcher a test starts would inherit that: a SIGINT in
    # the launcher's first milliseconds, before its first line holds it back, would then
    # vanish instead of ending the launcher, as the tests that interrupt a starting
    # launcher expect. Tests start from the disposition an interactive shell gives.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


#: What a test must leave as it found it in the test process: children inherit both.
_WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD)


def _signal_state() -> tuple[frozenset[int], tuple[object, ...]]:
    mask = frozenset(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    return mask, tuple(signal.getsignal(s) for s in _WATCHED_SIGNALS)


@pytest.fixture(autouse=True)
def signals_restored() -> Iterator[None]:
    """A test that runs code in this process which blocks or handles signals (the
    launcher's ``main()``, a fork) must undo it: every process a later test starts
    inherits the blocked mask and the ignored signals, and a launcher started with
    SIGINT blocked would never see a Ctrl-C."""
    before = _signal_state()
    yield
    after = _signal_state()
    if after != before:
        signal.pthread_sigmask(signal.SIG_SETMASK, before[0])
        for sig, handler in zip(_WATCHED_SIGNALS, before[1], strict=True):
            signal.signal(sig, handler)  # type: ignore[arg-type]  # a saved handler, typed object
    assert after == before, f"this test changed the test process's signals: {before} -> {after}"


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
