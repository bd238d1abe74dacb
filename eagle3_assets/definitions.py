"""The code location: assets, job and resources, configured from the environment.

Embedded defaults need nothing: the stand-in tokenizer and target are built under the data root
and completions are generated in-process. Environment variables point the same code at real
systems (README: "Pointing it at real systems"):

    EAGLE3_DATA_DIR              data root (default: var/data in the checkout)
    EAGLE3_TOKENIZER_DIR         a Kimi-K2.5 tokenizer folder (default: the stand-in)
    EAGLE3_TARGET_DIR            a Hugging Face model folder (default: the stand-in)
    EAGLE3_COMPLETIONS_BACKEND   local | openrouter | sglang (default: local)
    OPENROUTER_API_KEY           bound with EnvVar: never shown in the UI, logs or run config
    OPENROUTER_BASE_URL          default https://openrouter.ai/api/v1 (the fake server: http://127.0.0.1:PORT/api/v1)
    EAGLE3_SGLANG_URL            SGLang server for completions (default http://127.0.0.1:30000)
    EAGLE3_HIDDEN_STATES_BACKEND transformers | sglang (default: transformers)
"""

from __future__ import annotations

import os

import dagster as dg

from eagle3_assets.assets import PIPELINE_ASSETS
from eagle3_assets.jobs import eagle3_pipeline
from eagle3_resources.completions.resource import CompletionsResource
from eagle3_resources.hidden_states.resource import HiddenStatesResource
from eagle3_resources.storage import DataStore, default_data_dir
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource


def _env_or_none(name: str):
    """An EnvVar binding when the variable is set, so its value is resolved late and never shown."""
    return dg.EnvVar(name) if os.environ.get(name) else None


def completions_resource() -> CompletionsResource:
    kwargs = {"backend": os.environ.get("EAGLE3_COMPLETIONS_BACKEND", "local")}
    for field, var in (("openrouter_api_key", "OPENROUTER_API_KEY"), ("openrouter_base_url", "OPENROUTER_BASE_URL"),
                       ("sglang_url", "EAGLE3_SGLANG_URL")):
        if (value := _env_or_none(var)) is not None:
            kwargs[field] = value
    return CompletionsResource(**kwargs)


def resources() -> dict:
    data_dir = default_data_dir()
    standin = str(data_dir / "standin")
    return {
        "store": DataStore(root=str(data_dir)),
        "tokenizer": TokenizerResource(path=os.environ.get("EAGLE3_TOKENIZER_DIR") or None, standin_dir=standin),
        "target": TargetModelResource(path=os.environ.get("EAGLE3_TARGET_DIR") or None, standin_dir=standin),
        "completions_backend": completions_resource(),
        "hidden_states_backend": HiddenStatesResource(backend=os.environ.get("EAGLE3_HIDDEN_STATES_BACKEND", "transformers")),
    }


defs = dg.Definitions(assets=PIPELINE_ASSETS, jobs=[eagle3_pipeline], resources=resources())
