"""The streaming drafter's sides on Kubernetes, offline (as tests/test_k8s_deploy.py): the capture Job, the training
Indexed Job and its headless Service built by streaming_k8s.py with dagster-k8s over the code location's container
context, read back by the Kubernetes client's models; each training pod's torchrun command read by torch's own
launcher after Kubernetes' `$(VAR)` expansion for that pod; the RBAC manifest against the launcher's API calls.

Not here, for want of a cluster: `KubernetesSides`' and `JobSide`'s API calls themselves (create, status, delete,
logs), the pod lookup (`step_pod`), and DNS and NCCL between real pods."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes.client as k8s
import pytest
import yaml
from dagster._core.code_pointer import ModuleCodePointer
from dagster._core.origin import RepositoryPythonOrigin
from dagster_k8s.job import DagsterK8sJobConfig, OwnerReference
from test_k8s_deploy import API, DEPLOYMENT, IMAGE, REPO, deployment_context, pod_rules_hold, round_trip
from torch.distributed.run import config_from_args, get_args_parser

from eagle3_assets.stages.eagle3_drafter import streaming_k8s
from eagle3_assets.stages.eagle3_drafter.streaming_k8s import (
    CAPTURE,
    TRAINING,
    SidePods,
    capture_job,
    service_name,
    side_job_name,
    training_job,
    training_service,
)
from eagle3_assets.stages.eagle3_drafter.streaming_sides import CAPTURE_MODULE, TRAINING_MODULE

RUN_KEY = "0123abcd-4567-89ef-0123-456789abcdef-0"
SPEC = Path("/data/eagle3/drafters/x.streaming/training.spec.json")
OWNER = OwnerReference(kind="Pod", name="dagster-step-5f0e1d2c3b4a-7xk2p", uid="6f1c2a34-1b2c-4d5e-8f90-123456789abc")
RBAC = REPO / "deploy" / "streaming-rbac.yaml"
DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # a Service's name
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def side_pods(run_key: str = RUN_KEY, owner: OwnerReference | None = OWNER) -> SidePods:
    """The step pods' container context and job config, as test_k8s_deploy builds a step's Job from them."""
    job_config = DagsterK8sJobConfig(
        job_image=IMAGE,
        dagster_home="/opt/dagster/dagster_home",
        instance_config_map="eagle3-dagster-instance",
        postgres_password_secret="eagle3-postgresql",
    )
    return SidePods(run_key=run_key, context=deployment_context(), job_config=job_config, owner=owner)


def service_round_trip(service: k8s.V1Service) -> tuple[dict, k8s.V1Service]:
    data = API.sanitize_for_serialization(service)
    return data, API.deserialize(SimpleNamespace(data=json.dumps(data)), "V1Service")


def sides(nodes: int, pods: SidePods | None = None) -> dict[str, tuple[dict, k8s.V1Job | k8s.V1Service]]:
    """The three objects of one run, each as the API server would receive it and as the models read it back."""
    pods = pods or side_pods()
    capture = side_job_name(pods.run_key, CAPTURE, 0)
    training = side_job_name(pods.run_key, TRAINING, 0)
    return {
        "capture": round_trip(capture_job(pods, capture, SPEC.with_name("capture.spec.json"), gpus=8)),
        "training": round_trip(training_job(pods, training, SPEC, nodes=nodes, processes_per_node=8)),
        "service": service_round_trip(training_service(pods, training)),
    }


def pod_env(container: k8s.V1Container, index: int) -> dict[str, str]:
    """The container's env as the kubelet gives it to pod `index` of an Indexed Job: plain values, and the downward
    API's completion-index annotation, which the Job controller sets on each pod."""
    env = {}
    for var in container.env:
        if var.value is not None:
            env[var.name] = var.value
        elif var.value_from.field_ref and var.value_from.field_ref.field_path == (
            f"metadata.annotations['{COMPLETION_INDEX}']"
        ):
            env[var.name] = str(index)
    return env


def expanded(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' expansion of `$(VAR)` in a container's args; a reference to an undefined variable stays as is."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


# --- the objects ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [1, 4])
def test_side_objects_survive_the_kubernetes_models_whole(nodes):
    for key, (data, back) in sides(nodes).items():
        assert API.sanitize_for_serialization(back) == data, f"{key}: a field the models do not know was dropped"
        assert back.metadata.owner_references[0].uid == OWNER.uid, key
    for key in ("capture", "training"):
        job = sides(nodes)[key][1]
        assert job.kind == "Job" and job.api_version == "batch/v1"
        assert job.spec.backoff_limit == 0  # the orchestrator decides about restarts
        spec = job.spec.template.spec
        assert spec.restart_policy == "Never"
        assert spec.automount_service_account_token is False  # the sides never call the Kubernetes API
        [container] = spec.containers
        assert container.image == IMAGE
        pod_rules_hold(spec)


def test_side_objects_pass_the_official_kubernetes_schemas():
    """The JSON schemas of the Kubernetes API (kubernetes-validate bundles them: offline), strict (no unknown field),
    at the oldest and the newest version it has."""
    validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (the Kubernetes API's JSON schemas, offline)"
    )
    for version in ("1.25.0", "1.37.0"):
        for nodes in (1, 4):
            for key, (data, _) in sides(nodes).items():
                try:
                    validate.validate(data, version, strict=True)
                except validate.ValidationError as error:
                    raise AssertionError(f"{key} ({nodes} nodes) at Kubernetes {version}: {error}") from error


def test_the_capture_pod_takes_a_whole_gpu_node_with_the_data_and_the_model(monkeypatch):
    monkeypatch.setenv("EAGLE3_K8S_GPU_IMAGE", "registry.example.com/eagle3-pipeline:cuda-test")
    pods = side_pods()
    name = side_job_name(RUN_KEY, CAPTURE, 0)
    _, job = round_trip(capture_job(pods, name, SPEC.with_name("capture.spec.json"), gpus=4))
    assert job.spec.completion_mode is None and job.spec.completions is None  # one pod
    spec = job.spec.template.spec
    [container] = spec.containers
    assert container.args == ["python", "-m", CAPTURE_MODULE, "/data/eagle3/drafters/x.streaming/capture.spec.json"]
    assert container.image == "registry.example.com/eagle3-pipeline:cuda-test"
    requests, limits = container.resources.requests, container.resources.limits
    assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"] == "4"  # the tensor-parallel size
    assert requests == limits and requests["cpu"] == "64" and requests["memory"] == "512Gi"
    assert spec.node_selector == {"nvidia.com/gpu.count": "4"}
    assert [(t.key, t.operator) for t in spec.tolerations] == [("nvidia.com/gpu", "Exists")]
    mounts = {m.mount_path: m for m in container.volume_mounts}
    volumes = {v.name: v for v in spec.volumes}
    data_root = {e["name"]: e["value"] for e in DEPLOYMENT["env"]}["EAGLE3_DATA_DIR"]
    assert volumes[mounts[data_root].name].persistent_volume_claim.claim_name == "eagle3-data"
    assert SPEC.is_relative_to(data_root)  # the spec and the spool on the volume every side mounts
    assert volumes[mounts["/models"].name].persistent_volume_claim.claim_name == "eagle3-models"
    assert volumes[mounts["/dev/shm"].name].empty_dir.medium == "Memory"
    secrets = {source.secret_ref.name for source in container.env_from if source.secret_ref}
    assert {"eagle3-openrouter", "eagle3-ledger"} <= secrets  # the code location's, as on the step pods
    assert job.metadata.labels[streaming_k8s.SIDE_LABEL] == CAPTURE
    assert job.metadata.labels[streaming_k8s.RUN_LABEL] == RUN_KEY


@pytest.mark.parametrize("nodes", [1, 4])
def test_every_training_pod_runs_torchrun_as_its_node_rank(nodes, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # else torch's config_from_args sets it in this process
    objects = sides(nodes)
    job, service = objects["training"][1], objects["service"][1]
    assert job.spec.completion_mode == "Indexed"
    assert job.spec.completions == job.spec.parallelism == nodes  # all nodes at once, one pod per node rank
    spec = job.spec.template.spec
    assert spec.subdomain == service.metadata.name
    [container] = spec.containers
    assert container.resources.limits["nvidia.com/gpu"] == "8"
    data_root = {e["name"]: e["value"] for e in DEPLOYMENT["env"]}["EAGLE3_DATA_DIR"]
    assert data_root in {m.mount_path for m in container.volume_mounts}
    assert container.args[:3] == ["python", "-m", "torch.distributed.run"]
    ranks = []
    for index in range(nodes):
        args = expanded(container.args[3:], pod_env(container, index))
        parsed = get_args_parser().parse_args(args)
        config, command, command_args = config_from_args(parsed)
        assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (nodes, nodes, 8)
        assert config.rdzv_backend == "static" and config.max_restarts == 0
        # each rank: this image's python, `-m <TRAINING_MODULE> SPEC`
        assert command == sys.executable and command_args[-3:] == ["-m", TRAINING_MODULE, str(SPEC)]
        # Node rank 0 hosts the store; an Indexed Job's pod i is `<job>-<i>`, resolvable under its subdomain.
        host, port = config.rdzv_endpoint.rsplit(":", 1)
        assert host == f"{job.metadata.name}-0.{spec.subdomain}" and int(port) == 29500
        ranks.append(config.rdzv_configs["rank"])
    assert ranks == list(range(nodes))


def test_the_service_selects_exactly_the_training_pods():
    objects = sides(4)
    service = objects["service"][1]
    assert service.spec.cluster_ip == "None"  # headless: one DNS record per pod
    assert service.spec.publish_not_ready_addresses  # a pod resolves as soon as it has an address
    selector = service.spec.selector

    def selected(job: k8s.V1Job) -> bool:
        labels = job.spec.template.metadata.labels
        return all(labels.get(key) == value for key, value in selector.items())

    assert selector and selected(objects["training"][1])
    assert not selected(objects["capture"][1])
    pods = side_pods()
    restarted = training_job(pods, side_job_name(RUN_KEY, TRAINING, 1), SPEC, nodes=4, processes_per_node=8)
    other_run = side_pods("fedcba98-0000-0")
    elsewhere = training_job(other_run, side_job_name(other_run.run_key, TRAINING, 0), SPEC, 4, 8)
    assert not selected(restarted) and not selected(elsewhere)


def test_names_are_short_dns_labels_one_per_run_side_and_attempt():
    long_key = "Backfill_" + "x" * 200 + "-01234567-89ab-cdef-0123-456789abcdef-3"
    retried = RUN_KEY[:-1] + "1"  # the same run's step retried: the same first 8 characters
    names = {(key, side, attempt): side_job_name(key, side, attempt) for key in (RUN_KEY, retried, long_key)
             for side in (CAPTURE, TRAINING) for attempt in (0, 1, 99)}  # fmt: skip
    assert len(set(names.values())) == len(names)
    for (key, side, attempt), name in names.items():
        assert side_job_name(key, side, attempt) == name  # deterministic
        assert DNS_1123_LABEL.fullmatch(name) and DNS_1035_LABEL.fullmatch(service_name(name))
        assert len(f"{name}-{999}") <= 63 and len(service_name(name)) <= 63  # pod hostnames, the Service
    pods = side_pods(long_key)
    objects = sides(4, pods)
    for key, (_, back) in objects.items():
        assert len(back.metadata.name) <= 63, key
        labels = back.metadata.labels
        assert all(len(v) <= 63 for v in labels.values()), labels
    with pytest.raises(ValueError, match="a side is"):
        side_job_name(RUN_KEY, "eval", 0)


def test_without_an_owner_the_sides_have_no_owner_references():
    for key, (data, _) in sides(2, side_pods(owner=None)).items():
        assert "ownerReferences" not in data["metadata"], key


def test_the_environment_knobs_reach_the_side_pods(monkeypatch):
    monkeypatch.setenv("EAGLE3_K8S_RDZV_PORT", "29600")
    monkeypatch.setenv("EAGLE3_K8S_RDZV_TIMEOUT_S", "3600")
    monkeypatch.setenv("EAGLE3_K8S_SIDE_GRACE_S", "300")
    objects = sides(2)
    job, service = objects["training"][1], objects["service"][1]
    args = job.spec.template.spec.containers[0].args
    assert f"--rdzv-endpoint={job.metadata.name}-0.{service.metadata.name}:29600" in args
    assert "--rdzv-conf=timeout=3600" in args
    assert [p.port for p in service.spec.ports] == [29600]
    for key in ("capture", "training"):
        assert objects[key][1].spec.template.spec.termination_grace_period_seconds == 300


# --- RBAC -------------------------------------------------------------------------------------------------------

VERBS = {"create": "create", "read": "get", "list": "list", "delete": "delete", "patch": "patch", "replace": "update"}
GROUPS = {"batch": "batch", "core": ""}  # the launcher's BatchV1Api and CoreV1Api attributes


def launcher_calls() -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every Kubernetes client call in streaming_k8s.py: `<api>.<verb>_namespaced_
    <kind>[_<subresource>]` on its `batch` or `core` API object, as the client names its methods."""
    tree = ast.parse(Path(streaming_k8s.__file__).read_text())
    calls = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = node.func.value
        api = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", None)
        found = re.fullmatch(
            r"(create|read|list|delete_collection|delete|patch|replace)_namespaced_(\w+)", node.func.attr
        )
        if api in GROUPS and found:
            verb = "deletecollection" if found[1] == "delete_collection" else VERBS[found[1]]
            kind, _, sub = found[2].partition("_")
            calls.add((GROUPS[api], f"{kind}s" + (f"/{sub}" if sub else ""), verb))
    return calls


def test_the_role_grants_every_call_the_launcher_makes():
    role, binding = yaml.safe_load_all(RBAC.read_text())
    for item, kind in ((role, "V1Role"), (binding, "V1RoleBinding")):
        back = API.deserialize(SimpleNamespace(data=json.dumps(item)), kind)
        assert API.sanitize_for_serialization(back) == item, kind
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    calls = launcher_calls()
    assert ("", "services", "create") in calls and ("", "pods/log", "get") in calls  # the parse finds them
    assert calls <= granted, sorted(calls - granted)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    # The chart's user-deployments service account, `<release>-dagster-user-deployments-user-deployments`
    # (its helper dagsterUserDeployments.serviceAccountName), for the release the values' install command names.
    [release] = re.findall(
        r"helm upgrade --install (\S+) dagster/dagster", (REPO / "deploy/helm/values.yaml").read_text()
    )
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{release}-dagster-user-deployments-user-deployments"}
    ]


def test_the_rbac_manifest_passes_yamllint():
    yamllint = shutil.which("yamllint") or shutil.which("yamllint", path=str(Path(sys.executable).parent))
    assert yamllint, "yamllint comes with the test extras: pip install -e '.[test]'"
    config = "{extends: default, rules: {line-length: {max: 120}}}"
    result = subprocess.run(
        [yamllint, "--strict", "-f", "parsable", "-d", config, str(RBAC)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- in the running system: the context from the run, as the step handler gets it --------------------------------

RELEASE_SA = "eagle3-dagster-user-deployments-user-deployments"


# The chart's K8sRunLauncher settings (its instance config map), less the credentials.
CHART_LAUNCHER: dict[str, Any] = {
    "service_account_name": "eagle3-dagster",
    "instance_config_map": "eagle3-dagster-instance",
    "postgres_password_secret": "eagle3-postgresql",
    "dagster_home": "/opt/dagster/dagster_home",
    "load_incluster_config": False,
    "job_namespace": "eagle3",
}


def unused_kubeconfig(folder: Path) -> Path:
    """A kubeconfig naming a cluster no call reaches: a K8sRunLauncher's client is made from it, never used."""
    path = folder / "kubeconfig"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def code_origin(image: str) -> RepositoryPythonOrigin:
    """The code location's origin as a run records it: this project's definitions, in `image`, with the chart's
    container context."""
    return RepositoryPythonOrigin(
        executable_path=sys.executable,
        code_pointer=ModuleCodePointer("eagle3_assets.definitions", "defs", working_directory=None),
        container_image=image,
        container_context=chart_container_context(),
    )


def chart_container_context() -> dict:
    """The code location's container context as the chart's `dagsterUserDeployments.k8sContainerContext` helper
    renders it from the values (DAGSTER_CLI_API_GRPC_CONTAINER_CONTEXT; Dagster stores it in the run's origin)."""
    return {
        "k8s": {
            "image_pull_policy": DEPLOYMENT["image"]["pullPolicy"],
            "env_config_maps": ["eagle3-dagster-user-deployments-eagle3-user-env"],
            "env_secrets": [secret["name"] for secret in DEPLOYMENT["envSecrets"]],
            "volume_mounts": DEPLOYMENT["volumeMounts"],
            "volumes": DEPLOYMENT["volumes"],
            "resources": DEPLOYMENT["resources"],
            "namespace": "eagle3",
            "service_account_name": RELEASE_SA,
            "env": DEPLOYMENT["env"],
        }
    }


def test_in_a_run_the_sides_get_the_step_pods_context_from_the_run_and_its_launcher(tmp_path, monkeypatch):
    from dagster._core.origin import JobPythonOrigin
    from dagster._core.storage.dagster_run import DagsterRun
    from dagster_k8s.launcher import K8sRunLauncher

    monkeypatch.delenv("EAGLE3_K8S_GPU_IMAGE", raising=False)
    code_image = "registry.example.com/eagle3-pipeline:cpu-0000000"
    origin = code_origin(code_image)
    run = DagsterRun(job_name="eagle3_pipeline", job_code_origin=JobPythonOrigin("eagle3_pipeline", origin))
    # The chart's run launcher (the instance's config map), its credentials from a kubeconfig no call ever uses.
    launcher = K8sRunLauncher(
        **CHART_LAUNCHER, kubeconfig_file=str(unused_kubeconfig(tmp_path)), image_pull_policy="IfNotPresent"
    )
    pods = streaming_k8s.side_pods_for_run(run, launcher, f"{run.run_id}-0", OWNER)
    name = side_job_name(pods.run_key, CAPTURE, 0)
    data, job = round_trip(capture_job(pods, name, SPEC, gpus=8))
    spec = job.spec.template.spec
    [container] = spec.containers
    assert container.image == code_image  # the code location's, as the step handler falls back to
    assert container.image_pull_policy == "IfNotPresent"
    # The service account the RBAC manifest binds (the sides' pods carry no token of it, though).
    assert spec.service_account_name == RELEASE_SA
    [_, binding] = yaml.safe_load_all(RBAC.read_text())
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec.service_account_name}]
    data_root = {e["name"]: e["value"] for e in DEPLOYMENT["env"]}["EAGLE3_DATA_DIR"]
    mounts = {m.mount_path: m.name for m in container.volume_mounts}
    assert {v.name: v for v in spec.volumes}[mounts[data_root]].persistent_volume_claim.claim_name == "eagle3-data"
    env = {e.name: e.value for e in container.env}
    assert env["DAGSTER_HOME"] == "/opt/dagster/dagster_home" and env["EAGLE3_DATA_DIR"] == data_root
    sources = {(s.secret_ref or s.config_map_ref).name for s in container.env_from}
    assert {"eagle3-openrouter", "eagle3-ledger", "eagle3-dagster-user-deployments-eagle3-user-env"} <= sources
    pod_rules_hold(spec)
