"""Hidden states from the target on GPUs with SGLang's model runner (the `[sglang]` extra).

SGLang's HTTP server returns only the final hidden state, so, like SpecForge's offline data
preparation, this loads the target in-process with SGLang's `ModelRunner` (tensor parallel over
the host's GPUs), asks the model to capture the EAGLE-3 layers (`set_eagle3_layers_to_capture`,
which SGLang's DeepseekV2/Kimi implementation supports) and runs one prefill ("extend") per batch
with `CaptureHiddenMode.FULL`. The logits processor is wrapped so that its input, the final
hidden state after the model's norm, is kept too.

sglang is imported only here and only when this backend is built; it needs CUDA. SGLang's
internal API moves between releases: this follows the 0.5 series. It cannot run on the CPU
machines the tests and CI use, and has not yet been run against a GPU host.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3_resources.hidden_states.layers import eagle3_aux_layers


class SGLangHiddenStates:
    name = "sglang"

    def __init__(self, model_path: str, *, tp_size: int = 8, layer_ids: list[int] | None = None,
                 max_length: int = 32768, mem_fraction_static: float = 0.8, trust_remote_code: bool = True):
        try:
            from sglang.bench_one_batch import load_model
            from sglang.srt.layers.logits_processor import LogitsProcessor
            from sglang.srt.server_args import PortArgs, ServerArgs
            from transformers import AutoConfig
        except ImportError as e:  # pragma: no cover - needs the [sglang] extra and CUDA
            raise ImportError("the sglang hidden-states backend needs `pip install -e '.[sglang]'` on a CUDA host") from e

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        text_config = getattr(config, "text_config", config)
        self.num_layers = text_config.num_hidden_layers
        self.hidden_size = text_config.hidden_size
        self.layer_ids = layer_ids or eagle3_aux_layers(self.num_layers)

        server_args = ServerArgs(
            model_path=model_path, tp_size=tp_size, trust_remote_code=trust_remote_code,
            enable_return_hidden_states=True, context_length=max_length,
            mem_fraction_static=mem_fraction_static, disable_cuda_graph=True,
        )
        port_args = PortArgs.init_new(server_args)
        self.model_runner, _ = load_model(server_args, port_args, 0)
        model = self.model_runner.model
        if not hasattr(model, "set_eagle3_layers_to_capture"):
            raise ValueError(f"{type(model).__name__} in this SGLang cannot capture EAGLE-3 layers")
        model.set_eagle3_layers_to_capture(self.layer_ids)

        class KeepFinalHidden(torch.nn.Module):
            """Keeps the logits processor's input (post-norm final hidden state) on its output."""

            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
                out = self.inner(input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states)
                out.last_hidden_states = hidden_states
                return out

        for name, sub in list(model.named_modules()):
            if isinstance(sub, LogitsProcessor):
                parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                setattr(parent, name.rsplit(".", 1)[-1], KeepFinalHidden(sub))

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "num_layers": self.num_layers, "hidden_size": self.hidden_size}

    @torch.no_grad()
    def extract_batch(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardBatch,
        )
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        params = SamplingParams(temperature=0, max_new_tokens=1, top_k=1)
        reqs = []
        for i, ids in enumerate(sequences):
            req = Req(rid=str(i), origin_input_text="", origin_input_ids=list(ids), sampling_params=params)
            req.prefix_indices = []
            req.fill_ids = req.origin_input_ids
            req.extend_input_len = len(req.fill_ids)
            req.logprob_start_len = len(req.origin_input_ids) - 1
            reqs.append(req)
        runner = self.model_runner
        batch = ScheduleBatch.init_new(
            reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator, tree_cache=None,
            model_config=runner.model_config, enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        forward_batch = ForwardBatch.init_new(batch.get_model_worker_batch(), runner)
        forward_batch.capture_hidden_mode = CaptureHiddenMode.FULL
        output = runner.forward(forward_batch)
        logits_output = output[0] if isinstance(output, tuple) else getattr(output, "logits_output", output)
        lens = [len(s) for s in sequences]
        aux = torch.split(logits_output.hidden_states, lens, dim=0)
        final = torch.split(logits_output.last_hidden_states, lens, dim=0)
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        return [(a.cpu(), f.cpu()) for a, f in zip(aux, final)]

    def extract(self, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.extract_batch([input_ids])[0]
