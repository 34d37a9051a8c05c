"""``elastrun k8s manifest``: Kubernetes manifests for an elastic elastrun job.

What it writes (multi-document YAML, to stdout or ``-o FILE``):

* with ``--store elastrun`` (the default): a Deployment of one ``elastrun store`` pod and
  a Service in front of it, the rendezvous every worker pod joins. The store is a pod of
  its own so that losing any worker, including the first, never loses the rendezvous;
* a headless Service that gives each worker pod a stable DNS name
  (``NAME-<index>.NAME``) and is the pods' ``subdomain``;
* an indexed Job of ``MAX`` worker pods, each running one elastrun agent with
  ``--nnodes MIN:MAX``: the job trains as soon as ``MIN`` pods run and grows to ``MAX``.

Choices, and why:

* Each agent's address is its pod IP (downward API), not a DNS name: a new pod's DNS
  record can lag behind the pod, and workers must reach the rank-0 pod at once.
* The run id is the Job's uid (the ``batch.kubernetes.io/controller-uid`` label), so a
  Job submitted again under the same name never meets the old run's closed rendezvous
  in a store that outlived it.
* ``--restart-policy Never`` adds a pod failure policy: exit status 2 (elastrun's bad
  configuration) fails the Job at once instead of burning the backoff limit, and pods
  evicted by a disruption (drain, preemption) do not count as failures.
* The YAML is written without a YAML library: every document is JSON-compatible data,
  and strings are quoted JSON-style unless they are plainly safe, so no value can be
  misread (``on``, ``1e3``, ``0755``). PyYAML stays optional.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from elastrun.core.errors import ConfigError
from elastrun.core.values import MAX_SECONDS, parse_int, parse_port
from elastrun.launch.cli import parse_nnodes
from elastrun.launch.config import MAX_NPROC_PER_NODE

__all__ = ["ManifestSpec", "build_manifests", "dump_yaml", "k8s_main", "parse_manifest_args"]

JSON = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
Doc = dict[str, JSON]

DEFAULT_STORE_PORT = 29400
CONTAINER = "trainer"
TOKEN_DIR = "/etc/elastrun/token"
TOKEN_KEY = "token"
RUN_ID_LABEL = "batch.kubernetes.io/controller-uid"
RESTART_POLICIES = ("OnFailure", "Never")
STORES = ("elastrun", "etcd")

_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_NPROC = re.compile(r"([1-9][0-9]*|cpu|gpu|auto)")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class ManifestSpec:
    """Everything ``elastrun k8s manifest`` needs; validated by :func:`parse_manifest_args`.

    Attributes:
        name: the Job, headless Service and pod name prefix (a DNS-1035 label).
        image: the container image of the workers (it must have elastrun installed).
        min_nodes, max_nodes: ``--nnodes MIN:MAX``; ``max_nodes`` worker pods are created.
        nproc_per_node: ``--nproc-per-node`` of each agent (a number, cpu, gpu or auto).
        command: appended to the agent's command line: the script and its arguments.
        namespace: the namespace of every object, or None for kubectl's current one.
        store: ``elastrun`` (a store Deployment) or ``etcd`` (an existing etcd).
        etcd_endpoint: ``host:port[,host:port...]`` for ``store == "etcd"``.
        store_port: the port of the elastrun store.
        store_image: the store's image (default: ``image``).
        token_secret: a Secret whose key ``token`` is the store's shared token.
        cpu, memory, gpus, shm_size: each worker pod's resources; None leaves them out.
        restart_policy: the pods' ``OnFailure`` (restart the container in place) or
            ``Never`` (replace the pod; adds the pod failure policy).
        backoff_limit: pod failures the Job tolerates before it fails.
        max_restarts: elastrun's ``--max-restarts`` (worker-group restarts, job-wide).
        rdzv_conf: extra ``--rdzv-conf`` items.
        env: extra environment variables of the workers.
        termination_grace: seconds the pods get on deletion; above elastrun's 30 s
            worker grace so the workers can be stopped cleanly.
    """

    name: str
    image: str
    min_nodes: int
    max_nodes: int
    command: tuple[str, ...]
    nproc_per_node: str = "1"
    namespace: str | None = None
    store: str = "elastrun"
    etcd_endpoint: str | None = None
    store_port: int = DEFAULT_STORE_PORT
    store_image: str | None = None
    token_secret: str | None = None
    cpu: str | None = None
    memory: str | None = None
    gpus: int = 0
    shm_size: str | None = None
    restart_policy: str = "OnFailure"
    backoff_limit: int = 6
    max_restarts: int = 3
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    env: tuple[tuple[str, str], ...] = field(default=())
    termination_grace: int = 60

    @property
    def store_name(self) -> str:
        return f"{self.name}-store"

    @property
    def endpoint(self) -> str:
        if self.store == "etcd":
            assert self.etcd_endpoint is not None  # checked when parsed
            return self.etcd_endpoint
        return f"{self.store_name}:{self.store_port}"


# --------------------------------------------------------------------------------------
# The manifests: pure functions of the spec.


def _labels(spec: ManifestSpec, component: str) -> dict[str, JSON]:
    return {
        "app.kubernetes.io/name": "elastrun",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": component,
    }


def _metadata(spec: ManifestSpec, name: str, component: str) -> Doc:
    meta: Doc = {"name": name}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    meta["labels"] = _labels(spec, component)
    return meta


def agent_args(spec: ManifestSpec) -> list[str]:
    """The elastrun command line of every worker pod (``$(VAR)`` expanded by Kubernetes)."""
    conf: list[str] = []
    backend = "etcd" if spec.store == "etcd" else "c10d"
    if spec.store == "elastrun":
        conf.append("is_host=false")  # the store pod serves; no agent does
        if spec.token_secret:
            conf.append(f"token_file={TOKEN_DIR}/{TOKEN_KEY}")
    conf.extend(f"{k}={v}" for k, v in spec.rdzv_conf)
    args = [
        "--nnodes", f"{spec.min_nodes}:{spec.max_nodes}",
        "--nproc-per-node", spec.nproc_per_node,
        "--max-restarts", str(spec.max_restarts),
        "--rdzv-backend", backend,
        "--rdzv-endpoint", spec.endpoint,
        "--rdzv-id", "$(ELASTRUN_RUN_ID)",
        "--local-addr", "$(POD_IP)",
    ]  # fmt: skip
    if conf:
        args += ["--rdzv-conf", ",".join(conf)]
    return [*args, *spec.command]


def _resources(spec: ManifestSpec) -> Doc:
    requests: dict[str, JSON] = {}
    limits: dict[str, JSON] = {}
    if spec.cpu:
        requests["cpu"] = limits["cpu"] = spec.cpu
    if spec.memory:
        requests["memory"] = limits["memory"] = spec.memory
    if spec.gpus:
        limits["nvidia.com/gpu"] = spec.gpus
    out: Doc = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _worker_pod(spec: ManifestSpec) -> Doc:
    env: list[JSON] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {
            "name": "ELASTRUN_RUN_ID",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{RUN_ID_LABEL}']"}},
        },
    ]
    env.extend({"name": k, "value": v} for k, v in spec.env)
    shm: Doc = {"medium": "Memory"}
    if spec.shm_size:
        shm["sizeLimit"] = spec.shm_size
    mounts: list[JSON] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[JSON] = [{"name": "dshm", "emptyDir": shm}]
    if spec.token_secret and spec.store == "elastrun":
        mounts.append({"name": "store-token", "mountPath": TOKEN_DIR, "readOnly": True})
        volumes.append({"name": "store-token", "secret": {"secretName": spec.token_secret}})
    container: Doc = {
        "name": CONTAINER,
        "image": spec.image,
        "command": ["elastrun"],
        "args": [*agent_args(spec)],
        "env": env,
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    container["volumeMounts"] = mounts
    return {
        "subdomain": spec.name,
        "restartPolicy": spec.restart_policy,
        "terminationGracePeriodSeconds": spec.termination_grace,
        "containers": [container],
        "volumes": volumes,
    }


def _job(spec: ManifestSpec) -> Doc:
    job_spec: Doc = {
        "completionMode": "Indexed",
        "completions": spec.max_nodes,
        "parallelism": spec.max_nodes,
        "backoffLimit": spec.backoff_limit,
    }
    if spec.restart_policy == "Never":
        job_spec["podFailurePolicy"] = {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [2]},
                },
                {
                    "action": "Ignore",
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
            ]
        }
    job_spec["template"] = {
        "metadata": {"labels": _labels(spec, "worker")},
        "spec": _worker_pod(spec),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(spec, spec.name, "worker"),
        "spec": job_spec,
    }


def _headless_service(spec: ManifestSpec) -> Doc:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, spec.name, "worker"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": _labels(spec, "worker"),
        },
    }


def _store(spec: ManifestSpec) -> list[Doc]:
    command: list[JSON] = ["elastrun", "store", "--host", "0.0.0.0", "--port", str(spec.store_port)]
    container: Doc = {
        "name": "store",
        "image": spec.store_image or spec.image,
        "command": command,
        "ports": [{"name": "rdzv", "containerPort": spec.store_port}],
        "readinessProbe": {"tcpSocket": {"port": "rdzv"}, "periodSeconds": 2},
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        },
    }
    pod: Doc = {"containers": [container]}
    if spec.token_secret:
        command += ["--token-file", f"{TOKEN_DIR}/{TOKEN_KEY}"]
        container["volumeMounts"] = [
            {"name": "store-token", "mountPath": TOKEN_DIR, "readOnly": True}
        ]
        pod["volumes"] = [{"name": "store-token", "secret": {"secretName": spec.token_secret}}]
    deployment: Doc = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(spec, spec.store_name, "store"),
        "spec": {
            "replicas": 1,
            # Never two stores at once: agents must all see the same one.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": _labels(spec, "store")},
            "template": {"metadata": {"labels": _labels(spec, "store")}, "spec": pod},
        },
    }
    service: Doc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec, spec.store_name, "store"),
        "spec": {
            "selector": _labels(spec, "store"),
            "ports": [{"name": "rdzv", "port": spec.store_port, "targetPort": "rdzv"}],
        },
    }
    return [service, deployment]


def build_manifests(spec: ManifestSpec) -> list[Doc]:
    """The Kubernetes objects of the job, in the order ``kubectl apply`` should see them."""
    docs = _store(spec) if spec.store == "elastrun" else []
    return [*docs, _headless_service(spec), _job(spec)]


# --------------------------------------------------------------------------------------
# YAML out: block style, JSON-quoted strings where a plain scalar could be misread.

_PLAIN = re.compile(r"[A-Za-z][A-Za-z0-9._/-]*")
_YAML_WORDS = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null", "nan", "inf"})


def _quote(text: str) -> str:
    """A YAML double-quoted scalar in pure ASCII (JSON's escapes, plus ``\\U`` for
    characters beyond the BMP, which YAML cannot read as JSON's surrogate pairs)."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif 0x20 <= code < 0x7F:
            out.append(char)
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def _scalar(value: JSON) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, str):
        if _PLAIN.fullmatch(value) and value.lower() not in _YAML_WORDS:
            return value
        return _quote(value)
    raise TypeError(f"not a scalar: {type(value).__name__}")


def _lines(value: JSON, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            head = f"{pad}{_scalar(key)}:"
            if isinstance(item, dict | list) and item:
                out.append(head)
                # Sequences under a mapping key sit at the key's own indentation.
                out.extend(_lines(item, indent if isinstance(item, list) else indent + 2))
            else:
                out.append(f"{head} {_inline(item)}")
        return out
    if isinstance(value, list):
        for item in value:
            if isinstance(item, dict | list) and item:
                inner = _lines(item, indent + 2)
                out.append(f"{pad}- {inner[0][indent + 2 :]}")
                out.extend(inner[1:])
            else:
                out.append(f"{pad}- {_inline(item)}")
        return out
    return [pad + _scalar(value)]


def _inline(value: JSON) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def dump_yaml(docs: Sequence[Doc]) -> str:
    """Multi-document YAML of JSON-compatible documents, ``---`` before each."""
    parts = ["---\n" + "\n".join(_lines(doc, 0) or ["{}"]) + "\n" for doc in docs]
    return "".join(parts)


# --------------------------------------------------------------------------------------
# The command line.


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError("elastrun k8s manifest", None, message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
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


def _check_quantity(option: str, value: str | None) -> None:
    if value is not None and not _QUANTITY.fullmatch(value):
        raise ConfigError(option, value, "is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)")


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
        _check_quantity(option, value)
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
