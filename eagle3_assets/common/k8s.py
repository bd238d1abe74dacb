"""Per-stage Kubernetes pods, as the `dagster-k8s/config` op tags that dagster-k8s reads.

With `EAGLE3_EXECUTOR=k8s` every step runs as its own Kubernetes Job (dagster-k8s's `k8s_job_executor`),
and the step's `dagster-k8s/config` tag is deep-merged over the code location's settings: the Helm user
deployment's env, volumes and resources, which `includeConfigInLaunchedRuns` puts on every run and step
pod. So a tag holds only what its stage needs beyond those: a GPU step a whole GPU node, `/dev/shm` and
the model volume; an API step a small CPU pod and the tokenizer (it lives with the target). The data
volume is the code location's and is on every pod already; listing it in a tag too would give the pod
two volumes of one name (dagster-k8s drops only identical duplicates), which Kubernetes refuses.

Read from the environment when the definitions load. Set them in the Helm user deployment's `env`: the
code server and every run and step pod get that environment, so they all build the same tags.

    EAGLE3_EXECUTOR               `k8s`: one Kubernetes Job per step; unset: Dagster's default executor,
                                  which runs a whole run in one process tree and ignores these tags
    EAGLE3_K8S_GPUS               GPUs of a GPU step (default 8: a whole node)
    EAGLE3_K8S_GPU_NODE_SELECTOR  `key=value,...` the GPU node must carry (default `nvidia.com/gpu.count=8`,
                                  a label of NVIDIA's GPU feature discovery; empty: any node with free GPUs)
    EAGLE3_K8S_GPU_TOLERATION     taint key of the GPU nodes, tolerated whatever its value (default
                                  `nvidia.com/gpu`; empty: no toleration)
    EAGLE3_K8S_GPU_CPU            CPU cores of a GPU step, request = limit (default 64)
    EAGLE3_K8S_GPU_MEMORY         memory of a GPU step, request = limit; `/dev/shm` counts in it (default 512Gi)
    EAGLE3_K8S_SHM_GB             size of the memory-backed `/dev/shm` of a GPU step, in GiB (default 64)
    EAGLE3_K8S_GPU_IMAGE          image of the GPU steps, the CUDA build of the same commit as the code
                                  location's image (unset: the code location's image)
    EAGLE3_K8S_MODEL_CLAIM        PersistentVolumeClaim holding the target and its tokenizer, mounted read-only
                                  at /models in GPU and API steps (default `eagle3-models`; empty: none)
    EAGLE3_K8S_CPU                CPU request of an API/CPU step (default 2; no limit)
    EAGLE3_K8S_MEMORY             memory of an API/CPU step, request = limit (default 8Gi)
    EAGLE3_K8S_ORCHESTRATOR_CPU   CPU request of a streaming drafter step that only orchestrates (default 4; no limit)
    EAGLE3_K8S_ORCHESTRATOR_MEMORY  its memory, request = limit (default 64Gi): it holds the merged set, 5.2 bytes
                                  a token in memory (31 GB at 6B tokens)

A streaming drafter run whose sides are Kubernetes Jobs (`streaming_sides: kubernetes`) only orchestrates in its
step, yet the drafter's tag asks for a GPU node. The job `eagle3_drafter_streaming` (operations/jobs.py) gives that
step `orchestrator_pod_config()` through the k8s executor's `per_step_k8s_config`, which dagster-k8s merges last,
over the tag. It is a SHALLOW merge (dagster-k8s's `merge_behavior`): the keys it names replace the merged ones
(resources, node selector, tolerations); a DEEP merge, the default, can add to a node selector or a toleration list
but never empty it. What it does not name stays: the code location's env and data volume, the tag's model volume.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import dagster as dg

# dagster_k8s.job.USER_DEFINED_K8S_CONFIG_KEY, spelled out: dagster-k8s is an optional extra.
K8S_CONFIG_TAG = "dagster-k8s/config"
GPU_RESOURCE = "nvidia.com/gpu"
MODELS_MOUNT = "/models"
SHM_MOUNT = "/dev/shm"

K8sConfig = dict[str, Any]


def _setting(name: str, default: str) -> str:
    """The variable's value, empty included (empty switches a volume, label or toleration off); unset: the default."""
    return os.environ.get(name, default)


def _amount(name: str, default: str) -> str:
    """The variable's value; unset or empty: the default (an amount cannot be empty)."""
    return os.environ.get(name) or default


def node_selector_from(text: str) -> dict[str, str]:
    """`a=b,c=d` as a node selector; an empty text selects no label."""
    selector: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"node selector item {item!r} is not key=value")
        selector[key.strip()] = value.strip()
    return selector


def model_volume(claim: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The model claim read-only at /models (volumes, mounts); nothing for an empty claim."""
    if not claim:
        return [], []
    volume = {"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return [volume], [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}]


def gpu_node_config(  # eight parameters: one optional override per pod setting, each else its EAGLE3_K8S_* variable
    gpus: int | None = None,
    node_selector: Mapping[str, str] | None = None,
    model_claim: str | None = None,
    shm_gb: int | None = None,
    cpu: str | None = None,
    memory: str | None = None,
    toleration_key: str | None = None,
    image: str | None = None,
) -> K8sConfig:
    """A whole GPU node for one step (hidden-state capture, drafter training); None takes the environment's value.

    GPUs, CPU and memory are requested and limited alike: Guaranteed QoS, so a kubelet with the static CPU
    and topology managers can give the step cores next to its GPUs, and nothing else lands on the node.
    `/dev/shm` is memory-backed and sized: NCCL and SGLang's rank-0 hand-off use it, and a container's own
    is 64 MB. Its pages count against the memory limit, so `memory` must hold them and the process.
    """
    gpus = int(_amount("EAGLE3_K8S_GPUS", "8")) if gpus is None else gpus
    if node_selector is None:
        node_selector = node_selector_from(_setting("EAGLE3_K8S_GPU_NODE_SELECTOR", f"nvidia.com/gpu.count={gpus}"))
    claim = _setting("EAGLE3_K8S_MODEL_CLAIM", "eagle3-models") if model_claim is None else model_claim
    shm_gb = int(_amount("EAGLE3_K8S_SHM_GB", "64")) if shm_gb is None else shm_gb
    cpu = cpu or _amount("EAGLE3_K8S_GPU_CPU", "64")
    memory = memory or _amount("EAGLE3_K8S_GPU_MEMORY", "512Gi")
    toleration_key = _setting("EAGLE3_K8S_GPU_TOLERATION", GPU_RESOURCE) if toleration_key is None else toleration_key
    image = image or os.environ.get("EAGLE3_K8S_GPU_IMAGE") or None

    amounts = {"cpu": cpu, "memory": memory, GPU_RESOURCE: str(gpus)}
    volumes, mounts = model_volume(claim)
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gb}Gi"}})
    mounts.append({"name": "dshm", "mountPath": SHM_MOUNT})
    container: dict[str, Any] = {"resources": {"requests": amounts, "limits": dict(amounts)}, "volumeMounts": mounts}
    if image:
        container["image"] = image  # dagster-k8s takes the step's image from here before the run's
    pod: dict[str, Any] = {"nodeSelector": dict(node_selector), "volumes": volumes}
    if toleration_key:
        pod["tolerations"] = [{"key": toleration_key, "operator": "Exists", "effect": "NoSchedule"}]
    return {"container_config": container, "pod_spec_config": pod}


def api_pod_config(cpu: str | None = None, memory: str | None = None, model_claim: str | None = None) -> K8sConfig:
    """A small CPU pod for the stages that call APIs or transform tables: no GPU, no GPU node.

    Memory is limited at its request (a leak ends this pod, not its neighbours); CPU is not (a CPU limit
    throttles, and spare cores cost nothing). The model claim is mounted for the tokenizer
    (`EAGLE3_TOKENIZER_DIR` under /models): ids must come from the target's own tokenizer files.
    """
    cpu = cpu or _amount("EAGLE3_K8S_CPU", "2")
    memory = memory or _amount("EAGLE3_K8S_MEMORY", "8Gi")
    claim = _setting("EAGLE3_K8S_MODEL_CLAIM", "eagle3-models") if model_claim is None else model_claim
    volumes, mounts = model_volume(claim)
    container: dict[str, Any] = {
        "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    }
    config: K8sConfig = {"container_config": container}
    if volumes:
        container["volumeMounts"] = mounts
        config["pod_spec_config"] = {"volumes": volumes}
    return config


def orchestrator_pod_config(cpu: str | None = None, memory: str | None = None) -> K8sConfig:
    """The pod of a drafter step that only orchestrates a streaming run on Kubernetes (its sides are Jobs of their
    own): a CPU pod, as a per-step override (`per_step_k8s_config`) merged over the drafter's GPU-node tag.

    SHALLOW: `resources`, `nodeSelector` and `tolerations` replace the tag's (no GPU requested, no GPU node selected,
    no GPU taint tolerated); the volumes and mounts are not named, so the data volume (the code location's: the
    spool, the specs, the merged set) and the model volume (the step reads the target's config.json and its weight
    files' names and sizes) stay, with the tag's `/dev/shm` (memory-backed: it costs what is written there, nothing).
    """
    cpu = cpu or _amount("EAGLE3_K8S_ORCHESTRATOR_CPU", "4")
    memory = memory or _amount("EAGLE3_K8S_ORCHESTRATOR_MEMORY", "64Gi")
    resources = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    return {
        "merge_behavior": "SHALLOW",
        "container_config": {"resources": resources},
        "pod_spec_config": {"nodeSelector": {}, "tolerations": []},
    }


def step_executor() -> dg.ExecutorDefinition | None:
    """dagster-k8s's `k8s_job_executor` for `EAGLE3_EXECUTOR=k8s`, else None (Dagster's default executor)."""
    choice = os.environ.get("EAGLE3_EXECUTOR", "")
    if choice == "k8s":
        # the `k8s` extra, installed in the images
        from dagster_k8s import k8s_job_executor

        return k8s_job_executor
    if choice:
        raise ValueError(f"EAGLE3_EXECUTOR={choice!r}: `k8s`, or unset for Dagster's default executor")
    return None
