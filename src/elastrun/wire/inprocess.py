"""The local channel of in-process recovery: what an agent and its workers say.

The agent listens on a Unix stream socket whose path it gives every worker in
``ELASTRUN_INPROCESS_SOCKET``. A worker that uses ``elastrun.inprocess.run`` connects
once and keeps the connection for its life; each message is one line of JSON.

worker -> agent
  ``{"op": "hello", "version": V, "local_rank": LR, "pid": PID, "round": N}``
      the worker recovers in place (the opt-in); N is the in-process round it runs in,
      V the channel's version it speaks
  ``{"op": "joined", "local_rank": LR, "round": N}``
      the worker took round N's environment and is about to synchronise state
  ``{"op": "synced", "local_rank": LR, "round": N, "commit": C}``
      it holds commit C, the newest of the round, and calls the training function again
  ``{"op": "ask", "local_rank": LR, "round": N}``
      the training function (or the state synchronisation) raised an error that a
      failed collective can raise, in round N: did a peer fail? The worker waits for
      the answer (or a newer round) before it tears anything down

agent -> worker
  ``{"op": "round", "round": N, "env": {...}, "cut": [ENDPOINT, ...]}``
      a worker was replaced: round N starts, with these environment variables; the
      worker shuts down its connections to or from the listed endpoints (where the
      previous round's workers listen, ``core.tcp_sockets`` form). A hello of round N
      from a worker to which a round past N was announced before its hello came (a
      replacement started for a round that a second failure abandoned) is answered at
      once with the newest such round
  ``{"op": "answer", "round": N, "peer_failed": BOOL}``
      the answer to an ``ask`` about round N: true when another worker of round N failed
      (or the round is over: a newer round exists, the group re-forms); false when no
      peer failed within the agent's bound (``ANSWER_HOLD``): the error is the worker's
      own, and it propagates unchanged. A ``round`` message past N answers it too.

**Version.** :data:`VERSION` travels in the worker's hello, the one message that starts
a conversation; nothing is negotiated (both ends come from the same package). The agent
answers a hello of another version (:func:`version_problem`) by closing the connection:
that worker is then not recovered in place, and a failure restarts the whole group, as
torchrun does; the worker's channel ends, so its own errors propagate. A hello without
the key is version 2's, from before the key was added. Version 2 added ``ask`` and
``answer`` (version 1: hello, joined, synced, round).

Nothing here imports more than the standard library and :mod:`.env`: both sides use it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from elastrun.wire.env import RANK_VARIABLES, RESTART_COUNT_ENV, RUN_ID_ENV, USE_AGENT_STORE_ENV

#: The channel's version, carried in the hello.
VERSION = 2
# What a hello without a version speaks: the key came after version 2's messages.
_UNVERSIONED = 2

#: Where the agent's socket is (set only when the agent offers in-process recovery).
SOCKET_ENV = "ELASTRUN_INPROCESS_SOCKET"
#: The in-process round a worker starts in (0: the attempt's first; a replacement
#: starts in a later one and takes the newest commit of its peers).
ROUND_ENV = "ELASTRUN_INPROCESS_ROUND"
#: The name of a worker's own part of its last commit in the node's checkpoint
#: directory, before its local rank (``elastrun.inprocess.worker.own``).
OWN_STATE_PREFIX = "inprocess-own-"
#: Seconds a worker whose collective failed waits for the agent's answer, and then (a
#: peer failed) for the agent to announce a round.
WAIT_ENV = "ELASTRUN_INPROCESS_WAIT"

#: The longest the agent holds its answer to an ``ask`` for news of a peer's failure
#: still in flight (seconds): a dead peer's connection breaks before its exit can be
#: reaped, and another node's failure reaches this agent through that node's agent and
#: the rendezvous store (its reaping, one store write, this agent's watch event: tens
#: of milliseconds on a healthy network). Five seconds leave a loaded machine two
#: orders of magnitude of margin, and a worker's own error (one that is not a failed
#: collective) is still named within seconds, not after ``WAIT_ENV``'s two minutes.
ANSWER_HOLD = 5.0

#: The variables a round message may change (the rest of the environment stays).
ROUND_VARIABLES = (*RANK_VARIABLES, RESTART_COUNT_ENV, RUN_ID_ENV, USE_AGENT_STORE_ENV, ROUND_ENV)

MAX_LINE = 1 << 20


class WireError(Exception):
    """A line that is not a message of this channel."""


def first_round() -> bool:
    """Whether this process runs in its attempt's first round (every process of the job
    new: its start, a group restart), not one started or recovered into an in-process
    round."""
    return os.environ.get(ROUND_ENV, "0") in ("", "0")


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError:
        raise WireError(f"not JSON: {line[:80]!r}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise WireError(f"not a message: {line[:80]!r}")
    return message


def version_problem(hello: dict[str, Any]) -> str | None:
    """What is wrong with a hello's ``version`` (None: it is :data:`VERSION`)."""
    version = hello.get("version", _UNVERSIONED)
    if version == VERSION and not isinstance(version, bool):
        return None
    return f"in-process channel version {version!r}, expected {VERSION}"


class LineReader:
    """Splits a byte stream into lines (messages), at most ``MAX_LINE`` bytes each."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out: list[dict[str, Any]] = []
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                if len(self._buf) > MAX_LINE:
                    raise WireError("line too long")
                return out
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            if line.strip():
                out.append(decode(line))
