"""``elastrun k8s manifest ...``: parse the arguments, write the manifests as YAML.

The manifests themselves are built by :mod:`elastrun.launch.k8s`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from elastrun.core.errors import ConfigError
from elastrun.core.values import MAX_SECONDS, parse_int, parse_port
from elastrun.launch.commands import CommandParser
from elastrun.launch.config import MAX_NPROC_PER_NODE
from elastrun.launch.k8s.manifest import (
    DEFAULT_STORE_PORT,
    RESTART_POLICIES,
    STORES,
    ManifestSpec,
    build_manifests,
)
from elastrun.launch.k8s.yaml_writer import dump_yaml
from elastrun.launch.parsers import parse_nnodes

__all__ = ["k8s_main", "parse_manifest_args"]

_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_NPROC = re.compile(r"([1-9][0-9]*|cpu|gpu|auto)")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def _parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="elastrun k8s manifest",
        description="Write Kubernetes manifests for an elastic elastrun job: an indexed "
        "Job of MAX worker pods, a headless Service, and an elastrun store Deployment "
        "(or an existing etcd). Everything after -- is appended to each pod's elastrun "
        "command line: the script and its arguments.",
        epilog="example: elastrun k8s manifest --name train --image registry/train:1 "
        "--nnodes 2:4 --nproc-per-node 8 --gpus 8 -- train.py --epochs 10 | kubectl apply -f -",
    )
    p.add_argument("--name", required=True, help="job name (lowercase, digits, '-')")
    p.add_argument("--image", required=True, help="worker image; elastrun must be installed")
    p.add_argument("--nnodes", required=True, metavar="MIN:MAX", help="pods: MIN to train, MAX")
    p.add_argument("--nproc-per-node", default="1", metavar="N", help="workers per pod")
    p.add_argument("--namespace", help="namespace of every object (default: kubectl's)")
    p.add_argument("--store", default="elastrun", choices=STORES, help="rendezvous store")
    p.add_argument("--etcd-endpoint", metavar="HOST:PORT,...", help="etcd for --store etcd")
    p.add_argument("--store-port", type=int, default=DEFAULT_STORE_PORT, help="store port")
    p.add_argument("--store-image", help="image of the store pod (default: --image)")
    p.add_argument("--token-secret", metavar="SECRET", help="Secret with the store token")
    p.add_argument("--cpu", help="CPU request and limit per pod, e.g. 8 or 500m")
    p.add_argument("--memory", help="memory request and limit per pod, e.g. 32Gi")
    p.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu limit per pod")
    p.add_argument("--shm-size", help="size limit of /dev/shm (memory-backed)")
    p.add_argument("--restart-policy", default="OnFailure", choices=RESTART_POLICIES)
    p.add_argument("--backoff-limit", type=int, default=6, help="pod failures tolerated")
    p.add_argument("--max-restarts", type=int, default=3, help="elastrun --max-restarts")
    p.add_argument("--rdzv-conf", default="", metavar="K=V,...", help="extra --rdzv-conf")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="worker env")
    p.add_argument("--termination-grace", type=int, default=60, metavar="SECONDS")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    return p


def _check_name(spec_name: str, max_nodes: int) -> None:
    if not _DNS_LABEL.fullmatch(spec_name):
        raise ConfigError(
            "--name", spec_name, "must be lowercase letters, digits and '-', starting with a letter"
        )
    longest = max(len(f"{spec_name}-store"), len(f"{spec_name}-{max_nodes - 1}"))
    if longest > 63:
        raise ConfigError("--name", spec_name, "is too long: pod and service names must fit 63")


def _pairs(items: Sequence[str], option: str) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(option, item, "must be KEY=VALUE")
        out.append((key.strip(), value.strip()))
    return tuple(out)


def parse_manifest_args(argv: Sequence[str]) -> tuple[ManifestSpec, str | None]:
    """``elastrun k8s manifest`` arguments -> (spec, output file or None).

    Raises:
        ConfigError: a missing or invalid option, or no command after ``--``.
    """
    args = list(argv)
    split = args.index("--") if "--" in args else len(args)
    ns = _parser().parse_args(args[:split])  # -h/--help prints and exits here
    if split == len(args):
        raise ConfigError("--", None, "give the training command after --, e.g. -- train.py")
    command = tuple(args[split + 1 :])
    if not command:
        raise ConfigError("--", None, "the training command after -- is empty")
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    _check_name(ns.name, max_nodes)
    if not _NPROC.fullmatch(ns.nproc_per_node):
        raise ConfigError(
            "--nproc-per-node",
            ns.nproc_per_node,
            f"must be an integer from 1 to {MAX_NPROC_PER_NODE}, cpu, gpu or auto",
        )
    if ns.nproc_per_node.isdigit():
        parse_int(ns.nproc_per_node, "--nproc-per-node", low=1, high=MAX_NPROC_PER_NODE)
    if ns.namespace is not None and not _DNS_LABEL.fullmatch(ns.namespace):
        raise ConfigError("--namespace", ns.namespace, "is not a valid namespace name")
    for option, value in (("--cpu", ns.cpu), ("--memory", ns.memory), ("--shm-size", ns.shm_size)):
        if value is not None and not _QUANTITY.fullmatch(value):
            raise ConfigError(option, value, "is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)")
    if ns.store == "etcd" and not ns.etcd_endpoint:
        raise ConfigError("--etcd-endpoint", None, "is required with --store etcd")
    if ns.store != "etcd" and ns.etcd_endpoint:
        raise ConfigError("--etcd-endpoint", ns.etcd_endpoint, "is only used with --store etcd")
    if ns.token_secret and ns.store != "elastrun":
        raise ConfigError("--token-secret", ns.token_secret, "is for the elastrun store only")
    parse_port(ns.store_port, "--store-port", allow_zero=False)
    for option, number, high in (
        ("--gpus", ns.gpus, None), ("--backoff-limit", ns.backoff_limit, None),
        ("--max-restarts", ns.max_restarts, None),
        ("--termination-grace", ns.termination_grace, MAX_SECONDS),
    ):  # fmt: skip
        parse_int(number, option, low=0, high=high)
    env = _pairs(ns.env, "--env")
    for key, _ in env:
        if not _ENV_NAME.fullmatch(key):
            raise ConfigError("--env", key, "is not a valid environment variable name")
    conf = _pairs([c for c in ns.rdzv_conf.split(",") if c.strip()], "--rdzv-conf")
    spec = ManifestSpec(
        name=ns.name, image=ns.image, min_nodes=min_nodes, max_nodes=max_nodes,
        command=command, nproc_per_node=ns.nproc_per_node, namespace=ns.namespace,
        store=ns.store, etcd_endpoint=ns.etcd_endpoint, store_port=ns.store_port,
        store_image=ns.store_image, token_secret=ns.token_secret, cpu=ns.cpu,
        memory=ns.memory, gpus=ns.gpus, shm_size=ns.shm_size,
        restart_policy=ns.restart_policy, backoff_limit=ns.backoff_limit,
        max_restarts=ns.max_restarts, rdzv_conf=conf, env=env,
        termination_grace=ns.termination_grace,
    )  # fmt: skip
    output: str | None = ns.output
    return spec, output


USAGE = "usage: elastrun k8s manifest --name NAME --image IMAGE --nnodes MIN:MAX ... -- SCRIPT ..."


def k8s_main(argv: Sequence[str]) -> int:
    """``elastrun k8s manifest ...``: write the manifests; returns the exit status.

    0 on success, 2 for bad options (one line on stderr, nothing written).
    """
    args = list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\nsubcommands:\n  manifest  write the manifests of an elastic job")
        return 0 if args else 2
    if args[0] != "manifest":
        print(f"elastrun k8s: error: unknown subcommand {args[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        spec, output = parse_manifest_args(args[1:])
    except ConfigError as exc:
        # argparse's own messages carry no value: leave out ConfigError's "(got None)".
        text = f"{exc.field}: {exc.reason}" if exc.value is None else str(exc)
        print(f"elastrun k8s: error: {text}", file=sys.stderr)
        return 2
    text = dump_yaml(build_manifests(spec))
    if output is None or output == "-":
        sys.stdout.write(text)
    else:
        Path(output).write_text(text)
    return 0
