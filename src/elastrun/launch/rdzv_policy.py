"""Which rendezvous a launch uses: standalone, static or a backend, and ``--slurm``'s share.

torchrun's run()/config_from_args() steps: ``--standalone`` (or a plain single-node
launch with no ``--master-port`` and no ``--rdzv-endpoint``) hosts its own c10d
rendezvous on a free local port under a fresh run id; the static backend takes its
endpoint from ``--master-addr``/``--master-port`` and its rank from ``--node-rank``;
any other backend is checked against the registry's built-in names and the plugins'
entry points without importing either. ``--slurm`` fills in what the user did not give.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastrun.core.errors import ConfigError
from elastrun.core.values import parse_host_port, parse_int, parse_port
from elastrun.launch.argv import Values
from elastrun.launch.config import MAX_NODES
from elastrun.launch.entry_points import find_entry_point
from elastrun.launch.parsers import parse_rdzv_conf

if TYPE_CHECKING:
    from elastrun.launch.slurm import SlurmSettings

__all__ = [
    "DEFAULT_MASTER_PORT",
    "Rendezvous",
    "check_rdzv_backend",
    "refuse_not_implemented",
    "resolve_rendezvous",
    "slurm_settings",
]

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Rendezvous:
    """The rendezvous settings of one launch, as the agent gets them."""

    backend: str
    endpoint: str
    run_id: str
    configs: dict[str, str]
    standalone: bool
    node_rank: int
    master_addr: str
    master_port: int


def resolve_rendezvous(
    values: Values, max_nodes: int, notices: list[str], slurm: SlurmSettings | None = None
) -> Rendezvous:
    """torchrun's rendezvous steps (standalone, static), then ``--slurm``'s settings for
    whatever the user did not give.

    Raises:
        ConfigError: a bad ``--rdzv-conf``, ``--node-rank`` or ``--master-port``, an
            unknown backend, an empty run id for several nodes, a node rank outside the
            static backend's nodes, or a ``--master-addr`` with a port.
    """
    configs = parse_rdzv_conf(*values.required("rdzv_conf"))
    node_rank = parse_int(*values.required("node_rank"), low=0, high=MAX_NODES - 1)
    master_port = values.parsed("master_port", parse_port)
    backend, endpoint, run_id = (
        values.required(dest)[0] for dest in ("rdzv_backend", "rdzv_endpoint", "rdzv_id")
    )
    if slurm is not None:  # what the user did not give, from the Slurm step
        backend = backend if values.given("rdzv_backend") else "c10d"
        run_id = run_id if values.given("rdzv_id") else slurm.run_id
        if backend == "static" and not values.given("node_rank"):
            node_rank = slurm.node_rank
        if slurm.is_host is not None:
            configs.setdefault("is_host", "true" if slurm.is_host else "false")
        endpoint = slurm.endpoint
    why = _standalone_reason(values, backend, endpoint, master_port, max_nodes, notices)
    if why is not None:
        backend, endpoint, run_id = "c10d", "localhost:0", str(uuid.uuid4())
        notices.append(
            f"running standalone ({why}): rendezvous backend c10d on localhost:0 "
            f"(a free port), run id {run_id}"
        )
    else:
        check_rdzv_backend(backend, values.source("rdzv_backend"))
    master_port = DEFAULT_MASTER_PORT if master_port is None else master_port
    if max_nodes > 1 and not run_id.strip():
        reason = "must not be empty for a multi-node job: every node needs the same run id"
        raise ConfigError(values.source("rdzv_id"), run_id, reason)
    master_addr, master_addr_source = values.required("master_addr")
    _check_port_zero(values, why is not None, backend, endpoint, master_port, max_nodes)
    if backend == "static":
        if node_rank >= max_nodes:
            reason = f"must be below the number of nodes ({max_nodes}) with the static backend"
            raise ConfigError(values.source("node_rank"), node_rank, reason)
        configs["rank"] = str(node_rank)  # overrides a rank= in --rdzv-conf, as torchrun
        endpoint = endpoint or _master_endpoint(master_addr, master_addr_source, master_port)
    else:
        if values.given("master_addr") and not endpoint:
            notices.append(f"{master_addr_source} is only used by the static backend; ignored")
        if node_rank != 0:
            notices.append(f"{values.source('node_rank')} is only used by the static backend")
    return Rendezvous(
        backend, endpoint, run_id, configs, why is not None, node_rank, master_addr, master_port
    )


def _standalone_reason(
    values: Values,
    backend: str,
    endpoint: str,
    master_port: int | None,
    max_nodes: int,
    notices: list[str],
) -> str | None:
    """Why this launch hosts its own rendezvous, or None when it does not."""
    if values.flag("standalone"):
        ignored = [
            values.source(dest)
            for dest in ("rdzv_backend", "rdzv_endpoint", "rdzv_id")
            if values.given(dest)
        ]
        if ignored:
            notices.append(f"--standalone: ignoring {', '.join(ignored)}")
        return "--standalone"
    if backend == "static" and not endpoint and master_port is None and max_nodes == 1:
        # torchrun's implicit standalone: a plain single-node launch needs no master.
        return "one node and no --master-port or --rdzv-endpoint"
    return None


def _check_port_zero(
    values: Values, standalone: bool, backend: str, endpoint: str, master_port: int, nodes: int
) -> None:
    """Blame the option that chose "any free port" for several nodes.

    The backend refuses that too, but it sees only the endpoint, and would blame
    ``--rdzv-endpoint`` where the user gave ``--standalone`` or ``--master-port 0``.
    """
    if nodes == 1:
        return
    if standalone:
        raise ConfigError(
            values.source("standalone"),
            True,
            f"runs one node on a free local port, but up to {nodes} nodes were asked "
            "for (--nnodes); give every node --rdzv-endpoint HOST:PORT instead",
        )
    if backend == "static" and not endpoint and master_port == 0:
        raise ConfigError(
            values.source("master_port"),
            master_port,
            "port 0 (any free port) works for a single node only: the other nodes "
            "could not find it",
        )


def _master_endpoint(addr: str, source: str, port: int) -> str:
    """``--master-addr`` and ``--master-port`` as the static backend's endpoint.

    A bare IPv6 address gets its brackets (torchrun would glue the port onto it).
    """
    host, given_port = parse_host_port(addr, source, None)
    if given_port is not None:
        raise ConfigError(source, addr, "give the address only; the port is --master-port")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_rdzv_backend(name: str, source: str) -> None:
    """Refuse a backend that is neither built in nor a plugin, before anything starts.

    The built-in names are the registry's (:mod:`elastrun.rendezvous.registry`); plugins
    are looked up in its entry-point groups and not imported.

    Raises:
        ConfigError: an unknown backend, listing the built-in ones.
    """
    from elastrun.rendezvous.registry import (
        BUILTIN_BACKENDS,
        ENTRY_POINT_GROUP,
        TORCH_ENTRY_POINT_GROUP,
    )

    if name in BUILTIN_BACKENDS:
        return
    groups = (ENTRY_POINT_GROUP, TORCH_ENTRY_POINT_GROUP)
    if find_entry_point(groups, name) is None:
        raise ConfigError(
            source,
            name,
            f"unknown rendezvous backend; built in: {', '.join(BUILTIN_BACKENDS)}, "
            f"plugins: entry points in {' or '.join(groups)}",
        )


def refuse_not_implemented(values: Values, backend: str) -> None:
    """Refuse ``etcd-v2``, whose etcd API is gone (after everything else was checked).

    Raises:
        ConfigError: naming ``--rdzv-backend`` and the reason.
    """
    if backend == "etcd-v2":
        from elastrun.rendezvous.etcd import ETCD_V2_REASON

        raise ConfigError(values.source("rdzv_backend"), backend, ETCD_V2_REASON)


def slurm_settings(
    values: Values, environ: Mapping[str, str], notices: list[str]
) -> SlurmSettings | None:
    """``--slurm``: what the Slurm step says about this node, or None without the flag.

    Raises:
        ConfigError: ``--slurm`` with ``--standalone``, or a Slurm environment that
            does not describe a step.
    """
    if not values.flag("slurm"):
        return None
    if values.flag("standalone"):
        raise ConfigError(values.source("standalone"), True, "cannot be combined with --slurm")
    from elastrun.launch.slurm import slurm_overrides

    settings = slurm_overrides(environ, rdzv_endpoint=values.text("rdzv_endpoint")[0] or "")
    notices.extend(settings.notices)
    return settings
