"""`eagle3_drafter`: a trained EAGLE-3 drafter in SGLang's `LlamaForCausalLMEagle3` format."""


import dagster as dg
import polars as pl
from pydantic import Field

from eagle3_assets.assets.hidden_states import hidden_states
from eagle3_assets.checks.outcome import check_specs, to_results
from eagle3_assets.checks.training import (
    DRAFTER_CHECKS,
    drafter_accept_length,
    drafter_keys,
)
from eagle3_assets.drafter.export import check_checkpoint
from eagle3_assets.drafter.pipeline import DrafterReport, train_drafter
from eagle3_assets.drafter.train import TrainSettings
from eagle3_assets.metadata import json_value, markdown_table, path_value, png_markdown
from eagle3_resources.storage import DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource


class DrafterTrainConfig(dg.Config):
    draft_vocab_size: int = Field(default=32000, description="draft vocabulary; capped at the distinct loss tokens seen")
    ttt_steps: int = Field(default=7, description="training-time-test unroll length (SpecForge/EAGLE: 7)")
    step_decay: float = Field(default=0.8, description="loss weight of TTT step k is decay**k")
    epochs: int = Field(default=6, description="passes over the training split")
    lr: float = Field(default=2e-3, description="AdamW peak learning rate (warmup, then cosine)")
    sequences_per_step: int = Field(default=4, description="sequences per optimizer step")
    max_len: int = Field(default=512, description="train on each sample's last max_len tokens")
    seed: int = Field(default=0, description="initialisation and shuffling seed")
    min_accept_length: float = Field(default=1.5, description="the accept_length check warns below this")

    def settings(self) -> TrainSettings:
        return TrainSettings(ttt_steps=self.ttt_steps, step_decay=self.step_decay, epochs=self.epochs, lr=self.lr,
                             sequences_per_step=self.sequences_per_step, max_len=self.max_len, seed=self.seed)


def training_plot(report: DrafterReport):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3))
    ax1.plot(report.history.step_loss, lw=1)
    ax1.set_title("training loss (TTT-weighted)")
    ax1.set_xlabel("optimizer step")
    steps = range(1, len(report.trained["acc"]) + 1)
    ax2.plot(steps, report.trained["acc"], marker="o", label=f"trained (accept {report.trained['accept_length']:.2f})")
    ax2.plot(steps, report.untrained["acc"], marker="x", label=f"untrained (accept {report.untrained['accept_length']:.2f})")
    ax2.set_title(f"per-step accuracy on the {report.eval_split} split")
    ax2.set_xlabel("draft step")
    ax2.set_ylim(0, 1)
    ax2.legend()
    plt.close(fig)
    return fig


@dg.asset(
    check_specs=check_specs("eagle3_drafter", DRAFTER_CHECKS, blocking={"sglang_keys"}),
    deps=[hidden_states],
    group_name="training",
    pool="gpu",
    kinds={"pytorch", "safetensors"},
    description="One-layer EAGLE-3 drafter trained with training-time test on the stored hidden states; exported "
    "as config.json + bf16 safetensors with exactly the keys SGLang's LlamaForCausalLMEagle3 loads (checked).",
)
def eagle3_drafter(
    context: dg.AssetExecutionContext, config: DrafterTrainConfig, store: DataStore,
    tokenizer: TokenizerResource, target: TargetModelResource,
) -> dg.MaterializeResult:
    merged = pl.read_parquet(store.layout.merged_dataset())
    report = train_drafter(
        store.layout.hidden_states(), merged, target.folder(tokenizer, context.log.info), store.layout.drafter(),
        config.settings(), config.draft_vocab_size, context.log.info,
    )
    problems = check_checkpoint(report.checkpoint)
    outcomes = {
        "sglang_keys": drafter_keys(report.checkpoint),
        "accept_length": drafter_accept_length(report.trained["accept_length"], report.untrained["accept_length"], config.min_accept_length),
    }
    per_step = pl.DataFrame({
        "draft_step": list(range(1, len(report.trained["acc"]) + 1)),
        "acc_trained": report.trained["acc"],
        "acc_untrained": report.untrained["acc"],
    })
    return dg.MaterializeResult(
        check_results=to_results(DRAFTER_CHECKS, outcomes),
        metadata={
            "accept_length": report.trained["accept_length"],
            "accept_length_untrained": report.untrained["accept_length"],
            "accept_length_product": report.trained["accept_length_product"],
            "eval_split": report.eval_split,
            "eval_positions": report.trained["positions"],
            "per_step_accuracy": markdown_table(per_step, rows=len(per_step)),
            "training_plot": png_markdown(training_plot(report)),
            "final_loss": report.history.step_loss[-1],
            "loss_curve": json_value(report.history.step_loss),
            "train_samples": report.train_samples,
            "eval_samples": report.eval_samples,
            "draft_vocab_size": report.draft_vocab_size,
            "train_seconds": round(report.history.seconds, 1),
            "sglang_key_check": "ok" if not problems else "; ".join(problems),
            "config": json_value(report.config),
            "path": path_value(report.checkpoint),
        }
    )
