"""``run``: call a training function again, in the same process, after a peer failed.

The loop of one worker (see ``elastrun.inprocess`` for the contract):

1. Outside elastrun (no agent channel in the environment) the function is simply
   called once: the decorator costs nothing under ``python`` or torchrun.
2. Otherwise the worker says hello (the opt-in: the agent now replaces only a failed
   worker instead of restarting the group) and calls the function.
3. When the function raises an error that a failed collective can raise (a
   ``RuntimeError``: gloo and NCCL raise plain ones, torch's ``DistError`` family
   subclasses it), the worker asks the agent whether a peer failed in its round. The
   agent knows: it reaps its node's workers and hears of other nodes' failures through
   the rendezvous. Nothing is torn down before the answer.
4. A peer failed: the worker destroys its process group (aborting it first where the
   backend can), rolls the state back to its last commit and waits for the agent's
   next round. It takes the round's environment, synchronises the state with the
   round's other ranks (the newest commit wins) and calls the function again.
5. No peer failed, or the error cannot come from a collective: it is the worker's own.
   The original exception propagates at once, unchanged (its type, message and
   traceback); the process ends, and the agent replaces it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from elastrun.core.errors import ElastrunError, error_chain
from elastrun.inprocess.worker.channel import Channel
from elastrun.inprocess.worker.cut import cut_connections, cut_peer_connections
from elastrun.inprocess.worker.parking import (
    keep_parked,
    next_generation,
    park_process_groups,
    release_idle,
    release_parked,
)
from elastrun.inprocess.worker.state import State
from elastrun.wire import inprocess as wire

log = logging.getLogger("elastrun.inprocess")

R = TypeVar("R")

#: How long a worker whose collective failed waits for the agent's answer, and then
#: for its round, by default.
DEFAULT_WAIT = 120.0


def run(fn: Callable[..., R]) -> Callable[..., R]:
    """Decorate ``train(state, ...)`` so that a peer's failure costs only the steps
    since the last ``state.commit()`` (see ``elastrun.inprocess``)."""

    @functools.wraps(fn)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        if not isinstance(state, State):
            raise TypeError(
                f"the first argument must be an elastrun.inprocess.State, not {state!r}"
            )
        channel = Channel.from_env()
        if channel is None:
            return fn(state, *args, **kwargs)
        try:
            return _recovering(channel, fn, state, args, kwargs)
        finally:
            channel.close()

    return wrapper


def _recovering(
    channel: Channel,
    fn: Callable[..., R],
    state: State,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> R:
    round_no = int(os.environ.get(wire.ROUND_ENV, "0") or 0)
    wait = float(os.environ.get(wire.WAIT_ENV, "") or DEFAULT_WAIT)
    channel.send("hello", version=wire.VERSION, pid=os.getpid(), round=round_no)
    # A round announced while the function runs (its collectives have not failed yet:
    # the world grows, or the peers that broke are elsewhere): cut the connections to
    # the previous round's workers at once, so that the next collective fails here.
    channel.on_round = _interrupt
    channel.start()
    # What exists now (the model, torch's modules) lives as long as the process: keep
    # it out of the collections, so that a recovery's collection (of the failed call's
    # DDP wrapper) walks only what the training made since (milliseconds, not 0.3 s).
    gc.freeze()
    # torch wraps sys.excepthook at every init_process_group (to prefix "[rankN]:"):
    # each call starts from the script's own hook, not from the last call's wrapper.
    hook = sys.excepthook
    while True:
        failure = _synchronised(channel, state, round_no, wait) if round_no > 0 else None
        if failure is None:
            sys.excepthook = hook
            next_generation()  # what the last recovery kept is idle by the next one
            try:
                result = fn(state, *args, **kwargs)
                release_parked()
                return result
            except Exception as exc:
                if not _peer_failed(channel, exc, round_no, wait):
                    raise  # the worker's own error: the original, as it was raised
                failure = _first_line(exc)  # not the exception: its frames hold the old group
            log.warning("a collective failed (%s) and a peer failed; recovering in place", failure)
        round_no = _next_round(channel, state, round_no, wait, failure)


def _synchronised(channel: Channel, state: State, round_no: int, wait: float) -> str | None:
    """Synchronise the state with round ``round_no``'s other ranks. None when done;
    else what failed because a peer failed (or the round was superseded), and the
    worker takes the next round. Raises the worker's own errors unchanged."""
    from elastrun.inprocess.worker.sync import synchronise

    try:
        synchronise(state, round_no, lambda: channel.newer_than(round_no))
    except Exception as exc:
        if not _peer_failed(channel, exc, round_no, wait):
            raise
        failure = _first_line(exc)
    else:
        state._after_sync()
        channel.send("synced", round=round_no, commit=state.commit_id)
        return None
    log.warning("the state synchronisation failed (%s); waiting for the next round", failure)
    return failure


def _peer_failed(channel: Channel, exc: Exception, round_no: int, wait: float) -> bool:
    """Whether ``exc`` is a collective that failed because a peer failed in round
    ``round_no``. Only an error a failed collective can raise is asked about: a
    ``RuntimeError`` (torch's ``DistError`` family included) that torch raised (see
    ``_raised_by_torch``), not one of elastrun's own (a commit that no rank holds) nor
    one the user's code raised. The agent decides, not the error's text: it holds
    its answer at most ``ANSWER_HOLD`` seconds for news of a failure in flight, so a
    worker's own error is named within seconds.

    A ``CommitLostError`` (no rank holds the round's newest commit: every rank finds so
    at once) is told to the agent first: it then restarts the group rather than replace
    the workers one by one as they end with it."""
    from elastrun.inprocess.worker.transfer import CommitLostError

    if isinstance(exc, CommitLostError):
        channel.send("lost", round=round_no)
    if not isinstance(exc, RuntimeError) or isinstance(exc, ElastrunError):
        return False
    if not channel.newer_than(round_no) and not _raised_by_torch(exc):
        return False  # raised by the user's own code: named at once, nothing to ask
    return channel.peer_failed(round_no, wait)


def _raised_by_torch(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from or while handling, came out of
    torch: one of its distributed error types, or raised with torch's code innermost
    (a collective's wrapper, the autograd engine running DDP's hooks), or with this
    package's (the state synchronisation's: a superseded round, another rank's failed
    transfer). A ``raise`` in the user's own frames is not: a failed collective cannot
    have raised it."""
    import torch
    import torch.distributed as dist

    homes = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
    kinds = tuple(
        kind
        for kind in (getattr(dist, n, None) for n in ("DistError", "DistBackendError"))
        if isinstance(kind, type) and issubclass(kind, BaseException)
    )
    for err in error_chain(exc):
        if kinds and isinstance(err, kinds):
            return True
        tb = err.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and tb.tb_frame.f_code.co_filename.startswith(homes):
            return True
    return False


def _next_round(channel: Channel, state: State, round_no: int, wait: float, failure: str) -> int:
    """Tear the broken group down, roll back, and take the agent's next round (its
    environment); returns its number. Raises when no round comes (``failure``: the
    first line of the error that a peer's failure caused)."""
    # Peers blocked reading from this worker's broken group must fail too: the round's
    # message names every worker's listeners, and the channel's thread cut the
    # connections to them and to this node's other workers as it came (``_interrupt``);
    # the ones to this node's other workers are cut here too: before the message comes,
    # or again after it (a group made since, which its list does not name).
    _teardown()
    state.rollback()
    message = channel.wait_round(round_no, wait)
    if message is None:
        raise RuntimeError(
            f"{failure}; a peer failed, but the agent announced no new round within {wait:.0f}s"
        )
    env = message.get("env") or {}
    os.environ.update({key: str(env[key]) for key in wire.ROUND_VARIABLES if key in env})
    channel.send("joined", round=int(message["round"]))
    return int(message["round"])


def _interrupt(message: dict[str, Any]) -> None:
    """A newer round came while the function may still run (the channel's thread): make
    its collectives fail. gloo's run over TCP: cut the connections to the previous
    round's workers. NCCL's do not (and a collective with a dead peer hangs rather than
    fails): abort the communicators, as NCCL allows from another thread."""
    cut_connections(message.get("cut") or ())
    cut_peer_connections()  # this node's workers too, whatever the list missed (see cut)
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_backend() != "nccl":
        return
    for pg in list(dist.distributed_c10d._world.pg_map):
        with contextlib.suppress(Exception):  # aborted already, or being destroyed
            pg.abort()


def _teardown() -> None:
    """Drop the broken process group (NCCL: abort its communicators first) and the
    objects of the failed call that still hold it; first cut the connections to this
    node's other workers (see ``inprocess.cut``)."""
    import torch.distributed as dist

    release_idle()  # the groups the last recovery kept (see inprocess.parking)
    cut_peer_connections()
    if dist.is_available() and dist.is_initialized():
        park_process_groups()
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if dist.get_backend() == "nccl" and abort is not None:
            try:
                abort()  # NCCL: abort the communicators (a destroy could wait on them)
            except Exception:  # the channel's thread aborted some already
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
        else:
            dist.destroy_process_group()
    elif dist.is_available():
        world = getattr(dist.distributed_c10d, "_world", None)
        if world is not None and not world.pg_map:
            # An init_process_group that failed (the synchronisation's, when a peer went
            # away) counted a group it never made; the group names of the next one must
            # match those of a fresh process, whose count starts at 0.
            world.group_count = 0
    keep_parked()
    gc.collect()  # the failed call's DDP wrapper, and its hooks on the parameters


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:120]}" if text else type(exc).__name__
