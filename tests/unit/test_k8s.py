"""Kubernetes: `elastrun k8s manifest` output, and Kubeflow PyTorchJob's PET_* variables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import kubernetes_validate  # the Kubernetes JSON schemas, offline
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from elastrun.core.errors import ConfigError
from elastrun.launch.cli import parse_launch
from elastrun.launch.commands.k8s import k8s_main, parse_manifest_args
from elastrun.launch.k8s import ManifestSpec, agent_args, build_manifests, dump_yaml
from elastrun.launch.k8s.manifest import Doc

BASE = ["--name", "train", "--image", "registry.example/train:1.0", "--nnodes", "2:4"]
COMMAND = ["--", "train.py", "--epochs", "10"]
#: The oldest Kubernetes the manifests are for (batch.kubernetes.io/ pod labels: 1.27)
#: and the newest schemas kubernetes-validate ships. A pod failure policy (with
#: --restart-policy Never) needs 1.29: before it, the published schema wrongly required
#: onPodConditions in every rule, so kubectl's client-side validation refused the rule.
K8S_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
MIN_VERSION_WITH_POLICY = "1.29.0"


def spec_of(*extra: str) -> ManifestSpec:
    spec, _ = parse_manifest_args([*BASE, *extra, *COMMAND])
    return spec


def manifests(spec: ManifestSpec) -> list[dict[str, Any]]:
    """The manifests as the tests read them: JSON trees walked by paths the test knows."""
    return cast("list[dict[str, Any]]", build_manifests(spec))


VARIANTS = {
    "elastrun store": [],
    "elastrun store, token, resources, Never": [
        "--token-secret", "rdzv-token", "--cpu", "8", "--memory", "32Gi", "--gpus", "2",
        "--shm-size", "8Gi", "--restart-policy", "Never", "--namespace", "ml",
        "--env", "NCCL_DEBUG=WARN", "--rdzv-conf", "join_timeout=900",
    ],
    "etcd": ["--store", "etcd", "--etcd-endpoint", "etcd-0.etcd:2379,etcd-1.etcd:2379"],
}  # fmt: skip


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_manifest_is_valid_against_the_kubernetes_schemas(variant: str, version: str) -> None:
    if "Never" in variant and version < MIN_VERSION_WITH_POLICY:
        version = MIN_VERSION_WITH_POLICY
    docs = list(yaml.safe_load_all(dump_yaml(build_manifests(spec_of(*VARIANTS[variant])))))
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_can_fail() -> None:
    job = manifests(spec_of())[-1]
    job["spec"]["completionMode"] = 4
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSIONS[-1], strict=True)


def _kinds(docs: list[dict[str, object]]) -> list[str]:
    return [str(d["kind"]) for d in docs]


def test_the_elastrun_store_gets_a_deployment_and_a_service_etcd_none() -> None:
    assert _kinds(manifests(spec_of())) == ["Service", "Deployment", "Service", "Job"]
    etcd = manifests(spec_of(*VARIANTS["etcd"]))
    assert _kinds(etcd) == ["Service", "Job"]


def test_the_job_runs_max_pods_indexed_with_the_headless_service_as_subdomain() -> None:
    svc, job = manifests(spec_of())[-2:]
    assert svc["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4
    pod = spec["template"]
    assert pod["spec"]["subdomain"] == svc["metadata"]["name"] == "train"
    labels = pod["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())


def test_selectors_match_their_pods_and_label_values_fit() -> None:
    for doc in manifests(spec_of(*VARIANTS["elastrun store, token, resources, Never"])):
        text = json.dumps(doc)
        assert all(len(v) <= 63 for v in _label_values(doc))
        if doc["kind"] == "Deployment":
            d = doc["spec"]
            assert d["selector"]["matchLabels"] == d["template"]["metadata"]["labels"]
        assert "namespace" in text


def _label_values(doc: object) -> list[str]:
    found: list[str] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key in ("labels", "matchLabels", "selector") and isinstance(value, dict):
                found += [str(v) for v in value.values() if not isinstance(v, dict)]
            found += _label_values(value)
    elif isinstance(doc, list):
        for item in doc:
            found += _label_values(item)
    return found


def test_a_pod_failure_policy_only_with_restart_policy_never() -> None:
    # Kubernetes refuses podFailurePolicy unless the pods' restartPolicy is Never.
    on_failure = manifests(spec_of())[-1]["spec"]
    never = manifests(spec_of("--restart-policy", "Never"))[-1]["spec"]
    assert "podFailurePolicy" not in on_failure
    assert on_failure["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert never["template"]["spec"]["restartPolicy"] == "Never"
    rules = never["podFailurePolicy"]["rules"]
    by_code = {
        code: rule["action"] for rule in rules if "onExitCodes" in rule
        for code in rule["onExitCodes"]["values"]
    }  # fmt: skip
    # Bad configuration and do-not-requeue fail the Job; a node to replace is not the
    # job's failure; everything else (1: a worker failure) counts against the backoff.
    assert by_code == {2: "FailJob", 93: "FailJob", 75: "Ignore"}
    assert all(r["onExitCodes"]["containerName"] == "trainer" for r in rules if "onExitCodes" in r)
    assert {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    } in rules


def test_the_worker_command_is_an_elastrun_launch_that_parses(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    spec = spec_of(*VARIANTS["elastrun store, token, resources, Never"])
    args = agent_args(spec)
    # Kubernetes expands $(VAR) from the container's environment.
    args = [a.replace("$(POD_IP)", "10.1.2.3").replace("$(ELASTRUN_RUN_ID)", "uid-1") for a in args]
    args[args.index("train.py")] = str(script)
    # The token file is read before anything starts: stand in for the mounted Secret.
    token = tmp_path / "token"
    token.write_text("secret\n")
    args = [a.replace("/etc/elastrun/token/token", str(token)) for a in args]
    launch = parse_launch(args, {"PATH": "/usr/bin"})
    cfg = launch.config
    assert (cfg.min_nodes, cfg.max_nodes) == (2, 4)
    assert cfg.rdzv_backend == "c10d"
    assert cfg.rdzv_endpoint == "train-store:29400"
    assert cfg.run_id == "uid-1"
    assert cfg.local_addr == "10.1.2.3"
    assert cfg.max_restarts == 3
    assert cfg.rdzv_configs["is_host"] == "false"
    assert cfg.rdzv_configs["token_file"] == str(token)
    assert cfg.rdzv_configs["join_timeout"] == "900"
    assert launch.script_args == ("--epochs", "10")


def test_the_store_pod_runs_elastrun_store_on_the_service_port() -> None:
    service, deployment = manifests(spec_of("--store-port", "29555", "--token-secret", "t"))[:2]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["elastrun", "store"]
    assert container["command"][container["command"].index("--port") + 1] == "29555"
    assert "--token-file" in container["command"]
    assert service["spec"]["ports"][0]["port"] == 29555


def test_etcd_workers_point_at_the_etcd_cluster() -> None:
    args = agent_args(spec_of(*VARIANTS["etcd"]))
    assert args[args.index("--rdzv-backend") + 1] == "etcd"
    assert args[args.index("--rdzv-endpoint") + 1] == "etcd-0.etcd:2379,etcd-1.etcd:2379"
    assert "--rdzv-conf" not in args  # no is_host: nobody serves an etcd


def test_resources_become_requests_and_limits() -> None:
    job = manifests(spec_of("--cpu", "500m", "--memory", "2Gi", "--gpus", "1"))[-1]
    res = job["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res == {
        "requests": {"cpu": "500m", "memory": "2Gi"},
        "limits": {"cpu": "500m", "memory": "2Gi", "nvidia.com/gpu": 1},
    }


# --- the YAML writer --------------------------------------------------------------------


def test_the_yaml_reads_back_as_the_same_documents() -> None:
    docs = build_manifests(spec_of(*VARIANTS["elastrun store, token, resources, Never"]))
    assert list(yaml.safe_load_all(dump_yaml(docs))) == docs


@pytest.mark.parametrize(
    "tricky", ["on", "No", "null", "1e3", "0755", "12:30", "- x", "#x", "a: b", "", " x", "$(X)",
               "it's", 'say "hi"', "ünïcode", "tab\there", "line\nbreak", "trailing\n", "~",
               "*ref", "&a"]
)  # fmt: skip
def test_strings_that_yaml_could_misread_stay_strings(tricky: str) -> None:
    doc: Doc = {"k": tricky, "l": [tricky], tricky or "empty": 1}
    assert list(yaml.safe_load_all(dump_yaml([doc]))) == [doc]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _json, max_size=5))
def test_any_json_document_round_trips(doc: Doc) -> None:
    assert list(yaml.safe_load_all(dump_yaml([doc]))) == [doc]


# --- the command line -------------------------------------------------------------------


def test_the_command_writes_yaml_to_a_file(tmp_path: Path) -> None:
    out = tmp_path / "job.yaml"
    assert k8s_main(["manifest", *BASE, "-o", str(out), *COMMAND]) == 0
    assert _kinds(list(yaml.safe_load_all(out.read_text()))) == [
        "Service", "Deployment", "Service", "Job"
    ]  # fmt: skip


def test_the_command_writes_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert k8s_main(["manifest", *BASE, *COMMAND]) == 0
    assert "kind: Job" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([*BASE], "after --"),
        ([*BASE, "--"], "empty"),
        (["--name", "Train_1", "--image", "i", "--nnodes", "2", *COMMAND], "--name"),
        (["--name", "x" * 60, "--image", "i", "--nnodes", "2", *COMMAND], "too long"),
        (["--image", "i", "--nnodes", "2", *COMMAND], "--name"),
        ([*BASE[:4], "--nnodes", "4:2", *COMMAND], "--nnodes"),
        ([*BASE, "--store", "etcd", *COMMAND], "--etcd-endpoint"),
        ([*BASE, "--etcd-endpoint", "e:2379", *COMMAND], "only used with --store etcd"),
        ([*BASE, "--cpu", "lots", *COMMAND], "--cpu"),
        ([*BASE, "--nproc-per-node", "0", *COMMAND], "--nproc-per-node"),
        ([*BASE, "--restart-policy", "Always", *COMMAND], "Always"),
        ([*BASE, "--env", "NOVALUE", *COMMAND], "--env"),
        ([*BASE, "--store", "etcd", "--etcd-endpoint", "e:1", "--token-secret", "s", *COMMAND],
         "--token-secret"),
    ],
)  # fmt: skip
def test_bad_options_exit_2_with_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert k8s_main(["manifest", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_an_unknown_subcommand_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert k8s_main(["deploy"]) == 2
    assert "unknown subcommand" in capsys.readouterr().err


def test_parse_errors_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        parse_manifest_args(["--name", "a", *COMMAND])


# --- Kubeflow PyTorchJob ------------------------------------------------------------------

# Exactly what the Kubeflow training operator (v1, PyTorchJob with an elasticPolicy of
# minReplicas 1, maxReplicas 3, maxRestarts 3, nProcPerNode 2, rdzvId and rdzvConf set)
# puts into each worker container for torchrun; the rendezvous host is the first
# worker's Service and the port the container port named pytorchjob-port (23456).
KUBEFLOW_ELASTIC_ENV = {
    "PYTHONUNBUFFERED": "0",
    "PET_RDZV_ENDPOINT": "elastic-job-worker-0:23456",
    "PET_RDZV_BACKEND": "c10d",
    "PET_NNODES": "1:3",
    "PET_MAX_RESTARTS": "3",
    "PET_NPROC_PER_NODE": "2",
    "PET_RDZV_ID": "elastic-job",
    "PET_RDZV_CONF": "join_timeout=600,last_call_timeout=10",
}


def test_kubeflow_elastic_variables_configure_the_launch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    launch = parse_launch([str(script), "--epochs", "2"], KUBEFLOW_ELASTIC_ENV)
    cfg = launch.config
    assert (cfg.min_nodes, cfg.max_nodes) == (1, 3)
    assert cfg.nproc_per_node == 2
    assert cfg.rdzv_backend == "c10d"
    assert cfg.rdzv_endpoint == "elastic-job-worker-0:23456"
    assert cfg.run_id == "elastic-job"
    assert cfg.max_restarts == 3
    assert cfg.rdzv_configs["join_timeout"] == "600"
    assert cfg.rdzv_configs["last_call_timeout"] == "10"
    assert not launch.standalone
    assert launch.script_args == ("--epochs", "2")


def test_kubeflow_without_rdzv_id_uses_torchruns_default_run_id(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    env = {k: v for k, v in KUBEFLOW_ELASTIC_ENV.items() if k not in ("PET_RDZV_ID",)}
    assert parse_launch([str(script)], env).config.run_id == "none"


def test_kubeflow_standalone_sets_an_empty_variable_which_counts_as_unset(tmp_path: Path) -> None:
    # The operator writes PET_STANDALONE="" for `standalone: true`; torchrun's
    # bool(int("")) fails on it. elastrun treats an empty PET_* as unset.
    script = tmp_path / "train.py"
    script.write_text("")
    launch = parse_launch([str(script)], {**KUBEFLOW_ELASTIC_ENV, "PET_STANDALONE": ""})
    assert not launch.standalone
    assert launch.config.rdzv_endpoint == "elastic-job-worker-0:23456"


def test_an_explicit_option_beats_the_operators_variable(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    launch = parse_launch(["--max-restarts", "7", str(script)], KUBEFLOW_ELASTIC_ENV)
    assert launch.config.max_restarts == 7


# A non-elastic PyTorchJob (one Master, workers): the master variables and a node rank.
KUBEFLOW_MASTER_WORKER_ENV = {
    "PYTHONUNBUFFERED": "0",
    "MASTER_PORT": "23456",
    "PET_MASTER_PORT": "23456",
    "MASTER_ADDR": "job-master-0",
    "PET_MASTER_ADDR": "job-master-0",
    "WORLD_SIZE": "3",
    "RANK": "2",
    "PET_NPROC_PER_NODE": "1",
    "PET_NODE_RANK": "2",
    "PET_NNODES": "3",
}


def test_kubeflow_master_and_workers_use_the_static_backend(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = parse_launch([str(script)], KUBEFLOW_MASTER_WORKER_ENV).config
    assert cfg.rdzv_backend == "static"
    assert cfg.rdzv_endpoint == "job-master-0:23456"
    assert (cfg.min_nodes, cfg.max_nodes) == (3, 3)
    assert cfg.node_rank == 2
    assert cfg.rdzv_configs["rank"] == "2"
