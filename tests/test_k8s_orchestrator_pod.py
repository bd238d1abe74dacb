"""The drafter step's pod on Kubernetes, streaming or not, as dagster-k8s's k8s executor builds it, offline.

A streaming run whose sides are Jobs (`streaming_sides: kubernetes`) only orchestrates in its drafter step, so the job
`eagle3_drafter_streaming` gives that step a CPU pod: its run config (a ConfigMapping over the drafter's config) sets
the executor's `per_step_k8s_config` for `eagle3_drafter` to `orchestrator_pod_config()`, a SHALLOW override that
dagster-k8s merges last, over the drafter's GPU-node tag. Here the run config is resolved by Dagster, the executor is
created by dagster-k8s's own `k8s_job_executor` from it (with a K8sRunLauncher on the instance, as in the chart), and
the step's container context is merged by that executor's step handler (`K8sStepHandler._get_container_context`: the
run's code-location context, the executor's, the step's tag, the per-step override, in its order) for the real
execution plan's drafter step; the Job is built by `construct_dagster_k8s_job` and read back by the Kubernetes
client's models. Not here, for want of a cluster: the scheduler placing the pod."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import dagster as dg
import kubernetes.client as k8s
import pytest
from dagster._core.definitions.job_base import InMemoryJob
from dagster._core.execution.api import create_execution_plan
from dagster._core.executor.init import InitExecutorContext
from dagster._core.executor.step_delegating import StepDelegatingExecutor
from dagster._core.origin import JobPythonOrigin
from dagster._core.storage.dagster_run import DagsterRun
from dagster._core.system_config.objects import ResolvedRunConfig
from dagster_k8s import k8s_job_executor
from dagster_k8s.executor import K8sStepHandler
from test_k8s_deploy import DEPLOYMENT, pod_rules_hold, round_trip, step_worker_job
from test_k8s_streaming import CHART_LAUNCHER, code_origin, unused_kubeconfig

from eagle3_assets import definitions
from eagle3_assets.operations.jobs import drafter_streaming_job, eagle3_pipeline
from eagle3_assets.stages.eagle3_drafter.streaming_k8s import requested_gpus
from eagle3_assets.stages.pipeline import PIPELINE_ASSETS

DRAFTER = "eagle3_drafter"
CODE_IMAGE = "registry.example.com/eagle3-pipeline:cpu-0000000"
STREAMING = {"streaming_spool_gb": 2000, "processes": 8, "streaming_nodes": 2}  # the user's config of the job
DATA_ROOT = {e["name"]: e["value"] for e in DEPLOYMENT["env"]}["EAGLE3_DATA_DIR"]


@pytest.fixture
def instance(tmp_path):
    """An instance whose run launcher is the chart's K8sRunLauncher, its credentials from a kubeconfig no call uses."""
    launcher = {
        "module": "dagster_k8s",
        "class": "K8sRunLauncher",
        "config": {**CHART_LAUNCHER, "kubeconfig_file": str(unused_kubeconfig(tmp_path))},
    }
    with dg.instance_for_test(overrides={"run_launcher": launcher}) as instance:
        yield instance


def k8s_defs() -> dg.Definitions:
    """The code location as EAGLE3_EXECUTOR=k8s builds it: dagster-k8s's k8s_job_executor for every job."""
    return dg.Definitions(
        assets=PIPELINE_ASSETS,
        jobs=[eagle3_pipeline, drafter_streaming_job(on_kubernetes=True)],
        resources=definitions.resources(),
        executor=k8s_job_executor,
    )


def drafter_step_job(instance: dg.DagsterInstance, job_name: str, run_config: dict) -> tuple[dict, k8s.V1Job]:
    """The drafter step's Job as the k8s executor of a run of `job_name` with `run_config` would create it."""
    job_def = k8s_defs().resolve_job_def(job_name)
    resolved = ResolvedRunConfig.build(job_def, run_config)
    create = k8s_job_executor.executor_creation_fn
    assert create is not None
    executor = create(
        InitExecutorContext(
            job=InMemoryJob(job_def),
            executor_def=k8s_job_executor,
            executor_config=resolved.execution.execution_engine_config,
            instance=instance,
        )
    )
    assert isinstance(executor, StepDelegatingExecutor)
    handler = executor._step_handler  # the K8sStepHandler dagster-k8s made from the run's executor config
    assert isinstance(handler, K8sStepHandler)
    step = create_execution_plan(job_def, run_config).get_step_by_key(DRAFTER)
    origin = code_origin(CODE_IMAGE)
    run = DagsterRun(job_name=job_name, run_config=run_config, job_code_origin=JobPythonOrigin(job_name, origin))
    step_handler_context = SimpleNamespace(  # what K8sStepHandler reads of a StepHandlerContext
        execute_step_args=SimpleNamespace(step_keys_to_execute=[step.key]),
        dagster_run=run,
        instance=instance,
        step_tags={step.key: step.tags},
        get_step_context=lambda key: SimpleNamespace(step=step),
    )
    context = handler._get_container_context(step_handler_context)  # type: ignore[arg-type]  # duck: what it reads
    job_config = context.get_k8s_job_config(None, instance.run_launcher).with_image(CODE_IMAGE)
    return round_trip(step_worker_job(job_config, context, run.run_id, job_name, step.key))


def gpu_free(data: dict) -> bool:
    """No GPU anywhere in the pod but the shared env (which names the GPU steps' settings for every pod)."""
    pod = data["spec"]["template"]["spec"]
    bare = {**pod, "containers": [{k: v for k, v in c.items() if k != "env"} for c in pod["containers"]]}
    return "nvidia.com/gpu" not in json.dumps(bare)


def mounted_claims(spec: k8s.V1PodSpec) -> dict[str, str]:
    """Mount path -> the claim of its volume."""
    volumes = {v.name: v for v in spec.volumes}
    [container] = spec.containers
    return {
        m.mount_path: volumes[m.name].persistent_volume_claim.claim_name
        for m in container.volume_mounts
        if volumes[m.name].persistent_volume_claim
    }


def test_a_streaming_run_on_kubernetes_orchestrates_in_a_cpu_pod(instance):
    data, job = drafter_step_job(instance, "eagle3_drafter_streaming", STREAMING)
    spec = job.spec.template.spec
    [container] = spec.containers
    assert gpu_free(data)
    assert container.resources.requests == {"cpu": "4", "memory": "64Gi"}
    assert container.resources.limits == {"memory": "64Gi"}  # no CPU limit, no GPU
    assert not spec.node_selector and not spec.tolerations  # any node, no GPU taint tolerated
    # The spool, the specs and the merged set on the data volume; the target's config and tokenizer under /models.
    claims = mounted_claims(spec)
    assert claims[DATA_ROOT] == "eagle3-data" and claims["/models"] == "eagle3-models"
    assert Path(DATA_ROOT, "eagle3_drafter.streaming").is_relative_to(DATA_ROOT)
    env = {e.name: e.value for e in container.env}
    assert env["EAGLE3_DATA_DIR"] == DATA_ROOT and env["DAGSTER_HOME"] == "/opt/dagster/dagster_home"
    assert container.image == CODE_IMAGE
    pod_rules_hold(spec)


def test_a_run_that_does_not_stream_keeps_the_gpu_node(instance):
    """The pipeline's drafter step, offline (its default): the drafter's tag alone, a whole GPU node."""
    _, job = drafter_step_job(instance, "eagle3_pipeline", {"ops": {DRAFTER: {"config": {"processes": 8}}}})
    spec = job.spec.template.spec
    [container] = spec.containers
    assert container.resources.requests["nvidia.com/gpu"] == container.resources.limits["nvidia.com/gpu"] == "8"
    assert container.resources.requests == container.resources.limits  # Guaranteed: the node's cores and memory
    assert spec.node_selector == {"nvidia.com/gpu.count": "8"}
    assert [(t.key, t.operator, t.effect) for t in spec.tolerations] == [("nvidia.com/gpu", "Exists", "NoSchedule")]
    claims = mounted_claims(spec)
    assert claims[DATA_ROOT] == "eagle3-data" and claims["/models"] == "eagle3-models"
    pod_rules_hold(spec)


def test_the_step_says_when_its_pod_holds_gpus_it_does_not_use(instance):
    """What the orchestrating step reads of its own pod (streaming_k8s.requested_gpus) to warn: 8 on the pipeline's
    GPU node, none in the streaming job's pod."""
    pipeline = drafter_step_job(instance, "eagle3_pipeline", {})[1]
    streaming = drafter_step_job(instance, "eagle3_drafter_streaming", STREAMING)[1]
    assert requested_gpus(k8s.V1Pod(spec=pipeline.spec.template.spec)) == 8
    assert requested_gpus(k8s.V1Pod(spec=streaming.spec.template.spec)) == 0


def test_the_orchestrator_pod_follows_the_environment(instance, monkeypatch):
    monkeypatch.setenv("EAGLE3_K8S_ORCHESTRATOR_CPU", "1")
    monkeypatch.setenv("EAGLE3_K8S_ORCHESTRATOR_MEMORY", "200Gi")
    [container] = drafter_step_job(instance, "eagle3_drafter_streaming", STREAMING)[1].spec.template.spec.containers
    assert container.resources.requests == {"cpu": "1", "memory": "200Gi"}
    assert container.resources.limits == {"memory": "200Gi"}


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"processes": 8}, 'Missing required config entry "streaming_spool_gb"'),
        ({**STREAMING, "streaming_sides": "local"}, "runs the sides as Kubernetes Jobs"),
    ],
)
def test_the_streaming_job_refuses_a_run_that_would_not_stream_on_kubernetes(config, refusal):
    """Offline training or local sides in a CPU pod would be a run in the wrong pod: refused at launch."""
    job_def = k8s_defs().resolve_job_def("eagle3_drafter_streaming")
    with pytest.raises((dg.DagsterInvalidConfigError, dg.DagsterConfigMappingFunctionError)) as caught:
        ResolvedRunConfig.build(job_def, config)
    assert refusal in str(caught.value) + str(caught.value.__cause__)


def test_the_job_passes_the_drafter_config_through_and_is_in_the_code_location():
    job_def = k8s_defs().resolve_job_def("eagle3_drafter_streaming")
    drafter = ResolvedRunConfig.build(job_def, {**STREAMING, "lr": 5e-5}).ops[DRAFTER].config
    assert isinstance(drafter, dict)
    assert drafter["streaming_spool_gb"] == 2000 and drafter["streaming_nodes"] == 2 and drafter["lr"] == 5e-5
    assert drafter["streaming_sides"] == "kubernetes" and drafter["spec_eval_prompts"] == 0  # no decoding on a CPU
    assert definitions.defs.resolve_job_def("eagle3_drafter_streaming").asset_layer.executable_asset_keys == {
        dg.AssetKey(DRAFTER)
    }


def test_both_drafter_step_jobs_pass_the_official_kubernetes_schemas(instance):
    """An empty `nodeSelector` and `tolerations` list included: strict (no unknown field), oldest and newest version."""
    validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (the Kubernetes API's JSON schemas, offline)"
    )
    for job_name, config in (("eagle3_drafter_streaming", STREAMING), ("eagle3_pipeline", {})):
        data, _ = drafter_step_job(instance, job_name, config)
        for version in ("1.25.0", "1.37.0"):
            try:
                validate.validate(data, version, strict=True)
            except validate.ValidationError as error:
                raise AssertionError(f"{job_name} at Kubernetes {version}: {error}") from error
