"""Worker of benchmarks/drafter_kinds.py: trains vLLM speculators' EAGLE-3 draft (speculators 0.9.0) on samples this
project's store handed it, with speculators' own model, data shift, collate, loss and `Trainer`, and saves its weights.

Runs in its own virtual environment (speculators pins transformers <= 5.19 and torch <= 2.14.1; the project's venv
has neither pin), so it imports only speculators, transformers, torch and safetensors; never the project:

    .venv-speculators/bin/python benchmarks/speculators_worker.py JOB_DIR

JOB_DIR holds `job.json` (the model's shape, the budget, the steps of every epoch as window indices) and
`samples.safetensors` (the training windows concatenated: `aux` [N, 3H] and `final` [N, H] as stored, `input_ids`,
`loss_mask`, window `offsets`; the draft vocabulary's `t2d` / `d2t`; a `probe_*` window for the logits check). It
writes `weights.safetensors` (the draft's state dict), `probe_logits.safetensors` (the draft's logits at every TTT
step on the probe window: the caller checks its own model agrees once the weights are mapped) and `result.json`.

What is speculators' and what is adapted, and why (each also said in the caller's docs):
- the model is `Eagle3DraftModel.from_training_args` (their CLI's path) with a Llama decoder layer of the caller's
  `eagle3_llama` shape, `norm_before_residual`, `norm_before_fc` and `norm_output` off (their CLI turns them on for
  eagle3; off is the layout of SGLang's LlamaForCausalLMEagle3 and of the caller's drafter), attention `sdpa` (their
  option for hardware without flex attention); embedding, draft lm_head and teacher head from the target folder
  (`load_verifier_weights`: their lm_head is the target's draft rows, frozen);
- `verifier_norm` is the identity: the project's store keeps the target's post-norm final hidden state, speculators'
  data generation the pre-norm one (their model applies the target's norm), so the teacher logits are the same
  target logits in both;
- each sample goes through their `shift_batch`, each step's samples through their `CollateFn` (its max_len the
  step's own length, so nothing is padded on the CPU), the steps those the caller's trainer took;
- their `Trainer.train_epoch` trains (forward with their TTT loss, `loss_fn` kl_div, eager; backward; their clip at
  1.0; AdamW from their `build_optimizers`; their scheduler), on the CPU: `get_local_rank` gives "cpu" (it gives 0,
  cuda:0) and `torch.accelerator.synchronize` is a no-op (their step timer calls it; a CPU-only torch raises).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


class StepSampler:
    """The caller's optimizer steps (window indices), epoch by epoch: the Trainer calls `set_epoch`."""

    def __init__(self, plans: list[list[list[int]]]):
        self.plans, self.epoch = plans, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(self.plans[self.epoch])

    def __len__(self) -> int:
        return len(self.plans[self.epoch])


class Windows(torch.utils.data.Dataset):
    """The windows as speculators' datasets hand samples to the collate (`BaseDataset.__getitem__`'s keys)."""

    def __init__(self, t: dict[str, torch.Tensor]):
        self.t, self.offsets = t, t["offsets"].tolist()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return sample(self.t["aux"][a:b], self.t["input_ids"][a:b], self.t["final"][a:b], self.t["loss_mask"][a:b])


def sample(aux: torch.Tensor, ids: torch.Tensor, final: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    n = ids.shape[0]
    return {
        "hidden_states": aux.float(),
        "input_ids": ids.long(),
        "verifier_last_hidden_states": final.float(),
        "loss_mask": mask.bool(),
        "lengths": torch.tensor([n], dtype=torch.long),
        "position_ids": torch.arange(n, dtype=torch.long),
    }


def collate(hidden: int):
    """Speculators' CollateFn with `shift_batch`, its max_len each step's own length (no padding on the CPU)."""
    from speculators.models.eagle3 import shift_batch
    from speculators.train.data import CollateFn

    def run(batch: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        total = sum(int(b["lengths"][0]) - 1 for b in batch)
        return CollateFn(total, hidden, 3, torch.float32, preprocess=shift_batch)(batch)

    return run


def build_model(job: dict[str, Any], t: dict[str, torch.Tensor]):
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import LlamaConfig

    s = job["shape"]
    layer = LlamaConfig(
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"],
        head_dim=s["head_dim"],
        num_hidden_layers=1,
        vocab_size=s["vocab_size"],
        rms_norm_eps=s["rms_norm_eps"],
        max_position_embeddings=s["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]},
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    torch.manual_seed(job["seed"])
    model = Eagle3DraftModel.from_training_args(
        layer,
        t2d=t["t2d"].bool(),
        d2t=t["d2t"].long(),
        target_layer_ids=job["aux_layer_ids"],
        verifier_name_or_path=job["target_folder"],
        draft_vocab_size=s["draft_vocab_size"],
        norm_before_residual=False,
        norm_before_fc=False,
        fc_norm=False,
        norm_output=False,
        ttt_steps=job["ttt_steps"],
        draft_attn_impl="sdpa",
    )
    model.verifier_norm = torch.nn.Identity()  # the store's final state is already post-norm (docstring)
    return model.float()


def cpu_patches() -> None:
    """Speculators' Trainer on the CPU (docstring): the model and batches to "cpu", the step timer's sync a no-op."""
    import speculators.train.trainer as trainer_module

    trainer_module.get_local_rank = lambda: "cpu"
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.synchronize = lambda *a, **k: None


class LossLog(logging.Handler):
    """The training loss of every step, from the records speculators' Trainer logs to `speculators.metrics`."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if isinstance(msg, dict) and "train" in msg and "loss" in msg["train"]:
            self.losses.append(float(msg["train"]["loss"]))


def train(job: dict[str, Any], t: dict[str, torch.Tensor], model, out: Path) -> dict[str, Any]:
    from speculators.train.trainer import Trainer, TrainerConfig

    cpu_patches()
    loader = torch.utils.data.DataLoader(
        Windows(t), batch_sampler=StepSampler(job["plans"]), collate_fn=collate(job["shape"]["hidden_size"])
    )
    train_kwargs, _ = type(model).get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=job["ttt_steps"], ttt_step_loss_decay=job["step_decay"]
    )
    config = TrainerConfig(
        lr=job["lr"],
        num_epochs=job["epochs"],
        save_path=str(out / "checkpoints"),
        train_call_kwargs=train_kwargs,
        optimizer="adamw",
        weight_decay=0.0,
        scheduler_type="cosine",
        scheduler_warmup_steps=job["warmup_steps"],
        hidden_states_dtype=torch.float32,
    )
    trainer = Trainer(model, config, loader)
    losses = LossLog()
    logging.getLogger("speculators.metrics").addHandler(losses)
    logging.getLogger("speculators.metrics").setLevel(logging.INFO)
    seconds = 0.0
    for epoch in range(job["epochs"]):
        started = time.perf_counter()
        trainer.train_epoch(epoch)
        seconds += time.perf_counter() - started
    tokens = sum(job["window_lengths"][i] for plan in job["plans"] for step in plan for i in step)
    return {
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "steps": trainer.global_step,
        "final_loss": losses.losses[-1] if losses.losses else None,
        "losses": losses.losses,
    }


def probe_logits(model, t: dict[str, torch.Tensor], steps: int) -> dict[str, torch.Tensor]:
    """The draft's logits at each of `steps` TTT steps on the probe window (their forward, shifted by their
    `shift_batch`; an lm_head hook reads them: their forward returns only the argmax tokens without a teacher)."""
    batch = collate(int(t["probe_final"].shape[-1]))(
        [sample(t["probe_aux"], t["probe_ids"], t["probe_final"], torch.ones_like(t["probe_ids"]))]
    )
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    model.eval()
    with torch.no_grad():
        model(
            hidden_states=batch["hidden_states"],
            input_ids=batch["input_ids"],
            document_ids=batch["document_ids"],
            position_ids=batch["position_ids"],
            ttt_steps=steps,
        )
    hook.remove()
    return {f"step_{k}": x[0].contiguous() for k, x in enumerate(seen)}


def main() -> None:
    torch.set_num_threads(1)
    job_dir = Path(sys.argv[1])
    job = json.loads((job_dir / "job.json").read_text())
    t = load_file(str(job_dir / "samples.safetensors"))
    model = build_model(job, t)
    result = train(job, t, model, job_dir)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not k.startswith("verifier_")}
    save_file(weights, str(job_dir / "weights.safetensors"))
    save_file(probe_logits(model, t, job["probe_steps"]), str(job_dir / "probe_logits.safetensors"))
    import speculators

    result["speculators"] = getattr(speculators, "__version__", "0.9.0")
    result["trainable_parameters"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    (job_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
