"""`eagle3_drafter`: a trained EAGLE-3 drafter in the format SGLang serves for its kind (`LlamaForCausalLMEagle3`, or
the Kimi-K2.x MLA draft `Eagle3DeepseekV2ForCausalLM`)."""

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import polars as pl
from pydantic import Field

from eagle3_assets.common.failures import failure_for_operator
from eagle3_assets.common.k8s import K8S_CONFIG_TAG, gpu_node_config
from eagle3_assets.common.metadata import json_value, markdown_table, path_value, png_markdown
from eagle3_assets.common.outcome import CheckOutcome, check_specs, to_results
from eagle3_assets.stages.eagle3_drafter.checks import (
    DRAFTER_CHECKS,
    drafter_accept_length,
    drafter_beats_floor,
    drafter_keys,
    drafter_matches_capture,
)
from eagle3_assets.stages.eagle3_drafter.figures import SOURCES as FIGURE_SOURCES
from eagle3_assets.stages.eagle3_drafter.figures import best_checkpoint_plot
from eagle3_assets.stages.eagle3_drafter.launch import run_torchrun
from eagle3_assets.stages.eagle3_drafter.streaming_sides import LocalSides, SidesLauncher
from eagle3_assets.stages.hidden_states.asset import hidden_states
from eagle3_assets.stages.hidden_states.selection import target_identity
from eagle3_resources.errors import DrafterError
from eagle3_resources.hidden_states.resource import HiddenStatesBackendKind, HiddenStatesResource
from eagle3_resources.storage import DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

if TYPE_CHECKING:
    from eagle3_assets.stages.eagle3_drafter.kind_contest import KindResult
    from eagle3_assets.stages.eagle3_drafter.pipeline import DrafterReport
    from eagle3_assets.stages.eagle3_drafter.quality import SpeculativeQuality
    from eagle3_assets.stages.eagle3_drafter.streaming import StreamingJob, StreamingRequest
    from eagle3_assets.stages.eagle3_drafter.train import TrainSettings


class DrafterTrainConfig(dg.Config):
    draft_vocab_size: int = Field(
        default=32000, description="draft vocabulary; capped at the distinct loss tokens seen"
    )
    drafter_kind: str = Field(
        default="auto",
        description="the drafter trained and exported: `eagle3_llama` (SGLang's LlamaForCausalLMEagle3, a Llama "
        "decoder layer with GQA attention), `eagle3_mla` (SGLang's Eagle3DeepseekV2ForCausalLM, the Kimi-K2.x draft "
        "with the target's multi-latent attention: a draft KV cache of 1,152 bytes per token at Kimi width against "
        "the Llama draft's 4,096), `eagle3_1_mla` (the same with EAGLE 3.1's fc_norm and norm_output); `auto` = "
        "eagle3_mla for a target with MLA (its config has kv_lora_rank: DeepSeek-V3, Kimi-K2.5, the stand-in), "
        "eagle3_llama for any other, a warm start's own kind with `init_from`",
    )
    drafter_kinds: list[str] = Field(
        default=[],
        description="train each of these kinds (`drafter_kind`'s names) in turn on the same states, windows, draft "
        "vocabulary, seed and budget, decode each with the target through its exported files, and export the one "
        "with the highest real accept length; every kind's figures are in the metadata (`kinds_compared`). Empty: "
        "`drafter_kind` alone. One process (offline or online), no warm start, no streaming",
    )
    ttt_steps: int = Field(default=7, description="training-time-test unroll length (SpecForge/EAGLE: 7)")
    step_decay: float = Field(default=0.8, description="loss weight of TTT step k is decay**k")
    epochs: int = Field(
        default=3,
        description="passes over the training split (3 of 1,024-token batches: the first command's drafter decodes "
        "at a real accept length of 2.17 against the untrained one's 1.02 on the shipped stand-in, docs/testing.md; "
        "GPU runs set their own, docs/gpu-host.md)",
    )
    lr: float | None = Field(
        default=None,
        description="AdamW peak learning rate (warmup, then cosine); unset = by the "
        "drafter's width: 1e-4 from 4096 wide (SpecForge's 5e-5 to 1e-4 for 7168-wide drafters), "
        "3e-4 from 1024, 2e-3 for the narrow stand-in",
    )
    batch_tokens: int = Field(
        default=1024,
        description="tokens per optimizer step (whole windows, at least one); the "
        "global batch, whatever the number of processes",
    )
    max_len: int = Field(
        default=4096,
        description="longest window trained at once; a longer sample is cut into "
        "consecutive windows (every token is trained; the count of cut samples is in the metadata)",
    )
    seed: int = Field(default=0, description="initialisation and shuffling seed")
    min_accept_length: float = Field(default=1.5, description="the accept_length check (simulated) warns below this")
    spec_eval_prompts: int = Field(
        default=8,
        description="eval-split prompts decoded speculatively with the target "
        "(transformers) and the trained and an untrained drafter; 0 = skip",
    )
    spec_eval_new_tokens: int = Field(default=48, description="tokens generated per prompt in that evaluation")
    spec_draft_steps: int = Field(
        default=3,
        description="draft tokens per round (SGLang's --speculative-num-steps; top-k 1, num-draft-tokens = steps + 1)",
    )
    spec_eval_max_target_gb: float = Field(
        default=40.0,
        description="skip the real decoding evaluation for a target "
        "with more weights than this (measure it in SGLang instead: "
        "benchmarks/sglang_engine_speculative.py, then "
        "`python -m eagle3_assets.operations.record_figures` records it here)",
    )
    min_accept_gain: float | None = Field(
        default=0.1,
        description="the speculative_gain check (blocking) fails unless the trained drafter's real accept length "
        "beats the untrained one's by this much (and by twice the per-prompt gain's standard error); null: the gain "
        "is measured and reported but not required (a run too small to train a useful drafter, such as one dataset "
        "of the shipped samples)",
    )
    checkpoint_every: int = Field(
        default=50,
        description="optimizer steps between training checkpoints (weights, "
        "optimizer, scheduler, data position, RNG) in `eagle3_drafter.training/`; a stopped "
        "or killed run resumes from the last one",
    )
    device: str = Field(
        default="auto",
        description="`auto` = CUDA when present (bf16 autocast, fp32 master weights), else the CPU; or `cpu`, `cuda`",
    )
    processes: int = Field(
        default=1,
        description="data-parallel processes (torchrun + DDP, one per GPU; gloo on the CPU); 8 on an 8-GPU host",
    )
    online: bool = Field(
        default=False,
        description="compute the target's hidden states inside the training loop "
        "(transformers, the `target` resource) instead of reading the store: no disk needed, for a "
        "target that fits beside the trainer",
    )
    init_from: str | None = Field(
        default=None, description="warm start from this SGLang-format drafter folder (its weights and draft vocabulary)"
    )
    best_every: int = Field(
        default=0,
        description="every this many optimizer steps (and at the last), decode the held-out prompts speculatively "
        "with the target (the lossless loop, `spec_eval_new_tokens` each, chains of `spec_draft_steps`), per prompt "
        "kind, and export the drafter with the highest accept length instead of the last; its curve and picture go "
        "in the metadata; 0 = off (the last step is exported). With several `processes` rank 0 decodes while the "
        "others wait for its word (offline and streaming); a target within `spec_eval_max_target_gb` only",
    )
    best_prompts_per_kind: int = Field(
        default=4, description="eval-split prompts of each kind (chat, code, reasoning, function-calling) decoded"
    )
    streaming_spool_gb: float | None = Field(
        default=None,
        description="streaming mode (issue 27): unset = offline, training on the `hidden_states` store (the default). "
        "Set, the drafter captures the merged set's states itself (the `hidden_states_backend` resource, in a "
        "process of its own) into a spool of at most this many GB (1e9 bytes) and trains on them as they come: a "
        "shard is deleted once trained `streaming_passes` times, capture pauses while the spool is full. The plan "
        "(duration, peak disk, bottleneck) is logged and recorded first; a spool that cannot hold `streaming_passes` "
        "x `streaming_mix_shards` + 1 shards is refused before anything starts. Each shard holds every dataset in its "
        "share of the merged set. The step only orchestrates: the capture side and the "
        "training side (`processes` ranks under torchrun) run where `streaming_sides` says. Not with `online`",
    )
    streaming_passes: int = Field(
        default=1, description="streaming mode: times each token is trained (they replace `epochs`)"
    )
    streaming_shard_gb: float = Field(default=1.0, description="streaming mode: the spool's shard size in GB")
    streaming_mix_shards: int | None = Field(
        default=None,
        ge=1,
        description="streaming mode: consecutive shards whose samples the trainer shuffles together (offline "
        "shuffles the whole set; a shard holds a few samples); unset = as many as `streaming_passes` + 1 of them fit "
        "the spool and 16 GiB of a training rank's memory (each rank holds `streaming_passes` + 1 mixes at most)",
    )
    streaming_prefetch_steps: int | None = Field(
        default=None,
        ge=0,
        description="streaming mode: steps each training rank reads (only its rows, chunk-verified) and packs ahead of "
        "the one it trains, on threads of its own, so a slow shared file system's latency is paid once per that many "
        "steps (docs/streaming.md, the throttled-reader figures); 0 = each step read on the training thread when "
        "trained; unset = the trainer's default, 4 (spool_prefetch.PREFETCH_STEPS)",
    )
    streaming_capture_tok_s: float | None = Field(
        default=None,
        description="streaming plan: tokens/s of capture (assumed); unset = `streaming_capture_gpu_check`'s, else the "
        "last `hidden_states` materialization's measured `tokens_per_s` (refused when there is none)",
    )
    streaming_train_tok_s: float | None = Field(
        default=None,
        description="streaming plan: token-passes/s of training on one node (all its `processes` ranks, assumed); "
        "unset = `streaming_train_device_check`'s, else the last drafter materialization's measured "
        "`train_tokens_per_s` (refused when there is none)",
    )
    streaming_capture_gpu_check: str | None = Field(
        default=None,
        description="streaming plan: an `eagle3 gpu-check --model <target> --tp N --json` output; the capture rate is "
        "its `sglang capture (target, ...)` row's tokens_per_s (not with streaming_capture_tok_s)",
    )
    streaming_train_device_check: str | None = Field(
        default=None,
        description="streaming plan: a `benchmarks/device_check.py` JSON; a node's training rate is its `train_kimi` "
        "section's tokens_per_s (one GPU) x `processes` (assumed linear; not with streaming_train_tok_s)",
    )
    streaming_spool_gpu_check: str | None = Field(
        default=None,
        description="streaming plan: an `eagle3 gpu-check --json` output run on the spool's file system; its `disk "
        "write` row's bytes/s replace streaming_spool_gb_s",
    )
    streaming_reads_per_byte: float | None = Field(
        default=None,
        description="streaming plan: times the training side reads each captured byte from the spool's file system; "
        "unset = today's trainer (each rank reads only its rows: 1 for one pass; streaming_plan.py)",
    )
    streaming_spool_dir: str | None = Field(
        default=None,
        description="streaming mode: the spool's folder, on a file system both sides reach (on Kubernetes the data "
        "root is a ReadWriteMany volume every pod mounts); unset = `<drafter>.streaming/spool` beside the drafter "
        "under the data root. Removed when the run finishes",
    )
    streaming_sides: str = Field(
        default="local",
        description="streaming mode: where the capture side and the training side run. `local`: each a process "
        "group on the step's machine (training under torchrun with `processes` ranks). `kubernetes`: each a Job "
        "in the step pod's namespace (deploy/README.md), the capture on one whole GPU node (GPUs: the SGLang "
        "tensor-parallel size), the training an Indexed Job of `streaming_nodes` GPU pods of `processes` ranks; "
        "the spool on the data volume all pods mount (ReadWriteMany)",
    )
    streaming_nodes: int = Field(
        default=1,
        description="streaming mode: nodes of the training side, each running `processes` ranks (one a GPU); "
        "more than 1 needs `streaming_sides: kubernetes`",
    )
    streaming_orphan_after_s: float = Field(
        default=60.0,
        description="streaming mode: a side whose orchestrating step has given no heartbeat (rewritten every 2 s, or "
        "a quarter of this when shorter) "
        "for this many seconds, measured on the side's own clock, stops itself: a step killed with kill -9 leaves "
        "no capture or trainer running",
    )
    streaming_spool_gb_s: float = Field(
        default=1.0,
        description="streaming plan: GB/s the spool's file system sustains, writes and reads together (measure "
        "yours: local NVMe several, NFS often under 1)",
    )

    def settings(self) -> "TrainSettings":
        # torch-using: imported when the asset runs, so loading the definitions stays torch-free
        from eagle3_assets.stages.eagle3_drafter.train import TrainSettings

        return TrainSettings(
            ttt_steps=self.ttt_steps,
            step_decay=self.step_decay,
            epochs=self.epochs,
            lr=self.lr,
            batch_tokens=self.batch_tokens,
            max_len=self.max_len,
            seed=self.seed,
            checkpoint_every=self.checkpoint_every,
            drafter_kind=self.drafter_kind,
        )


def train_in_processes(
    context: dg.AssetExecutionContext,
    config: DrafterTrainConfig,
    store: DataStore,
    folder: Path,
    best: dict | None = None,
) -> "DrafterReport":
    """torchrun with `config.processes` ranks; the step's stop stops them all. `best`: the keeper's section of the
    spec (`best_section`; rank 0 loads the target and decodes)."""
    from eagle3_assets.stages.eagle3_drafter.train_cli import TrainSpec, report_from_json

    out = store.layout.drafter()
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = TrainSpec(
        hidden_root=None if config.online else store.layout.hidden_states(),
        merged_path=store.layout.merged_dataset(),
        target_folder=folder,
        out_dir=out,
        settings=config.settings(),
        draft_vocab_size=config.draft_vocab_size,
        report_path=Path(str(out) + ".report.json"),
        device=config.device,
        online=config.online,
        init_from=Path(config.init_from) if config.init_from else None,
        best=best,
    ).write(Path(str(out) + ".spec.json"))
    return report_from_json(run_torchrun(spec, config.processes, context.log.info))


def training_plot(report: "DrafterReport"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3))
    ax1.plot(report.history.step_loss, lw=1)
    ax1.set_title("training loss (TTT-weighted)")
    ax1.set_xlabel("optimizer step")
    steps = range(1, len(report.trained["acc"]) + 1)
    most = ceiling(simulated_steps(report))
    ax2.plot(
        steps,
        report.trained["acc"],
        marker="o",
        label=f"trained: simulated accept length {report.trained['accept_length']:.2f} (ceiling {most})",
    )
    ax2.plot(
        steps,
        report.untrained["acc"],
        marker="x",
        label=f"untrained: simulated accept length {report.untrained['accept_length']:.2f} (ceiling {most})",
    )
    ax2.set_title(f"per-step accuracy on the {report.eval_split} split")
    ax2.set_xlabel("draft step")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=8, loc="center")
    plt.close(fig)
    return fig


def drafter_history(instance: dg.DagsterInstance, key: dg.AssetKey, limit: int = 50) -> list[dict]:
    """Earlier drafters' accept length (simulated; real where measured) and per-step acceptance, oldest first."""
    records = instance.fetch_materializations(key, limit=limit).records
    out = []
    for record in reversed(records):
        if record.asset_materialization is None:  # a materialization record always holds one
            continue
        meta = record.asset_materialization.metadata
        simulated = meta.get("accept_length_simulated", meta.get("accept_length"))  # `accept_length` in older ones
        if simulated is None:
            continue
        steps = sorted((int(k.rsplit("_", 1)[1]), v.value) for k, v in meta.items() if k.startswith("acceptance_step_"))
        real = meta.get("accept_length_real")
        out.append(
            {
                "t": record.timestamp,
                "accept_length": simulated.value,
                "accept_length_real": real.value if real else None,
                "acc": [v for _, v in steps],
            }
        )
    return out


def history_plot(history: list[dict], report: "DrafterReport", real: dict | None = None):
    """Accept length over materializations, the real one (decoded, where measured) and the simulated one, each with
    its draft steps and ceiling; and this drafter's simulated per-step acceptance against the previous one's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))
    x = range(1, len(history) + 2)
    nan = float("nan")
    steps_sim = simulated_steps(report)
    simulated = [h["accept_length"] for h in history] + [report.trained["accept_length"]]
    line = ax1.plot(x, simulated, marker="o", label=f"simulated, teacher-forced ({accept_scale(steps_sim)})")[0]
    ax1.axhline(ceiling(steps_sim), color=line.get_color(), ls="--", lw=0.8)
    tops = [ceiling(steps_sim)]
    if real is not None:
        steps_real = real.get("draft_steps") or 0
        decoded = [h.get("accept_length_real") for h in history] + [real["accept_length_real"]]
        line = ax1.plot(
            x,
            [v if v is not None else nan for v in decoded],
            marker="s",
            label=f"real, decoded ({accept_scale(steps_real)})" if steps_real else "real, decoded",
        )[0]
        if steps_real:
            ax1.axhline(ceiling(steps_real), color=line.get_color(), ls="--", lw=0.8)
            tops.append(ceiling(steps_real))
    ax1.axhline(1, color="grey", ls=":", lw=0.8, label="no draft accepted (1)")
    ax1.set_ylim(0, max(tops) + 0.5)
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_title("accept length per materialization (dashed: ceilings)")
    ax1.set_xlabel("materialization (this one last)")
    ax1.legend(fontsize=7, loc="lower left")
    steps = range(1, len(report.trained["acc"]) + 1)
    ax2.plot(steps, report.trained["acc"], marker="o", label="this drafter")
    if history and history[-1]["acc"]:
        ax2.plot(range(1, len(history[-1]["acc"]) + 1), history[-1]["acc"], marker="x", label="previous drafter")
    ax2.set_title(f"simulated acceptance per draft step ({steps_sim} steps)")
    ax2.set_xlabel("draft step")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def ttt_loss_plot(by_ttt: list[list[float]]):
    """The loss of each TTT step over training: later draft steps start higher and should fall too."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3))
    if by_ttt:
        for k in range(len(by_ttt[0])):
            ax.plot([row[k] for row in by_ttt], lw=1, label=f"step {k + 1}")
    ax.set_title("training loss per TTT draft step")
    ax.set_xlabel("optimizer step")
    ax.legend(fontsize=7, ncol=2)
    plt.close(fig)
    return fig


def acceptance_plot(report: "DrafterReport", quality: "SpeculativeQuality"):
    """Per-position acceptance in real decoding, trained vs untrained; accept lengths real and simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, u = quality.trained.totals(), quality.untrained.totals()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3))
    pos = range(1, len(t["position_acceptance"]) + 1)
    ax1.plot(pos, [a if a is not None else float("nan") for a in t["position_acceptance"]], marker="o", label="trained")
    ax1.plot(
        pos, [a if a is not None else float("nan") for a in u["position_acceptance"]], marker="x", label="untrained"
    )
    ax1.set_title("real decoding: acceptance per draft position")
    ax1.set_xticks(list(pos))
    ax1.set_xlabel("draft position")
    ax1.set_ylim(0, 1)
    ax1.legend(fontsize=8)
    steps_real, steps_sim = quality.trained.draft_steps, simulated_steps(report)
    names = [
        f"real (SGLang def.)\n{accept_scale(steps_real)}",
        f"simulated (teacher-forced)\n{accept_scale(steps_sim)}",
    ]
    x = range(len(names))
    ax2.hlines(
        [ceiling(steps_real), ceiling(steps_sim)], [-0.45, 0.55], [0.45, 1.45], colors="grey", ls="--", label="ceiling"
    )
    ax2.bar(
        [i - 0.2 for i in x], [t["accept_length_sglang"], report.trained["accept_length"]], width=0.4, label="trained"
    )
    ax2.bar(
        [i + 0.2 for i in x],
        [u["accept_length_sglang"], report.untrained["accept_length"]],
        width=0.4,
        label="untrained",
    )
    ax2.set_xticks(list(x), names)
    ax2.set_title(f"accept length ({quality.figures()['label']})")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def loss_plot(losses: list[float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.6))
    ax.plot(losses, lw=1)
    ax.set_title("training loss (TTT-weighted) per optimizer step")
    ax.set_xlabel("optimizer step")
    plt.close(fig)
    return fig


def ceiling(draft_steps: int) -> int:
    """The highest accept length chains of `draft_steps` can reach: every draft token accepted, plus the target's own
    next token of the verify pass."""
    return draft_steps + 1


def accept_scale(draft_steps: int) -> str:
    """`3 draft steps, ceiling 4`: what an accept length is out of."""
    return f"{draft_steps} draft steps, ceiling {ceiling(draft_steps)}"


def simulated_steps(report: "DrafterReport") -> int:
    """The simulated figure's draft steps: the trainer's eval pass scores every step of the TTT unroll (0: not
    known, a report without its per-step acceptance)."""
    return len(report.trained.get("acc") or ())


def accept_length_metadata(report: "DrafterReport", real: dict | None, previous: dict | None) -> dict:
    """The accept lengths, the real one first: measured by lossless speculative decoding with the target (when the
    target is small enough to run here), then the simulated one (teacher-forced on the eval split), named so; each
    with a `_source` saying what produced it. SGLang's own figures come later, as observations of this asset
    (eagle3_assets/stages/eagle3_drafter/figures.py). Each with its draft steps and ceiling (`_draft_steps`,
    `_ceiling`, and in its `_label`): the real one decodes chains of `spec_draft_steps` (3: at most 4), the simulated
    one scores the whole training-time-test unroll (7: at most 8), so the two are on different scales."""
    out: dict = {}
    steps_sim = simulated_steps(report)
    steps_real = real.get("draft_steps") if real is not None else None
    if real is not None:
        scale = f", {accept_scale(steps_real)}" if steps_real else ""
        out |= {
            "accept_length_real": real["accept_length_real"],
            "accept_length_real_untrained": real["accept_length_real_untrained"],
            **(
                {"accept_length_real_draft_steps": steps_real, "accept_length_real_ceiling": ceiling(steps_real)}
                if steps_real
                else {}
            ),
            "accept_length_real_label": real["label"]
            + f": SGLang's definition (completion_tokens / spec_verify_ct){scale}",
            "accept_length_real_source": f"{FIGURE_SOURCES['transformers']}; target: {real['label']}",
        }
        if previous and previous.get("accept_length_real") is not None:
            out |= {
                "accept_length_real_previous": previous["accept_length_real"],
                "accept_length_real_change": round(real["accept_length_real"] - previous["accept_length_real"], 4),
            }
    other = f"; the real figure's: {accept_scale(steps_real)}" if steps_real and steps_real != steps_sim else ""
    scale = f": {accept_scale(steps_sim)}, the training-time-test unroll{other}" if steps_sim else ""
    out |= {
        "accept_length_simulated": report.trained["accept_length"],
        "accept_length_simulated_untrained": report.untrained["accept_length"],
        **(
            {"accept_length_simulated_draft_steps": steps_sim, "accept_length_simulated_ceiling": ceiling(steps_sim)}
            if steps_sim
            else {}
        ),
        "accept_length_simulated_label": f"simulated, teacher-forced on the {report.eval_split} split (no "
        f"decoding){scale}",
        "accept_length_simulated_source": FIGURE_SOURCES["simulated"],
    }
    if previous:
        out |= {
            "accept_length_simulated_previous": previous["accept_length"],
            "accept_length_simulated_change": round(report.trained["accept_length"] - previous["accept_length"], 4),
        }
    return out


@dg.asset(
    # the release gate: a drafter SGLang cannot load, that reads other layers or ids than it was trained on, or that
    # decodes no better than an untrained one blocks everything downstream of it
    check_specs=check_specs(
        "eagle3_drafter", DRAFTER_CHECKS, blocking={"sglang_keys", "matches_capture", "speculative_gain"}
    ),
    deps=[hidden_states],
    group_name="training",
    pool="gpu",
    op_tags={K8S_CONFIG_TAG: gpu_node_config()},  # a whole GPU node under the k8s executor
    kinds={"pytorch", "safetensors"},
    description="One-layer EAGLE-3 drafter trained with training-time test on the stored hidden states; exported "
    "as config.json + bf16 safetensors with exactly the keys SGLang loads for its kind (`drafter_kind`: "
    "LlamaForCausalLMEagle3, or the MLA draft Eagle3DeepseekV2ForCausalLM, EAGLE 3 or 3.1; checked). Not "
    'partitioned: a backfill dialog\'s preview lists it under "No partitions available to materialize", yet a run '
    "over datasets builds it once, after their `token_ids`.",
)
@failure_for_operator
def eagle3_drafter(
    context: dg.AssetExecutionContext,
    config: DrafterTrainConfig,
    store: DataStore,
    tokenizer: TokenizerResource,
    target: TargetModelResource,
    hidden_states_backend: HiddenStatesResource,
) -> dg.MaterializeResult:
    from eagle3_assets.stages.eagle3_drafter.export import check_checkpoint
    from eagle3_assets.stages.eagle3_drafter.streaming import stream_drafter

    merged = pl.read_parquet(store.layout.merged_dataset())
    folder = target.folder(tokenizer, context.log.info)
    refuse_best_checkpoint(config, folder)
    refuse_kinds_contest(config)
    streaming: dict = {}
    contest: dict = {}
    decoded: SpeculativeQuality | None = None  # the contest's decode of the winner, whose files the export copies
    if config.drafter_kinds:
        report, contest, decoded = train_kinds(context, config, store, folder, target, tokenizer, merged)
    elif config.streaming_spool_gb is not None:
        report, figures = stream_drafter(
            streaming_job(context, config, store, folder, merged, (target, tokenizer, hidden_states_backend))
        )
        streaming = figures.metadata()
    elif config.processes > 1:
        report = train_in_processes(context, config, store, folder, best_section(config, target, tokenizer))
    else:
        report = train_in_this_process(context, config, store, folder, target, tokenizer, merged)
    problems = check_checkpoint(report.checkpoint)
    quality = None
    # an export that does not load is not decoded: the gate fails on it (sglang_keys says why)
    if not problems and decodable(config, folder):
        quality = decoded or decode_export(context, config, report.checkpoint, merged, target, tokenizer)
    real = quality.figures() if quality else None
    outcomes = {
        "sglang_keys": drafter_keys(report.checkpoint),
        "matches_capture": drafter_matches_capture(
            report.checkpoint, captured_layer_ids(store, config), report.draft_ids
        ),
        "accept_length": drafter_accept_length(
            report.trained["accept_length"], report.untrained["accept_length"], config.min_accept_length
        ),
        "speculative_gain": drafter_beats_floor(real, config.min_accept_gain)
        if not problems
        else CheckOutcome(False, f"not decoded: the exported checkpoint does not load ({problems[0]})", {}),
    }
    history = drafter_history(context.instance, context.assets_def.key)
    previous = history[-1] if history else None
    return dg.MaterializeResult(
        check_results=to_results(DRAFTER_CHECKS, outcomes),
        metadata=accept_length_metadata(report, real, previous)
        | evaluation_metadata(report, history, real)
        | decoding_metadata(report, quality)
        | training_metadata(report)
        | best_checkpoint_metadata(report)
        | streaming
        | contest
        | {
            "sglang_key_check": "ok" if not problems else "; ".join(problems),
            "config": json_value(report.config),
            "path": path_value(report.checkpoint),
        },
    )


def captured_layer_ids(store: DataStore, config: DrafterTrainConfig) -> list[int] | None:
    """The target layers the training data was captured from: the hidden-state store's manifest (None when it was
    streamed through a spool instead)."""
    if config.streaming_spool_gb is not None:
        return None
    from eagle3_resources.hidden_states.store import MANIFEST

    manifest = store.layout.hidden_states() / MANIFEST
    return list(json.loads(manifest.read_text())["aux_layer_ids"]) if manifest.is_file() else None


def refuse_kinds_contest(config: DrafterTrainConfig) -> None:
    """`drafter_kinds` trains its kinds one after another in this process: names it knows, nothing that needs
    another process or decides the kind itself."""
    if not config.drafter_kinds:
        return
    from eagle3_assets.stages.eagle3_drafter.model import DRAFTER_KINDS

    unknown = [k for k in config.drafter_kinds if k not in DRAFTER_KINDS]
    if unknown or len(set(config.drafter_kinds)) != len(config.drafter_kinds):
        raise DrafterError(f"drafter_kinds {config.drafter_kinds}: each once, of {list(DRAFTER_KINDS)}")
    clashes = [
        name
        for name, on in (
            ("processes > 1", config.processes > 1),
            ("streaming_spool_gb", config.streaming_spool_gb is not None),
            ("init_from (a warm start has its own kind)", config.init_from is not None),
        )
        if on
    ]
    if clashes:
        raise DrafterError(f"drafter_kinds trains its kinds in this process, one after another: unset {clashes}")


def train_kinds(
    context: dg.AssetExecutionContext,
    config: DrafterTrainConfig,
    store: DataStore,
    folder: Path,
    target: TargetModelResource,
    tokenizer: TokenizerResource,
    merged: pl.DataFrame,
) -> tuple["DrafterReport", dict, "SpeculativeQuality | None"]:
    """Each of `drafter_kinds` trained and decoded (`kind_contest`), the best copied to the export folder; its report
    (pointing at the export), the contest's metadata and the winner's decode (None: not decoded)."""
    from eagle3_assets.stages.eagle3_drafter.kind_contest import candidate_dir, choose, contest_frame, publish

    decode = decodable(config, folder)
    results: list[KindResult] = []
    reports: dict[str, DrafterReport] = {}
    qualities: dict[str, SpeculativeQuality | None] = {}
    for kind in config.drafter_kinds:
        context.log.info(f"drafter kinds: training {kind} ({len(reports) + 1} of {len(config.drafter_kinds)})")
        one = config.model_copy(update={"drafter_kind": kind, "drafter_kinds": []})
        reports[kind] = train_in_this_process(
            context, one, store, folder, target, tokenizer, merged, out_dir=candidate_dir(store.layout.drafter(), kind)
        )
        exported = reports[kind].checkpoint
        qualities[kind] = decode_export(context, config, exported, merged, target, tokenizer) if decode else None
        results.append(kind_result(reports[kind], qualities[kind]))
    chosen, why = choose(results)
    publish(chosen, store.layout.drafter())
    table = contest_frame(results, chosen)
    context.log.info(f"drafter kinds: exporting {chosen.kind}, {why}\n{table}")
    report = dataclasses.replace(reports[chosen.kind], checkpoint=store.layout.drafter())
    metadata = {
        "kinds_compared": markdown_table(table, rows=table.height),
        "kinds_exported": chosen.kind,
        "kinds_chosen_by": why,
        "kinds_results": json_value([r.to_metadata() for r in results]),
    }
    return report, metadata, qualities[chosen.kind]


def decodable(config: DrafterTrainConfig, folder: Path) -> bool:
    """Whether drafters are decoded with the target here: asked for, and a target within the size limit."""
    from eagle3_assets.stages.eagle3_drafter.quality import target_weight_bytes

    return config.spec_eval_prompts > 0 and target_weight_bytes(folder) <= config.spec_eval_max_target_gb * 1e9


def decode_export(
    context: dg.AssetExecutionContext,
    config: DrafterTrainConfig,
    checkpoint: Path,
    merged: pl.DataFrame,
    target: TargetModelResource,
    tokenizer: TokenizerResource,
) -> "SpeculativeQuality":
    """The exported drafter at `checkpoint` and an untrained one decoded with the target (the lossless loop)."""
    from eagle3_assets.stages.eagle3_drafter.export import trained_layer_ids
    from eagle3_assets.stages.eagle3_drafter.quality import DecodeEval, measure_speculative

    how = DecodeEval(
        prompts=config.spec_eval_prompts,
        max_new_tokens=config.spec_eval_new_tokens,
        draft_steps=config.spec_draft_steps,
        seed=config.seed,
        # re-read from the exported files, as a server reads them, not the report's copy
        aux_layer_ids=trained_layer_ids(json.loads((checkpoint / "config.json").read_text())),
        proxy=target.path is None,
    )
    model = target.load_model(tokenizer, context.log.info)
    return measure_speculative(model, checkpoint, merged, how, context.log.info)


def kind_result(report: "DrafterReport", quality: "SpeculativeQuality | None") -> "KindResult":
    """One trained kind's figures (`quality`: its export decoded; None: not decoded)."""
    from eagle3_assets.stages.eagle3_drafter.export import drafter_config_from_json
    from eagle3_assets.stages.eagle3_drafter.kind_contest import KindResult

    figures = quality.figures() if quality is not None else None
    kind = drafter_config_from_json(report.config)
    return KindResult(
        kind=kind.drafter_kind,
        checkpoint=report.checkpoint,
        real=figures["accept_length_real"] if figures else None,
        real_untrained=figures["accept_length_real_untrained"] if figures else None,
        by_prompt_kind={k: v["trained"] for k, v in quality.by_kind().items()} if quality is not None else {},
        simulated=report.trained["accept_length"],
        tokens_per_s=report.history.tokens_per_s,
        train_seconds=round(report.history.seconds, 1),
        kv_bytes_per_token=kind.kv_bytes_per_token(),
    )


def train_in_this_process(
    context: dg.AssetExecutionContext,
    config: DrafterTrainConfig,
    store: DataStore,
    folder: Path,
    target: TargetModelResource,
    tokenizer: TokenizerResource,
    merged: pl.DataFrame,
    out_dir: Path | None = None,
) -> "DrafterReport":
    """`run_drafter_job` here, on the store's states, or online on the target loaded here; exported to `out_dir`
    (default: the store's drafter folder)."""
    from eagle3_assets.stages.eagle3_drafter.best_checkpoint import BestCheckpointPlan
    from eagle3_assets.stages.eagle3_drafter.pipeline import DrafterJob, run_drafter_job

    backend = None
    if config.online:
        from eagle3_resources.hidden_states.transformers_backend import (
            TransformersHiddenStates,
        )

        backend = TransformersHiddenStates(target.load_model(tokenizer, context.log.info))
    best = None
    if config.best_every > 0:
        best = BestCheckpointPlan(
            every=config.best_every,
            target=target.load_model(tokenizer, context.log.info),
            prompts_per_kind=config.best_prompts_per_kind,
            max_new_tokens=config.spec_eval_new_tokens,
            draft_steps=config.spec_draft_steps,
        )
    report = run_drafter_job(
        DrafterJob(
            None if config.online else store.layout.hidden_states(),
            merged,
            folder,
            out_dir or store.layout.drafter(),
            config.settings(),
            config.draft_vocab_size,
            context.log.info,
            device=config.device,
            online_backend=backend,
            init_from=Path(config.init_from) if config.init_from else None,
            best=best,
        )
    )
    if report is None:  # only another rank, or a run stopped early, has none; this is the only rank, run whole
        raise RuntimeError("drafter training returned no report")
    return report


def refuse_streaming_shape(config: DrafterTrainConfig) -> None:
    """What streaming mode cannot do, refused before a spool or a process exists."""
    if config.online:
        raise DrafterError("streaming mode (streaming_spool_gb) trains from its spool: not with online (set one)")
    if config.streaming_sides not in ("local", "kubernetes"):
        raise DrafterError(
            f"streaming_sides: {config.streaming_sides!r}: `local` runs both sides on the step's machine, "
            "`kubernetes` each as a Job"
        )
    if config.streaming_nodes != 1 and config.streaming_sides != "kubernetes":
        raise DrafterError(
            f"streaming_nodes: {config.streaming_nodes} training nodes need `streaming_sides: kubernetes` (`local` "
            "runs the training side on the step's machine: set streaming_nodes: 1)"
        )


def streaming_request(
    context: dg.AssetExecutionContext,
    config: DrafterTrainConfig,
    backend: HiddenStatesResource,
    hidden: int | None = None,
) -> "StreamingRequest":
    """The spool and the plan's rates, each labelled (measured: its source; assumed): a rate declared in the config,
    else its measurement file's (`streaming_rates`), else the last materialization's measured figure (refused when
    there is none); the spool's from its gpu-check file, else `streaming_spool_gb_s`. `hidden`: the target's width,
    which a device check's training figure must have been measured at."""
    from eagle3_assets.stages.eagle3_drafter import streaming_rates
    from eagle3_assets.stages.eagle3_drafter.streaming import StreamingRequest

    rates, source = {}, {}
    files = {
        "capture_tok_s": (config.streaming_capture_gpu_check, streaming_rates.capture_rate),
        "train_tok_s": (
            config.streaming_train_device_check,
            lambda path: streaming_rates.training_rate(path, config.processes, hidden),
        ),
    }
    for name, value, asset_key, key in (
        ("capture_tok_s", config.streaming_capture_tok_s, "hidden_states", "tokens_per_s"),
        ("train_tok_s", config.streaming_train_tok_s, "eagle3_drafter", "train_tokens_per_s"),
    ):
        path, read = files[name]
        if value is not None and path is not None:
            raise DrafterError(f"streaming_{name} and its measurement file {path} are both set: set one")
        if value is not None:
            rates[name], source[name] = float(value), "assumed (declared in the config)"
            continue
        if path is not None:
            try:
                rates[name], source[name] = read(path)
            except streaming_rates.RateUnreadable as e:
                raise DrafterError(f"the streaming plan's {name}: {e}") from None
            continue
        event = context.instance.get_latest_materialization_event(dg.AssetKey(asset_key))
        meta = event.asset_materialization.metadata if event and event.asset_materialization else {}
        if key not in meta:
            raise DrafterError(
                f"the streaming plan needs streaming_{name}: no {asset_key} materialization measured {key}; set it"
            )
        rates[name], source[name] = float(meta[key].value), f"measured: {asset_key}'s last materialization's {key}"
    spool_rate, spool_source = config.streaming_spool_gb_s * 1e9, "assumed (streaming_spool_gb_s)"
    if config.streaming_spool_gpu_check is not None:
        try:
            spool_rate, spool_source = streaming_rates.spool_rate(config.streaming_spool_gpu_check)
        except streaming_rates.RateUnreadable as e:
            raise DrafterError(f"the streaming plan's spool rate: {e}") from None
    sglang = backend.backend is HiddenStatesBackendKind.SGLANG
    return StreamingRequest(
        spool_bytes=int(config.streaming_spool_gb * 1e9) if config.streaming_spool_gb is not None else 0,
        passes=config.streaming_passes,
        shard_bytes=int(config.streaming_shard_gb * 1e9),
        capture_tok_s=rates["capture_tok_s"],
        train_tok_s=rates["train_tok_s"],
        spool_bytes_per_s=spool_rate,
        rates_source=source,
        spool_source=spool_source,
        reads_per_byte=config.streaming_reads_per_byte,
        capture_gpus=backend.sglang_tp_size if sglang else 1,
        mix_shards=config.streaming_mix_shards,
        prefetch_steps=config.streaming_prefetch_steps,
    )


def streaming_job(
    context: dg.AssetExecutionContext,
    config: DrafterTrainConfig,
    store: DataStore,
    folder: Path,
    merged: pl.DataFrame,
    resources: tuple[TargetModelResource, TokenizerResource, HiddenStatesResource],
) -> "StreamingJob":
    """The streaming run the config asks for: its rates declared or measured (the last materializations'), the
    capture's resources as their config (the capture process builds the backend `hidden_states` builds)."""
    from eagle3_assets.stages.eagle3_drafter.streaming import StreamingJob, target_hidden_size

    refuse_streaming_shape(config)
    target, tokenizer, backend = resources
    request = streaming_request(context, config, backend, target_hidden_size(folder))
    best = best_section(config, target, tokenizer)

    def observe(figures: dict) -> None:
        context.log_event(
            dg.AssetObservation(
                asset_key=context.assets_def.key,
                description=f"streaming progress of run {context.run_id[:8]}",
                metadata=figures,
            )
        )

    return StreamingJob(
        merged=merged,
        merged_path=store.layout.merged_dataset(),
        target_folder=folder,
        out_dir=store.layout.drafter(),
        settings=config.settings(),
        requested_draft_vocab=config.draft_vocab_size,
        request=request,
        identity=target_identity(folder),
        resources={
            "target": target.model_dump(mode="json"),
            "tokenizer": tokenizer.model_dump(mode="json"),
            "hidden_states_backend": backend.model_dump(mode="json"),
        },
        log=context.log.info,
        observe=observe,
        device=config.device,
        init_from=Path(config.init_from) if config.init_from else None,
        launcher=sides_launcher(context, config, request.capture_gpus),
        processes=config.processes,
        nodes=config.streaming_nodes,
        best=best,
        spool_dir=Path(config.streaming_spool_dir) if config.streaming_spool_dir else None,
        orphan_after_s=config.streaming_orphan_after_s,
    )


def sides_launcher(context: dg.AssetExecutionContext, config: DrafterTrainConfig, capture_gpus: int) -> SidesLauncher:
    """Where the streaming sides run: this machine, or Kubernetes Jobs started from this step's pod."""
    if config.streaming_sides == "kubernetes":
        # dagster-k8s and the kubernetes client are the `k8s` extra (in the images): imported here, not at load
        from eagle3_assets.stages.eagle3_drafter.streaming_k8s import kubernetes_sides

        return kubernetes_sides(context, capture_gpus=capture_gpus)
    return LocalSides()


def best_section(config: DrafterTrainConfig, target: TargetModelResource, tokenizer: TokenizerResource) -> dict | None:
    """The best-checkpoint keeper's section of a training process's spec (`best_checkpoint.plan_from_spec`; None:
    off): offline under torchrun and the streaming training side."""
    if config.best_every <= 0:
        return None
    return {
        "every": config.best_every,
        "prompts_per_kind": config.best_prompts_per_kind,
        "max_new_tokens": config.spec_eval_new_tokens,
        "draft_steps": config.spec_draft_steps,
        "target": target.model_dump(mode="json"),
        "tokenizer": tokenizer.model_dump(mode="json"),
    }


def refuse_best_checkpoint(config: DrafterTrainConfig, folder: Path) -> None:
    """`best_every` needs the target decoding beside the trainer (rank 0's, with several processes): a target within
    the size limit."""
    if config.best_every <= 0:
        return
    from eagle3_assets.stages.eagle3_drafter.quality import target_weight_bytes

    weights_gb = target_weight_bytes(folder) / 1e9
    if weights_gb > config.spec_eval_max_target_gb:
        raise DrafterError(
            f"best_every={config.best_every} decodes with the target beside the trainer; its weights are "
            f"{weights_gb:.1f} GB, over spec_eval_max_target_gb={config.spec_eval_max_target_gb} (set best_every: 0)"
        )


def best_checkpoint_metadata(report: "DrafterReport") -> dict:
    """The best-checkpoint keeper's curve (real accept length per kind at each evaluated step), its picture, and
    which step was exported (nothing when the keeper was off)."""
    summary = report.best_checkpoint
    if summary is None or summary["best"] is None:
        return {}
    best = summary["best"]
    return {
        "best_checkpoint_step": best["step"],
        "best_checkpoint_accept_length": best["accept_length"],
        "best_checkpoint_by_kind": json_value(best["by_kind"]),
        "best_checkpoint_last_step_accept_length": summary["curve"][-1]["accept_length"],
        "best_checkpoint_source": FIGURE_SOURCES["best_checkpoint"],
        "accept_length_curve": json_value(summary),
        "accept_length_curve_plot": png_markdown(best_checkpoint_plot(summary)),
    }


def evaluation_metadata(report: "DrafterReport", history: list[dict], real: dict | None = None) -> dict:
    """The trained drafter's simulated per-step acceptance, its loss curves, and the quality over
    materializations."""
    per_step = pl.DataFrame(
        {
            "draft_step": list(range(1, len(report.trained["acc"]) + 1)),
            "acc_trained": report.trained["acc"],
            "acc_untrained": report.untrained["acc"],
        }
    )
    positions = {f"acceptance_step_{i}": round(a, 4) for i, a in enumerate(report.trained["acc"], start=1)}
    return {
        **positions,
        "quality_over_materializations": png_markdown(history_plot(history, report, real)),
        "accept_length_product": report.trained["accept_length_product"],
        "eval_split": report.eval_split,
        "eval_positions": report.trained["positions"],
        "per_step_accuracy": markdown_table(per_step, rows=len(per_step)),
        "training_plot": png_markdown(training_plot(report)),
        "final_loss": report.history.step_loss[-1],
        "loss_curve": png_markdown(loss_plot(report.history.step_loss)),
        "loss_per_step": json_value(report.history.step_loss),
        "loss_by_ttt_step": png_markdown(ttt_loss_plot(report.history.step_loss_by_ttt)),
    }


def decoding_metadata(report: "DrafterReport", quality: "SpeculativeQuality | None") -> dict:
    """Real speculative decoding's reports, trained and untrained, and its picture against the simulated figures
    (nothing when it did not run)."""
    if quality is None:
        return {}
    reports = {n: r.to_metadata() for n, r in (("trained", quality.trained), ("untrained", quality.untrained))}
    return {
        "speculative_decoding": json_value(reports),
        "real_vs_simulated": png_markdown(acceptance_plot(report, quality)),
    }


def training_metadata(report: "DrafterReport") -> dict:
    """What was trained, where, and how fast."""
    from eagle3_assets.stages.eagle3_drafter.export import drafter_config_from_json

    h = report.history
    kind = drafter_config_from_json(report.config)
    return {
        "drafter_kind": kind.drafter_kind,  # model.DRAFTER_KINDS
        "draft_kv_bytes_per_token": kind.kv_bytes_per_token(),  # the served draft's KV cache, bf16, one layer
        "train_tokens": report.train_tokens,
        "samples_cut_into_windows": report.split_samples,
        "train_windows": report.windows,
        "learning_rate": h.lr,
        "train_device": h.device,
        "train_processes": h.world_size,
        **({"resumed_from_step": h.resumed_from_step} if h.resumed_from_step else {}),
        "train_samples": report.train_samples,
        "eval_samples": report.eval_samples,
        "draft_vocab_size": report.draft_vocab_size,
        "train_seconds": round(h.seconds, 1),
        "train_tokens_per_s": h.tokens_per_s,  # all processes, training steps only
        "train_gflop_per_token": round(h.flops_per_token / 1e9, 4),  # model.train_flops_per_token
        "train_later_steps_share": h.later_steps_share,  # positions TTT steps >= 1 ran over (model.loss_rows)
        **({"train_mfu": h.mfu} if h.mfu is not None else {}),  # per GPU, of its bf16 peak
    }
