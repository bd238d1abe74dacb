"""The sides of a streaming drafter run as Kubernetes Jobs (issue 27): `KubernetesSides`, and the pure builders of its
objects.

The orchestrating `eagle3_drafter` step pod (itself a dagster-k8s step Job) starts, through this launcher,

- the capture side: a Job of one pod on a whole GPU node (`gpu_node_config` with the SGLang tensor-parallel size as
  its GPUs) running `python -m <CAPTURE_MODULE> SPEC`;
- the training side: an Indexed Job (`completionMode: Indexed`, completions = parallelism = nodes) of GPU pods, pod i
  running `python -m torch.distributed.run --nnodes=N --nproc-per-node=P --node-rank=$(EAGLE3_NODE_RANK)
  --rdzv-backend=static --rdzv-endpoint=<job>-0.<service>:PORT ... -m <TRAINING_MODULE> SPEC`, and a headless
  Service (clusterIP None, selecting exactly that Job's pods, `publishNotReadyAddresses` so a pod's name resolves
  as soon as it has an address) that the pods take as their `subdomain`: an Indexed Job's pod i has the hostname
  `<job>-<i>`, so `<job>-0.<service>` is node rank 0, which hosts the rendezvous store.

Why the static rendezvous: with `c10d`, torchrun ignores `--node-rank` (it warns so) and numbers the nodes in the
order they join, and the store is hosted by whichever node guesses that the endpoint's name is its own
(`_matches_machine_hostname`). With `static`, node rank = the pod's completion index (`EAGLE3_NODE_RANK`, from the
pod annotation `batch.kubernetes.io/job-completion-index` through the downward API), so rank 0 is the pod the
endpoint names and hosts the store by construction; the elastic features c10d adds (joining late, restarting the
group) are not used: the node count is fixed and a failure fails the Job (`backoffLimit: 0`, `--max-restarts=0`),
after which the orchestrator decides, and a new Job resumes from the trainer's checkpoint and the spool.

Both Jobs are built by dagster-k8s's `construct_dagster_k8s_job` from the same container context as the step pods:
`K8sContainerContext.create_for_run(run, run_launcher, include_run_tags=False)`, which is what the k8s executor's
step handler merges first (the run launcher's settings, then the code location's container context that the Helm
chart's `includeConfigInLaunchedRuns` carries: env, secrets, the data volume, the service account, the namespace),
and then the side's own config over it, as a stage tag is merged. So the side pods mount the data volume, where the
spec files and the spool are, exactly as the step pods do, and run under the same service account. The k8s
executor's own run config (`per_step_k8s_config`, the executor's container context) is not visible from inside a
step, and the sides need none of it: the one thing this project sets there is the orchestrating step's own CPU pod
(`orchestrator_pod_config` in common/k8s.py, by the job `eagle3_drafter_streaming`), which no side should inherit.
A step that holds GPUs anyway (the drafter streaming from `eagle3_pipeline`, on its stage's GPU node) says so in its
log (`requested_gpus` of its pod).

Both Jobs and the Service are owned (`ownerReferences`) by the orchestrating step's pod, found as dagster-k8s finds
its run pod: the pod named by `HOSTNAME`, read through the API for its uid. Deleting the step pod (the step Job's
TTL, `kubectl delete`) makes Kubernetes' garbage collector delete the sides. Outside a pod (no `HOSTNAME`) there is
no owner: the sides then end by themselves once the orchestrator's heartbeat file stops changing, and their Jobs by
their TTL (dagster-k8s's default, a day: long enough to read a failed side's logs).

Names: `eagle3-<side>-<run id's first 8>-<digest>-<attempt>` (at most 40 characters, DNS-1123), the digest over the
run key (the Dagster run id and the step's retry number) and the side, the attempt counted by the launcher: a side
restarted by the orchestrator, a step retried or a resumed run all make new Jobs.

Settings (env of the Helm user deployment, as k8s.py's), beside k8s.py's `EAGLE3_K8S_*` which size the GPU pods:

    EAGLE3_K8S_RDZV_PORT       port of the training side's rendezvous store on node rank 0 (default 29500)
    EAGLE3_K8S_RDZV_TIMEOUT_S  seconds node rank 0 waits for the other nodes to join (default 1800: a GPU node
                               scaled up and a CUDA image pulled can take that long; torchrun's own default is 600)
    EAGLE3_K8S_SIDE_GRACE_S    terminationGracePeriodSeconds of the side pods, the most a `stop(grace_s)` can give
                               (default 120: a trainer writes its checkpoint to the shared volume on SIGTERM)

RBAC: the Dagster chart's user-deployments Role lets the step pods' service account create, read and delete Jobs
and read pods and their logs, but not Services; deploy/streaming-rbac.yaml grants what this module calls.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
from dagster_k8s.container_context import K8sContainerContext
from dagster_k8s.job import (
    DagsterK8sJobConfig,
    OwnerReference,
    UserDefinedDagsterK8sConfig,
    construct_dagster_k8s_job,
    sanitize_k8s_label,
)
from kubernetes.client.exceptions import ApiException

from eagle3_assets.common.k8s import GPU_RESOURCE, K8sConfig, gpu_node_config
from eagle3_assets.stages.eagle3_drafter.streaming_sides import CAPTURE_MODULE, TRAINING_MODULE, SidesLauncher

CAPTURE, TRAINING = "capture", "training"
RUN_LABEL = "eagle3/streaming-run"
SIDE_LABEL = "eagle3/streaming-side"
JOB_LABEL = "eagle3/streaming-job"  # the Service's selector: exactly one Job's pods
NODE_RANK_ENV = "EAGLE3_NODE_RANK"
COMPLETION_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
TAIL_LINES = 60
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def _int_setting(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


@dataclass(frozen=True)
class SidePods:
    """What every side's objects are built from: the run, the step pods' container context and job config, the owner."""

    run_key: str  # the Dagster run id and the step's retry number: `<run id>-<retry>`
    context: K8sContainerContext  # the code location's, as the step pods get it (create_for_run)
    job_config: DagsterK8sJobConfig  # image (the code location's; a GPU tag's EAGLE3_K8S_GPU_IMAGE wins), DAGSTER_HOME
    owner: OwnerReference | None = None  # the orchestrating step's pod
    rendezvous_port: int = field(default_factory=lambda: _int_setting("EAGLE3_K8S_RDZV_PORT", 29500))
    rendezvous_timeout_s: int = field(default_factory=lambda: _int_setting("EAGLE3_K8S_RDZV_TIMEOUT_S", 1800))
    grace_s: int = field(default_factory=lambda: _int_setting("EAGLE3_K8S_SIDE_GRACE_S", 120))


def side_job_name(run_key: str, side: str, attempt: int) -> str:
    """`eagle3-<side>-<run id's first 8>-<digest>-<attempt>`: deterministic, a DNS-1123 label of at most 40 characters
    (an Indexed Job's pod hostnames `<job>-<index>` and the Service `<job>-peers` stay within 63)."""
    if side not in (CAPTURE, TRAINING) or attempt < 0:
        raise ValueError(
            f"side {side!r}, attempt {attempt}: a side is {CAPTURE!r} or {TRAINING!r}, attempts count from 0"
        )
    stem = re.sub(r"[^a-z0-9]", "", run_key.lower())[:8] or "run"
    digest = hashlib.sha256(f"{run_key}\0{side}".encode()).hexdigest()[:8]
    return f"eagle3-{side}-{stem}-{digest}-{attempt}"


def service_name(job_name: str) -> str:
    """The training Job's headless Service, its pods' subdomain."""
    return f"{job_name}-peers"


def side_labels(pods: SidePods, side: str, job_name: str) -> dict[str, str]:
    return {RUN_LABEL: sanitize_k8s_label(pods.run_key), SIDE_LABEL: side, JOB_LABEL: job_name}


def _side_job(pods: SidePods, job_name: str, side: str, args: Sequence[str], config: K8sConfig) -> k8s.V1Job:
    """A side's Job: its config merged over the step pods' container context, as a stage tag is, then dagster-k8s's
    construct_dagster_k8s_job (labels on the Job and its pods; owned by the step pod when there is one)."""
    side_config = {
        **config,
        # the sides never call the API: no token, although their service account is the step pods' (which may)
        "pod_spec_config": {
            **config.get("pod_spec_config", {}),
            "terminationGracePeriodSeconds": pods.grace_s,
            "automountServiceAccountToken": False,
        },
        # backoffLimit 0: the orchestrator decides about restarts (a new Job resumes from the spool and checkpoint)
        "job_spec_config": {**config.get("job_spec_config", {}), "backoffLimit": 0},
    }
    context = pods.context.merge(K8sContainerContext(run_k8s_config=UserDefinedDagsterK8sConfig.from_dict(side_config)))
    return construct_dagster_k8s_job(
        job_config=pods.job_config,
        args=list(args),
        job_name=job_name,
        pod_name=job_name,
        component=f"streaming_{side}",
        user_defined_k8s_config=context.run_k8s_config,
        labels=side_labels(pods, side, job_name),
        owner_references=[pods.owner] if pods.owner else None,
    )


def capture_job(pods: SidePods, job_name: str, spec_path: Path, gpus: int) -> k8s.V1Job:
    """The capture side: one pod on a whole GPU node, `gpus` = the SGLang tensor-parallel size."""
    args = ["python", "-m", CAPTURE_MODULE, str(spec_path)]
    return _side_job(pods, job_name, CAPTURE, args, gpu_node_config(gpus=gpus))


def torchrun_args(pods: SidePods, job_name: str, spec_path: Path, nodes: int, processes_per_node: int) -> list[str]:
    """Node i's command: torchrun, static rendezvous at node rank 0 (`<job>-0.<service>`), rank = completion index."""
    endpoint = f"{job_name}-0.{service_name(job_name)}:{pods.rendezvous_port}"
    return [
        "python",
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc-per-node={processes_per_node}",
        f"--node-rank=$({NODE_RANK_ENV})",  # Kubernetes expands $(VAR) in args from the container's env
        "--rdzv-backend=static",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job_name}",
        f"--rdzv-conf=timeout={pods.rendezvous_timeout_s}",
        "--max-restarts=0",
        "-m",
        TRAINING_MODULE,
        str(spec_path),
    ]


def training_job(pods: SidePods, job_name: str, spec_path: Path, nodes: int, processes_per_node: int) -> k8s.V1Job:
    """The training side: an Indexed Job of `nodes` GPU pods, `processes_per_node` GPUs (one rank each) apiece."""
    if nodes < 1 or processes_per_node < 1:
        raise ValueError(f"nodes {nodes}, processes per node {processes_per_node}: both at least 1")
    config = gpu_node_config(gpus=processes_per_node)
    rank = {"name": NODE_RANK_ENV, "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX_FIELD}}}
    config["container_config"]["env"] = [rank]
    config["pod_spec_config"]["subdomain"] = service_name(job_name)
    config["job_spec_config"] = {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes}
    args = torchrun_args(pods, job_name, spec_path, nodes, processes_per_node)
    return _side_job(pods, job_name, TRAINING, args, config)


def training_service(pods: SidePods, job_name: str) -> k8s.V1Service:
    """The headless Service whose name is the training pods' subdomain, selecting exactly that Job's pods."""
    owners = [k8s.V1OwnerReference(**pods.owner.to_dict())] if pods.owner else None
    labels = side_labels(pods, TRAINING, job_name)
    return k8s.V1Service(
        api_version="v1",
        kind="Service",
        metadata=k8s.V1ObjectMeta(name=service_name(job_name), labels=labels, owner_references=owners),
        spec=k8s.V1ServiceSpec(
            cluster_ip="None",
            selector={JOB_LABEL: job_name},
            publish_not_ready_addresses=True,
            ports=[k8s.V1ServicePort(name="rendezvous", port=pods.rendezvous_port, protocol="TCP")],
        ),
    )


# --- the launcher -------------------------------------------------------------------------------------------------


def _gone(error: ApiException) -> bool:
    return error.status == 404


@dataclass
class JobSide:
    """One side's Job (and Service) as the orchestrator watches it: status, stop, logs."""

    name: str  # "capture" or "training"
    job_name: str
    namespace: str
    batch: k8s.BatchV1Api
    core: k8s.CoreV1Api
    service: str | None = None
    pods_count: int = 1

    def _pods(self) -> list[k8s.V1Pod]:
        selector = f"{JOB_LABEL}={self.job_name}"
        return list(self.core.list_namespaced_pod(self.namespace, label_selector=selector).items)

    def _exit_code(self) -> int:
        """A failed Job's code: the exit code of the container that failed first (the Job controller then ends the
        other pods, whose codes say only that), else 1 (a pod deleted or never started)."""
        failed = []
        for pod in self._pods():
            for status in (pod.status and pod.status.container_statuses) or []:
                ended = status.state and status.state.terminated
                if ended and ended.exit_code:
                    failed.append((ended.finished_at or datetime.max.replace(tzinfo=UTC), int(ended.exit_code)))
        return min(failed)[1] if failed else 1

    def poll(self) -> int | None:
        try:
            job = self.batch.read_namespaced_job_status(self.job_name, self.namespace)
        except ApiException as error:
            if _gone(error):
                return 1  # deleted under us: it will not finish its work
            raise
        conditions = {c.type: c.status for c in (job.status and job.status.conditions) or []}
        if conditions.get("Complete") == "True":
            return 0
        if conditions.get("Failed") == "True":
            return self._exit_code()
        return None

    def stop(self, grace_s: float = 30.0) -> None:
        """Delete the Job (its controller makes no new pods), then its pods with `grace_s` (SIGTERM, SIGKILL after
        that, at most the pods' terminationGracePeriodSeconds), then the Service; what is gone already is skipped."""
        calls = [
            lambda: self.batch.delete_namespaced_job(self.job_name, self.namespace, propagation_policy="Background"),
            lambda: self.core.delete_collection_namespaced_pod(
                self.namespace, label_selector=f"{JOB_LABEL}={self.job_name}", grace_period_seconds=int(grace_s)
            ),
        ]
        if self.service:
            service = self.service
            calls.append(lambda: self.core.delete_namespaced_service(service, self.namespace))
        for call in calls:
            try:
                call()
            except ApiException as error:
                if not _gone(error):
                    raise

    def describe(self) -> str:
        peers = f", Service {self.service}" if self.service else ""
        return f"Kubernetes Job {self.namespace}/{self.job_name} ({self.pods_count} pod(s){peers})"

    def tail(self) -> str:
        """Each pod's phase and waiting reason (unschedulable, image pull) and the last lines of its log."""
        parts = []
        for pod in self._pods():
            name, status = pod.metadata.name, pod.status
            waiting = [s.state.waiting.reason for s in (status.container_statuses or []) if s.state and s.state.waiting]
            parts.append(f"--- pod {name}: {status.phase}{' ' + ', '.join(waiting) if waiting else ''}")
            try:
                parts.append(self.core.read_namespaced_pod_log(name, self.namespace, tail_lines=TAIL_LINES))
            except ApiException as error:
                parts.append(f"(no log: {error.status} {error.reason})")
        return "\n".join(parts) or f"(no pods of Job {self.job_name})"


class KubernetesSides:
    """`SidesLauncher` on Kubernetes: each side a Job (the training side with its headless Service) created in the
    step pod's namespace, owned by the step pod. `log_path` is not written: the pods' logs are the record
    (`tail()`, `kubectl logs -l eagle3/streaming-job=<job>`), kept a day after the Job ends (its TTL)."""

    def __init__(self, pods: SidePods, namespace: str, batch: k8s.BatchV1Api, core: k8s.CoreV1Api, capture_gpus: int):
        self.pods, self.namespace, self.batch, self.core = pods, namespace, batch, core
        self.capture_gpus = capture_gpus
        self.attempts: dict[str, int] = {}

    def _next_name(self, side: str) -> str:
        attempt = self.attempts.get(side, 0)
        self.attempts[side] = attempt + 1
        return side_job_name(self.pods.run_key, side, attempt)

    def start_capture(self, spec_path: Path, log_path: Path) -> JobSide:
        name = self._next_name(CAPTURE)
        self.batch.create_namespaced_job(self.namespace, capture_job(self.pods, name, spec_path, self.capture_gpus))
        return JobSide(CAPTURE, name, self.namespace, self.batch, self.core)

    def start_training(self, spec_path: Path, log_path: Path, *, nodes: int, processes_per_node: int) -> JobSide:
        name = self._next_name(TRAINING)
        job = training_job(self.pods, name, spec_path, nodes, processes_per_node)
        service = training_service(self.pods, name)
        self.core.create_namespaced_service(self.namespace, service)  # first: the pods' names resolve from the start
        side = JobSide(TRAINING, name, self.namespace, self.batch, self.core, service.metadata.name, nodes)
        try:
            self.batch.create_namespaced_job(self.namespace, job)
        except ApiException:
            side.stop(0)
            raise
        return side


def step_pod(core: k8s.CoreV1Api, namespace: str, environ: Mapping[str, str]) -> k8s.V1Pod | None:
    """The pod this process runs in (`HOSTNAME` is its name in Kubernetes), read through the API; None outside a pod."""
    hostname = environ.get("HOSTNAME")
    if not hostname:
        return None
    return core.read_namespaced_pod(hostname, namespace)


def pod_owner(pod: k8s.V1Pod | None) -> OwnerReference | None:
    """The sides' owner: the step's pod, by name and uid."""
    return OwnerReference(kind="Pod", name=pod.metadata.name, uid=pod.metadata.uid) if pod is not None else None


def requested_gpus(pod: k8s.V1Pod) -> int:
    """GPUs the pod's containers request: none for a step that only orchestrates (job `eagle3_drafter_streaming`)."""
    return sum(int(((c.resources and c.resources.requests) or {}).get(GPU_RESOURCE, 0)) for c in pod.spec.containers)


def side_pods_for_run(run: Any, launcher: Any, run_key: str, owner: OwnerReference | None) -> SidePods:
    """What the sides of `run` (a DagsterRun) are built from, as dagster-k8s's step handler builds a step's Job: the
    container context `create_for_run` gives (the run launcher's settings, then the code location's context from the
    run's origin: env, secrets, volumes, service account), the image the step handler falls back to (the code
    location's), the job config of `get_k8s_job_config` (DAGSTER_HOME, the instance's config map and secret)."""
    from dagster_k8s.launcher import K8sRunLauncher

    k8s_launcher = launcher if isinstance(launcher, K8sRunLauncher) else None
    context = K8sContainerContext.create_for_run(run, k8s_launcher, include_run_tags=False)
    image = (k8s_launcher.job_image if k8s_launcher else None) or run.job_code_origin.repository_origin.container_image
    if k8s_launcher:
        job_config = context.get_k8s_job_config(image, k8s_launcher)
    else:
        job_config = DagsterK8sJobConfig(job_image=image, dagster_home=os.environ.get("DAGSTER_HOME"))
    return SidePods(run_key=run_key, context=context, job_config=job_config, owner=owner)


def kubernetes_sides(context: Any, capture_gpus: int) -> SidesLauncher:
    """The launcher for the step `context` (a Dagster asset or op context) runs in, inside its step pod: in-cluster
    credentials, the pod's own namespace, the step pods' container context and image, the pod as owner."""
    import kubernetes.config

    kubernetes.config.load_incluster_config()
    batch, core = k8s.BatchV1Api(), k8s.CoreV1Api()
    namespace = NAMESPACE_FILE.read_text().strip()
    pod = step_pod(core, namespace, os.environ)
    if pod is not None and (gpus := requested_gpus(pod)):
        context.log.warning(
            f"this step's pod {pod.metadata.name} holds {gpus} GPU(s) that it does not use: the sides run in Jobs "
            "of their own. Launch the job eagle3_drafter_streaming with the drafter's config: its step orchestrates "
            'in a CPU pod (deploy/README.md, "Streaming drafter")'
        )
    run_key = f"{context.run_id}-{context.retry_number}"
    pods = side_pods_for_run(context.dagster_run, context.instance.run_launcher, run_key, pod_owner(pod))
    return KubernetesSides(pods, namespace, batch, core, capture_gpus)
