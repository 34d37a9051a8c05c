"""The one error tree of elastrun.

Every error elastrun raises on purpose derives from :class:`ElastrunError`. Where a
torch-compatible caller expects a builtin type (torch raises ``ValueError`` for bad
configuration), the class also derives from that builtin so that existing ``except``
clauses keep working.
"""

from __future__ import annotations

from collections.abc import Iterator


class ElastrunError(Exception):
    """Base class of every error raised deliberately by elastrun."""


class ConfigError(ElastrunError, ValueError):
    """A configuration value is invalid.

    ``field`` names the option (as the user spelled it, e.g. ``--nnodes``) and ``value``
    the rejected value; ``str()`` is one line suitable for a command-line error.
    """

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{field}: {reason} (got {value!r})")


class StoreError(ElastrunError):
    """A key-value store operation failed."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A store wait ran past its deadline."""


class StoreAuthError(StoreError):
    """The store refused this client: a missing or wrong token."""


class StoreUnavailableError(StoreError):
    """The client gave up on its store: no connection (or no answer) for its whole
    reconnect window.

    ``address`` is the store's ``host:port``; ``silent_for`` how many seconds ago the
    store last answered, or was first tried, when the client gave up.
    """

    def __init__(self, message: str, *, address: str, silent_for: float) -> None:
        super().__init__(message)
        self.address = address
        self.silent_for = silent_for


class LeaseExpiredError(StoreError):
    """A write named a lease that has expired or was revoked."""


class StoreCompactedError(StoreError):
    """A watch asked for changes older than the store keeps; re-read and resume."""


class RendezvousError(ElastrunError):
    """Base class of rendezvous errors."""


class RendezvousClosedError(RendezvousError):
    """The run id was closed: the job finished or failed and accepts no more nodes.

    ``reason`` is the reason the run was closed with, where it was read (``FINISHED``:
    every node's workers succeeded).
    """

    #: The reason a run that succeeded is closed with.
    FINISHED = "finished"

    def __init__(self, *args: object, reason: str | None = None) -> None:
        super().__init__(*args)
        self.reason = reason

    @property
    def finished(self) -> bool:
        """Whether the job succeeded."""
        return self.reason == self.FINISHED


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """The rendezvous did not complete before its deadline."""


class RendezvousConnectionError(RendezvousError):
    """The rendezvous backend could not be reached."""


class RendezvousStateError(RendezvousError):
    """The rendezvous state is corrupt or of an unknown version."""


class RendezvousGracefulExitError(RendezvousError):
    """This node was not admitted and should exit quietly; not a failure."""


class NodeExcludedError(ElastrunError):
    """This node was kept out of the job's rounds and asked to leave rather than wait
    out its cool-down: the launcher exits 75, "replace this node"."""


class WorkerFailure(ElastrunError):
    """Base class of errors that report failed worker processes."""


class ProcessStartError(WorkerFailure):
    """A worker process could not be started (bad executable, fork failure, ...)."""


class ExecutableNotFoundError(ProcessStartError, FileNotFoundError):
    """A worker's executable does not exist: torch lets ``Popen``'s
    ``FileNotFoundError`` through, so callers catch that."""


class IllegalTransitionError(ElastrunError, RuntimeError):
    """A state machine was asked for a move its table does not allow (a bug: found at
    once rather than as a hang)."""


class ShutdownRequested(ElastrunError):
    """The launcher received a signal and stopped its workers.

    ``signum`` is the signal that triggered the shutdown.
    """

    def __init__(self, signum: int) -> None:
        import signal as _signal

        self.signum = signum
        try:
            name = _signal.Signals(signum).name
        except ValueError:
            name = str(signum)
        self.signal_name = name
        super().__init__(f"received {name}: workers were stopped")


def error_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then each error it was raised from or while handling, each once (a
    chain may loop)."""
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__
