"""The job's Kubernetes objects: :class:`ManifestSpec` and the builders, pure functions of it.

The choices behind them are in the package's docstring (:mod:`elastrun.launch.k8s`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastrun.core.exitcodes import ExitStatus
from elastrun.wire.env import POD_RUN_ID_ENV

__all__ = [
    "CONTAINER",
    "DEFAULT_STORE_PORT",
    "JSON",
    "RESTART_POLICIES",
    "RUN_ID_LABEL",
    "STORES",
    "TOKEN_DIR",
    "TOKEN_KEY",
    "Doc",
    "ManifestSpec",
    "agent_args",
    "build_manifests",
]

JSON = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
Doc = dict[str, JSON]

DEFAULT_STORE_PORT = 29400
CONTAINER = "trainer"
TOKEN_DIR = "/etc/elastrun/token"
TOKEN_KEY = "token"
RUN_ID_LABEL = "batch.kubernetes.io/controller-uid"
RESTART_POLICIES = ("OnFailure", "Never")
STORES = ("elastrun", "etcd")


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
        "--rdzv-id", f"$({POD_RUN_ID_ENV})",
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
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def _worker_pod(spec: ManifestSpec) -> Doc:
    env: list[JSON] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {
            "name": POD_RUN_ID_ENV,
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
        job_spec["podFailurePolicy"] = pod_failure_policy()
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


def pod_failure_policy() -> Doc:
    """What the Job does with a worker pod that failed, by elastrun's exit status (the
    first matching rule wins; any other failure counts against ``backoffLimit``).

    Needs the pods' ``restartPolicy: Never``: Kubernetes refuses the policy otherwise.
    """

    def on_exit(action: str, *codes: ExitStatus) -> JSON:
        exits: Doc = {"containerName": CONTAINER, "operator": "In", "values": list(map(int, codes))}
        return {"action": action, "onExitCodes": exits}

    return {
        "rules": [
            # No retry fixes these: a bad option, or a failure that repeats (a crash
            # loop, restarts without progress). Every pod is stopped at once.
            on_exit("FailJob", ExitStatus.BAD_CONFIG, ExitStatus.DO_NOT_REQUEUE),
            # The node, not the job, is at fault: the pod is replaced without counting
            # against the backoff limit, as for an eviction, and the elastic job goes
            # on with the others meanwhile.
            on_exit("Ignore", ExitStatus.REPLACE_NODE),
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
        ]
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
