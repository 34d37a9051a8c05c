"""``elastrun --slurm``: the rendezvous settings of a launch, read from a Slurm step.

Inside ``srun``, every node of the step runs one elastrun; Slurm already tells each of
them everything a multi-node launch needs, so ``srun elastrun --slurm --nproc-per-node 4
train.py`` is the whole launch:

* the **run id** is the job and step (``SLURM_JOB_ID.SLURM_STEP_ID``), the same on every
  node of the step and different for every step, so a later step never meets an earlier
  step's closed rendezvous;
* the **node count** is the step's (``SLURM_STEP_NUM_NODES``, else ``SLURM_NNODES``, else
  ``SLURM_JOB_NUM_NODES``), used as ``--nnodes N:N`` unless ``--nnodes`` is given;
* the **endpoint** is the first host of the step's node list (``SLURM_STEP_NODELIST``,
  else ``SLURM_JOB_NODELIST``), expanded from Slurm's hostlist syntax, and that node
  serves the store (``is_host`` is decided by name, not guessed through DNS);
* this node's **address** (``--local-addr``) is its Slurm node name
  (``SLURMD_NODENAME``), the name the others know it by, and its **rank** is its place
  in the node list.

The port: a fixed 29400 (torchrun's habit) makes two jobs that share their first node
collide; the store of one would serve, or break, the other. Here the port is derived
from the run id, ``29400 + crc32(run_id) % 1000``, the same on every node of the step
and different across jobs (PyTorch Lightning derives its port from the job id for the
same reason). ``--rdzv-endpoint :PORT`` picks the port; ``--rdzv-endpoint HOST:PORT``
(an external ``elastrun store``, an etcd cluster) replaces the derived endpoint.

Everything here is a pure function of the environment given; nothing is resolved,
contacted or changed. The hostlist expander is our own rather than python-hostlist:
that package is GPL-licensed (elastrun is BSD) and the launcher has no third-party
dependency; Slurm's syntax is small and is pinned by tests, including against
``scontrol show hostnames`` in the end-to-end test.
"""

from __future__ import annotations

import itertools
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from elastrun.core.errors import ConfigError
from elastrun.core.values import parse_host_port, parse_int
from elastrun.launch.config import MAX_NODES

__all__ = [
    "BASE_PORT",
    "MAX_HOSTS",
    "PORT_SPREAD",
    "SlurmSettings",
    "expand_hostlist",
    "slurm_overrides",
]

BASE_PORT = 29400
PORT_SPREAD = 1000
#: A node list that expands past this is refused rather than built (``n[0-999999999]``).
MAX_HOSTS = 1_000_000

_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_NNODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
_NTASKS_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
_ONE_PER_NODE = "start one elastrun per node: srun --ntasks-per-node=1 elastrun --slurm ..."


@dataclass(frozen=True)
class SlurmSettings:
    """What ``--slurm`` sets for this node, derived from the Slurm environment.

    Attributes:
        run_id: ``JOB`` or ``JOB.STEP``; becomes ``--rdzv-id`` unless that is given.
        nnodes: the number of nodes in the step; ``--nnodes N:N`` unless given.
        node_rank: this node's index in ``hosts`` (``--node-rank``, static backend).
        hosts: the step's nodes, expanded, in Slurm's order.
        endpoint: ``HOST:PORT`` of the rendezvous (``--rdzv-endpoint``).
        is_host: whether this node serves the store at ``endpoint`` (``is_host`` in
            ``--rdzv-conf``); None when the endpoint was given with a host of its own.
        local_addr: this node's Slurm node name (``--local-addr``), None if unknown.
        notices: lines for the launcher to log.
    """

    run_id: str
    nnodes: int
    node_rank: int
    hosts: tuple[str, ...]
    endpoint: str
    is_host: bool | None
    local_addr: str | None
    notices: tuple[str, ...]


# --------------------------------------------------------------------------------------
# Hostlists: "node[01-03,07],gpu-a[1-2]" -> node01 node02 node03 node07 gpu-a1 gpu-a2


_RANGE_RE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_hostlist(text: str, source: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand a Slurm hostlist expression into host names, in order.

    Items are separated by commas outside brackets (empty items are skipped, as
    ``scontrol show hostnames`` skips them). A bracket holds comma-separated
    numbers or ``LO-HI`` ranges; numbers keep the zero padding of ``LO`` (``[08-10]``
    gives 08, 09, 10). A name may hold several brackets (``r[1-2]n[1-2]``): the
    leftmost varies slowest, as in Slurm. Duplicates are kept, as Slurm keeps them.
    Text after a bracket (``n[1-2]-ib``) is accepted, which Slurm 22.05 itself refuses
    and later versions allow.

    Raises:
        ConfigError: unbalanced brackets, an empty range, a range whose end is
            below its start, a non-numeric range, or more than :data:`MAX_HOSTS` names;
            naming ``source`` and the expression.
    """
    hosts: list[str] = []
    for item in _split_top_level(text, source):
        hosts.extend(_expand_item(item, text, source))  # (at most MAX_HOSTS each)
        if len(hosts) > MAX_HOSTS:
            raise ConfigError(source, text, f"expands to more than {MAX_HOSTS} hosts")
    if not hosts:
        raise ConfigError(source, text, "names no host")
    return hosts


def _split_top_level(text: str, source: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(source, text, "nested brackets in the host list")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(source, text, "a ']' without its '[' in the host list")
        elif char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    if depth != 0:
        raise ConfigError(source, text, "a '[' without its ']' in the host list")
    items.append(text[start:].strip())
    return [item for item in items if item]  # "a,,b" is a and b, as for scontrol


def _expand_item(item: str, text: str, source: str) -> list[str]:
    # "r[1-2]n[3,5]x" -> choices per piece: [["r"], ["1", "2"], ["n"], ["3", "5"], ["x"]]
    parts: list[list[str]] = []
    for piece in re.split(r"(\[[^\]]*\])", item):
        if piece.startswith("["):
            parts.append(_expand_bracket(piece[1:-1], text, source))
        elif piece:
            parts.append([piece])
    total = 1
    for choices in parts:
        total *= len(choices)
        if total > MAX_HOSTS:
            raise ConfigError(source, text, f"expands to more than {MAX_HOSTS} hosts")
    return ["".join(pieces) for pieces in itertools.product(*parts)]


def _expand_bracket(body: str, text: str, source: str) -> list[str]:
    names: list[str] = []
    for piece in body.split(","):
        match = _RANGE_RE.fullmatch(piece.strip())
        if match is None:
            raise ConfigError(source, text, f"{piece.strip()!r} is not a number or LO-HI range")
        lo_text, hi_text = match.groups()
        lo, hi = int(lo_text), int(hi_text or lo_text)
        if hi < lo:
            raise ConfigError(source, text, f"the range {piece.strip()} ends below its start")
        if hi - lo >= MAX_HOSTS:
            raise ConfigError(source, text, f"expands to more than {MAX_HOSTS} hosts")
        width = len(lo_text)
        names.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return names


# --------------------------------------------------------------------------------------
# The environment -> SlurmSettings.


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value, name
    return None


def _count(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[int, str] | None:
    found = _first(environ, names)
    return None if found is None else (parse_int(*found, low=1, high=MAX_NODES), found[1])


def derived_port(run_id: str) -> int:
    """The store port of a Slurm step: ``29400 + crc32(run_id) % 1000``."""
    return BASE_PORT + zlib.crc32(run_id.encode()) % PORT_SPREAD


def _split_endpoint(endpoint: str) -> tuple[str, int | None]:
    """``HOST:PORT``, ``:PORT``, ``HOST``, ``[v6]:PORT`` -> (host, port or None)."""
    text = endpoint.strip()
    if not text:
        return "", None
    only_port = text.startswith(":")  # the host is then the step's first node
    try:
        host, port = parse_host_port(
            f"_{text}" if only_port else text, "--rdzv-endpoint", None, allow_zero=False
        )
    except ConfigError as exc:
        raise ConfigError(exc.field, endpoint, exc.reason) from None
    if only_port:
        return "", port
    return (f"[{host}]" if ":" in host else host), port


def slurm_overrides(environ: Mapping[str, str], *, rdzv_endpoint: str = "") -> SlurmSettings:
    """Derive this node's launch settings from a Slurm step's environment.

    Args:
        environ: the environment (``SLURM_*`` and ``SLURMD_NODENAME`` are read).
        rdzv_endpoint: ``--rdzv-endpoint`` as the user gave it, or ``""``. With a host
            it is kept as is (an external store or etcd); ``:PORT`` only picks the port
            of the derived endpoint.

    Raises:
        ConfigError: not inside a Slurm allocation (naming ``--slurm``); inside an
            allocation but not in an ``srun`` step of several nodes; more than one task
            per node; a malformed or inconsistent variable (naming it).
    """
    run_id, step_id = _run_id(environ)
    hosts, nodelist = _step_hosts(environ, stepped=bool(step_id))
    nnodes = len(hosts)
    node_name = environ.get("SLURMD_NODENAME", "").strip() or None
    node_rank = _node_rank(environ, hosts, node_name)
    endpoint, is_host = _endpoint(rdzv_endpoint, run_id, hosts[0], node_rank)
    notice = (
        f"--slurm: run id {run_id}, {nnodes} node(s) {nodelist}, this node "
        f"{node_name or '?'} (rank {node_rank}), rendezvous at {endpoint}"
        + (" served by this node" if is_host else "")
    )
    return SlurmSettings(
        run_id=run_id,
        nnodes=nnodes,
        node_rank=node_rank,
        hosts=hosts,
        endpoint=endpoint,
        is_host=is_host,
        local_addr=node_name,
        notices=(notice,),
    )


def _run_id(environ: Mapping[str, str]) -> tuple[str, str]:
    """The run id of a Slurm step (``JOB.STEP``, or ``JOB`` outside a step) and the step."""
    job_id = environ.get("SLURM_JOB_ID", "").strip() or environ.get("SLURM_JOBID", "").strip()
    if not job_id:
        raise ConfigError(
            "--slurm",
            True,
            "not inside a Slurm allocation (SLURM_JOB_ID is not set); run it under srun, "
            "e.g. srun --nodes 2 --ntasks-per-node 1 elastrun --slurm ...",
        )
    step_id = environ.get("SLURM_STEP_ID", "").strip() or environ.get("SLURM_STEPID", "").strip()
    return (f"{job_id}.{step_id}" if step_id else job_id), step_id


def _step_hosts(environ: Mapping[str, str], *, stepped: bool) -> tuple[tuple[str, ...], str]:
    """The step's hosts, in node order, and the node list as Slurm wrote it; checks that
    the node count agrees and that there is at most one task per node."""
    nodelist = _first(environ, _NODELIST_VARS)
    if nodelist is None:
        raise ConfigError("SLURM_JOB_NODELIST", None, "is not set inside the Slurm allocation")
    hosts = tuple(expand_hostlist(*nodelist))
    counted = _count(environ, _NNODES_VARS)
    nnodes = len(hosts) if counted is None else counted[0]
    if counted is not None and nnodes != len(hosts):
        raise ConfigError(
            counted[1], str(nnodes), f"disagrees with {nodelist[1]}={nodelist[0]} ({len(hosts)})"
        )
    if not stepped and nnodes > 1:
        raise ConfigError(
            "--slurm",
            True,
            f"not inside an srun step, but the allocation has {nnodes} nodes; {_ONE_PER_NODE}",
        )
    tasks = _count(environ, _NTASKS_VARS)
    if tasks is not None and tasks[0] > nnodes:
        raise ConfigError(
            tasks[1], str(tasks[0]), f"{tasks[0]} tasks on {nnodes} node(s); {_ONE_PER_NODE}"
        )
    return hosts, nodelist[0]


def _endpoint(
    rdzv_endpoint: str, run_id: str, first_host: str, node_rank: int
) -> tuple[str, bool | None]:
    """The rendezvous endpoint and whether this node serves its store (None: the given
    endpoint decides, or nobody does: an external store)."""
    host, port = _split_endpoint(rdzv_endpoint)
    if host:
        endpoint = rdzv_endpoint.strip() if port is not None else f"{host}:{derived_port(run_id)}"
        return endpoint, None
    port = derived_port(run_id) if port is None else port
    return f"{first_host}:{port}", node_rank == 0


def _node_rank(environ: Mapping[str, str], hosts: tuple[str, ...], node_name: str | None) -> int:
    """This node's place in the step's node list: by name, else ``SLURM_NODEID``."""
    if node_name is not None and node_name in hosts:
        return hosts.index(node_name)
    raw = environ.get("SLURM_NODEID", "").strip()
    if not raw:
        raise ConfigError(
            "SLURMD_NODENAME", node_name, f"this node is not in the node list {','.join(hosts)}"
        )
    return parse_int(raw, "SLURM_NODEID", low=0, high=len(hosts) - 1)
