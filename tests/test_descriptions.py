"""The words a user reads in the UI: every asset, check, sensor, job, schedule and config field says what it is,
every check says what to do when it fails, and special tokens are quoted as code (the UI's markdown would take
`</think>` for an HTML tag and show nothing)."""

import re
import typing

import dagster as dg
import pydantic
import pytest
from dagster._core.definitions.decorators.op_decorator import DecoratedOpFunction

from eagle3_assets.definitions import defs

SPECIAL = re.compile(r"<\|[^|<>\s]+\|>|</?think>")
CODE = re.compile(r"`[^`]*`")


def unquoted_special_tokens(text: str) -> list[str]:
    return SPECIAL.findall(CODE.sub("", text or ""))


def test_the_oracle_finds_an_unquoted_token_and_passes_a_quoted_one():
    assert unquoted_special_tokens("(reasoning, </think>, content, <|im_end|>)") == ["</think>", "<|im_end|>"]
    assert unquoted_special_tokens("(reasoning, `</think>`, content, `<|im_end|>`)") == []


def config_fields(model: type[pydantic.BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        inner = field.annotation
        if isinstance(inner, type) and issubclass(inner, pydantic.BaseModel):
            yield from config_fields(inner, f"{prefix}{name}.")


def described():
    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        yield f"asset {key.to_user_string()}", graph.get(key).description
    for check_key in graph.asset_check_keys:
        spec = graph.get_check_spec(check_key) if hasattr(graph, "get_check_spec") else graph.get(check_key)
        yield f"check {check_key.to_user_string()}", spec.description
    assert defs.sensors is not None and defs.schedules is not None and defs.resources is not None
    for sensor in defs.sensors:
        yield f"sensor {sensor.name}", sensor.description
    for schedule in defs.schedules:
        yield f"schedule {schedule.name}", schedule.description
    for job in defs.resolve_all_job_defs():
        if not job.name.startswith("__"):
            yield f"job {job.name}", job.description
    for node in graph.get_all_asset_keys():
        if not graph.get(node).is_executable:
            continue
        compute_fn = graph.get(node).assets_def.op.compute_fn
        assert isinstance(compute_fn, DecoratedOpFunction), node  # every asset here is a decorated function
        model = typing.get_type_hints(compute_fn.decorated_fn).get("config")
        if isinstance(model, type) and issubclass(model, dg.Config):
            for name, field in config_fields(model):
                yield f"config {node.to_user_string()}.{name}", field.description
    for name, resource in defs.resources.items():
        if isinstance(resource, dg.ConfigurableResource):
            for field_name, field in config_fields(type(resource)):
                yield f"resource {name}.{field_name}", field.description


@pytest.mark.timeout(600)
def test_every_name_a_user_reads_has_a_description_with_special_tokens_quoted():
    seen = dict(described())
    assert {k for k in seen if k.startswith("config completions.")} >= {
        "config completions.max_run_usd",
        "config completions.provider.order",
    }
    missing = [what for what, text in seen.items() if not (text or "").strip()]
    assert not missing, f"no description: {missing}"
    unquoted = {what: unquoted_special_tokens(text) for what, text in seen.items() if unquoted_special_tokens(text)}
    assert not unquoted, f"special tokens not quoted as code: {unquoted}"


@pytest.mark.timeout(600)
def test_every_check_says_what_to_do_when_it_fails():
    checks = {what: text for what, text in described() if what.startswith("check ")}
    assert len(checks) >= 15
    vague = [what for what, text in checks.items() if "When it fails" not in text and "When it\n" not in text]
    assert not vague, f"checks that do not say what to do when they fail: {vague}"
