"""The code location: assets, job and resources, configured from the environment.

Embedded defaults need nothing: the stand-in tokenizer and target are built under the data root
and completions are generated in-process. Environment variables point the same code at real
systems (docs/configuration.md, "Pointing it at real systems"):

    EAGLE3_DATA_DIR              data root (default: var/data in the checkout)
    EAGLE3_TOKENIZER_DIR         a Kimi-K2.5 tokenizer folder (default: the stand-in)
    EAGLE3_TARGET_DIR            a Hugging Face model folder (default: the stand-in)
    EAGLE3_COMPLETIONS_BACKEND   local | openrouter | sglang (default: local)
    OPENROUTER_API_KEY           bound with EnvVar: never shown in the UI, logs or run config
    OPENROUTER_BASE_URL          default https://openrouter.ai/api/v1 (the fake server: http://127.0.0.1:PORT/api/v1)
    EAGLE3_SGLANG_URL            SGLang server for completions (default http://127.0.0.1:30000)
    EAGLE3_HIDDEN_STATES_BACKEND transformers | sglang (default: transformers)
    EAGLE3_REGISTRY              another dataset registry file (default: data/datasets.yaml)
    EAGLE3_PROMPTS               sample (default: the shipped sample files) | real (import each dataset's source)
    EAGLE3_SOURCES_DIR           a local copy of the sources (<dir>/<hub id>/<files>); unset: the Hugging Face Hub
    EAGLE3_MIN_BALANCE_USD, EAGLE3_MAX_RUN_USD, EAGLE3_MAX_DAY_USD, EAGLE3_MAX_TOTAL_USD
                                 spend thresholds (credit sensor and client); unset = not enforced
    EAGLE3_HOLD_MODE             drain (default) | cancel: requests in flight when the hold is set
    EAGLE3_UNSETTLED_HORIZON_S   how long a started generation without a bill is looked up (default 900)
    EAGLE3_LEDGER_TOLERANCE_USD  account-vs-ledger drift that is alerted (default 1.0)
    EAGLE3_ALERT_WEBHOOK_URL     a Slack-compatible webhook for alerts (default: the run log only)
    EAGLE3_LEDGER_URL            the spend ledger in this PostgreSQL database (several hosts);
                                 unset: SQLite in the data root
    EAGLE3_EXECUTOR              k8s: each step its own Kubernetes Job, sized by its stage's tag
                                 (eagle3_assets/common/k8s.py, with the EAGLE3_K8S_* pod settings);
                                 unset: Dagster's default

The completions backend and the spend policy read their variables when they are used, not only
here: a launchpad that configures one field of them keeps the others from the environment.
"""

from __future__ import annotations

import os
from typing import Any

import dagster as dg

from eagle3_assets.common.k8s import step_executor
from eagle3_assets.money import SpendPolicy
from eagle3_assets.money.asset import spend
from eagle3_assets.operations.jobs import drafter_streaming_job, eagle3_pipeline, import_prompts, lift_spend_hold
from eagle3_assets.operations.quality import pipeline_status, status_board
from eagle3_assets.operations.schedules import missing_partitions_nightly
from eagle3_assets.operations.sensors import (
    check_failure_alert,
    credit_sensor,
    run_failure_alert,
)
from eagle3_assets.stages.pipeline import PIPELINE_ASSETS
from eagle3_resources.alerts import AlertSink
from eagle3_resources.completions.resource import (
    CompletionsResource,
)
from eagle3_resources.hidden_states.resource import HiddenStatesResource
from eagle3_resources.storage import DataStore, default_data_dir
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource


def _env_or_none(name: str) -> dg.EnvVar | None:
    """An EnvVar binding when the variable is set, so its value is resolved late and never shown."""
    return dg.EnvVar(name) if os.environ.get(name) else None


def completions_resource() -> CompletionsResource:
    kwargs: dict[str, Any] = {"backend": os.environ.get("EAGLE3_COMPLETIONS_BACKEND", "local")}
    for field, var in (
        ("openrouter_api_key", "OPENROUTER_API_KEY"),
        ("openrouter_base_url", "OPENROUTER_BASE_URL"),
        ("sglang_url", "EAGLE3_SGLANG_URL"),
    ):
        if (value := _env_or_none(var)) is not None:
            kwargs[field] = value
    return CompletionsResource(**kwargs)


def hidden_states_resource() -> HiddenStatesResource:
    kwargs: dict[str, Any] = {"backend": os.environ.get("EAGLE3_HIDDEN_STATES_BACKEND", "transformers")}
    for field, var in (
        ("batch_tokens", "EAGLE3_HIDDEN_STATES_BATCH_TOKENS"),
        ("sglang_tp_size", "EAGLE3_SGLANG_TP_SIZE"),
        ("sglang_max_forward_tokens", "EAGLE3_SGLANG_MAX_FORWARD_TOKENS"),
    ):
        if os.environ.get(var):
            kwargs[field] = dg.EnvVar.int(var)
    if os.environ.get("EAGLE3_SGLANG_MEM_FRACTION"):  # dg.EnvVar has no float form; the value is no secret
        kwargs["sglang_mem_fraction"] = float(os.environ["EAGLE3_SGLANG_MEM_FRACTION"])
    return HiddenStatesResource(**kwargs)


def resources() -> dict[str, Any]:
    data_dir = default_data_dir()
    standin = str(data_dir / "standin")
    return {
        "store": DataStore(root=str(data_dir)),
        "tokenizer": TokenizerResource(path=os.environ.get("EAGLE3_TOKENIZER_DIR") or None, standin_dir=standin),
        "target": TargetModelResource(path=os.environ.get("EAGLE3_TARGET_DIR") or None, standin_dir=standin),
        "completions_backend": completions_resource(),
        "hidden_states_backend": hidden_states_resource(),
        "spend_policy": SpendPolicy(),  # every threshold from the environment, read at use time
        "alerts": AlertSink(webhook_url=_env_or_none("EAGLE3_ALERT_WEBHOOK_URL")),
    }


executor = step_executor()
defs = dg.Definitions(
    assets=[*PIPELINE_ASSETS, spend, pipeline_status],
    jobs=[eagle3_pipeline, import_prompts, lift_spend_hold, drafter_streaming_job(on_kubernetes=executor is not None)],
    sensors=[credit_sensor, run_failure_alert, check_failure_alert, status_board],
    schedules=[missing_partitions_nightly],
    resources=resources(),
    executor=executor,
)
