"""The worker template's control channel: names, framing and the spawn request's shape.

Shared by the template (:mod:`elastrun.template.worker.serve`) and the agent's end of the
channel (``elastrun.template.agent.starter``), and light on purpose: the agent
imports it on every launch, so it pulls in nothing of the template's own machinery.

**Version.** :data:`VERSION` travels in every message that starts something: the
template's hello, the agent's setup, each batch and each spawn request. Either end
refuses a message of another version (:func:`version_problem` says why): the agent
then starts its workers without the template, the template exits.

Each message is a 4-byte big-endian length and a UTF-8 JSON object. The agent asks for
workers in batches (``{"version": V, "batch": [request, ...]}``), the descriptors of
every request's stdin, stdout and stderr attached in order (SCM_RIGHTS); the template
answers ``{"results": [{"pid": N} | {"error": "..."}, ...]}``, one per request.

The batch's last descriptor is its *ledger*: the write end of a pipe on which every
process forked for the batch writes its own pid first thing (``I<pid>`` for an
intermediate, ``W<pid>`` for a worker), and which each of them holds until it exits or
is handed over. An agent that gives up on a batch before the answer (a signal, a wedged
template) reads the ledger to its end: it then knows every process the batch made, and
that each has exited, so it can reap those the kernel handed to it (see
``Template.spawn_batch``). Without it they stayed the agent's zombies, unknown to it.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence

#: The module the agent runs (``python -m``) to start a template.
TEMPLATE_MODULE = "elastrun.template.worker.serve"
#: The channel's version, bumped on any incompatible change of the messages below.
VERSION = 4
#: The variable the agent puts first in the template's environment: room for the
#: workers' command lines past the end of the template's own (see
#: elastrun.template.worker.child.retitle).
TITLE_ROOM = "ELASTRUN_TITLE_ROOM"
#: A spawn request sends stdin, stdout and stderr (those that are open).
STDIO_FDS = 3
#: At most this many spawn requests travel in one batch: their descriptors must fit in
#: one SCM_RIGHTS message (Linux takes at most 253).
BATCH_MAX = 64
# A spawn request's environment and argv are small; anything this big is a bug.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: The fields of a spawn request and their JSON types.
REQUEST_FIELDS: dict[str, type] = {
    "argv": list,
    "bootstrap_args": list,
    "env": dict,
    "cwd": str,
    "umask": int,
    "agent_pid": int,
    "death_signal": int,
    "ignored_signals": list,
    "blocked_signals": list,
    "stdio": list,
    "cpus": list,
}


def send_message(sock: socket.socket, message: dict[str, object], fds: Sequence[int] = ()) -> None:
    """Send one JSON message, with ``fds`` attached to its first byte."""
    payload = json.dumps(message).encode()
    data = len(payload).to_bytes(4, "big") + payload
    sent = socket.send_fds(sock, [data], list(fds)) if fds else 0
    sock.sendall(data[sent:])


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("control channel closed in the middle of a message")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_message(
    sock: socket.socket, maxfds: int = 0
) -> tuple[dict[str, object], list[int]] | None:
    """Receive one message and the descriptors sent with it; None at end of stream.

    Raises:
        ConnectionError: the stream ended inside a message, or the message is malformed.
    """
    head, fds, flags, _ = socket.recv_fds(sock, 4, max(maxfds, 1))
    if not head:
        for fd in fds:
            os.close(fd)
        return None
    try:
        if flags & socket.MSG_CTRUNC:
            raise ConnectionError("descriptors were lost in transit (MSG_CTRUNC)")
        if len(head) < 4:
            head += _recv_exactly(sock, 4 - len(head))
        size = int.from_bytes(head, "big")
        if size > _MAX_MESSAGE_BYTES:
            raise ConnectionError(f"message of {size} bytes is too large")
        try:
            message = json.loads(_recv_exactly(sock, size))
        except ValueError as exc:  # not UTF-8, not JSON
            raise ConnectionError(f"malformed control message: {exc}") from exc
        if not isinstance(message, dict):
            raise ConnectionError("a control message must be a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


def version_problem(message: dict[str, object]) -> str | None:
    """What is wrong with a message's ``version`` (None: it is :data:`VERSION`)."""
    version = message.get("version")
    if version == VERSION and not isinstance(version, bool):
        return None
    return f"protocol version {version!r}, expected {VERSION}"


def split_batch(
    message: dict[str, object], fds: list[int]
) -> tuple[list[dict[str, object]], list[list[int]], int] | str:
    """A batch's requests, each one's descriptors and the ledger's descriptor, or what
    is wrong with the batch as a whole (each request is checked on its own by
    :func:`check_request`)."""
    problem = version_problem(message)
    if problem is not None:
        return problem
    if not fds:
        return "a batch comes with its ledger's descriptor"
    fds, ledger = fds[:-1], fds[-1]
    batch = message.get("batch")
    if not isinstance(batch, list) or not 0 < len(batch) <= BATCH_MAX:
        return f"batch must be a list of 1 to {BATCH_MAX} requests"
    if not all(isinstance(r, dict) and isinstance(r.get("stdio"), list) for r in batch):
        return "every request of a batch must be an object with stdio flags"
    counts = [sum(bool(f) for f in r["stdio"]) for r in batch]
    if sum(counts) != len(fds):
        return f"the requests' stdio flags name {sum(counts)} descriptor(s), {len(fds)} came"
    owned, at = [], 0
    for n in counts:
        owned.append(fds[at : at + n])
        at += n
    return batch, owned, ledger


def check_request(request: dict[str, object], nfds: int) -> str | None:
    """What is wrong with a spawn request that came with ``nfds`` descriptors, or None."""
    problem = version_problem(request)
    if problem is not None:
        return problem
    for name, kind in REQUEST_FIELDS.items():
        if not isinstance(request.get(name), kind):
            return f"{name} must be a {kind.__name__}"
    stdio = request["stdio"]
    assert isinstance(stdio, list)
    if len(stdio) != STDIO_FDS or sum(bool(f) for f in stdio) != nfds:
        return f"stdio flags {stdio} do not match the {nfds} descriptor(s) sent"
    return None


def note_pid(ledger: int, role: bytes) -> None:
    """Write this process's pid on a batch's ledger (``role``: ``b"I"`` or ``b"W"``).

    One short write, atomic on a pipe; a reader that is gone is no error (the agent
    closes its end once it has the answer, when nothing is left to reap).
    """
    try:
        os.write(ledger, b"%s%d\n" % (role, os.getpid()))
    except OSError:
        pass


def int_list(request: dict[str, object], key: str) -> list[int]:
    """A request's list of integers (signals, CPUs); an absent key is an empty list."""
    value = request.get(key, [])
    assert isinstance(value, list)
    return [int(v) for v in value]
