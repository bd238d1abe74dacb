"""The fake OpenRouter as an independent oracle, and its hostile behaviours, over real loopback HTTP.

The fake counts tokens and renders prompts with its own code (tests/fakes/openrouter/
encoding.py and template.py, written from Moonshot's public sources); here its bill is compared
with the project's tokenizer and chat format on every shipped prompt, so either side can be
caught wrong.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread
from fakes.openrouter.__main__ import parse_args
from fakes.openrouter.template import render_prompt

from eagle3_assets.common.registry import DATASETS
from eagle3_assets.stages.raw_prompts.prompts import prompts_frame, read_prompts, rendered_prompt_ids
from eagle3_resources.tokenizer.chat_format import TemplateVersion

KEY = "k-fake-tests"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "hi there"}]
# Three endpoints, USD per token: Moonshot (int4) dearest, Fireworks (fp8), DeepInfra (fp4) cheapest.
ENDPOINTS = [
    {"provider_name": "Moonshot AI", "quantization": "int4", "price_prompt": 0.6e-6, "price_completion": 2.5e-6},
    {"provider_name": "Fireworks", "quantization": "fp8", "price_prompt": 0.4e-6, "price_completion": 2.0e-6},
    {"provider_name": "DeepInfra", "quantization": "fp4", "price_prompt": 0.3e-6, "price_completion": 1.0e-6},
]


@contextlib.contextmanager
def serve(tokenizer, **settings):
    settings.setdefault("api_key", KEY)
    fake = FakeOpenRouter(tokenizer, FakeSettings(**settings))
    with (
        ServerThread(fake.app) as thread,
        httpx.Client(base_url=f"{thread.base_url}/api/v1", headers=AUTH, timeout=30) as client,
    ):
        yield fake, client


def chat(client, messages=HI, **body):
    return client.post("/chat/completions", json={"model": "moonshotai/kimi-k2.5", "messages": messages, **body})


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# -- independence ------------------------------------------------------------------------------


def test_the_fake_imports_nothing_from_the_project():
    code = (
        "import sys\n"
        "import fakes.openrouter.server, fakes.openrouter.__main__\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.startswith(('eagle3', 'fakes')))))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "fakes.openrouter.server" in loaded and not [m for m in loaded if m.startswith("eagle3")], loaded


def test_the_fake_takes_a_folder_or_an_object_with_one(tok):
    for tokenizer in (tok, tok.folder, str(tok.folder)):
        with serve(tokenizer) as (fake, client):
            assert chat(client).status_code == 200
            assert fake.encoding.encode("hi there") == tok.encode("hi there")


def test_long_inputs_are_cut_as_kimi_cuts_them(tok):
    with serve(tok.folder) as (fake, client):
        for text in (
            "ab" * 30_001 + " " * 25_001 + "c d",
            " " * 50_001,
            "数据模型" * 7_000 + "\n" * 26_000,
            "x <|im_end|> y",
        ):
            assert fake.encoding.encode(text) == tok.encode(text)
            assert fake.encoding.encode(text, specials=True) == tok.encode(text, allow_special=True)


def _shipped_prompts():
    for name, spec in DATASETS.items():
        prompts = read_prompts(spec)
        yield name, prompts, prompts_frame(prompts, name)


# This cross-check found the project's K2 tool declaration rendered with json.dumps' default ', ' and ': '
# separators where Kimi-K2(-Thinking)'s chat_template.jinja writes `tools | tojson(separators=(',', ':'))`.
@pytest.mark.parametrize("version", ["k2.5", "k2"])
def test_billed_counts_equal_the_projects_reconstruction_on_every_shipped_prompt(tok, version):
    """prompt_tokens against the project's chat format + tokenizer, completion_tokens against
    enc(reasoning) + </think> + enc(content) + <|im_end|>, for every prompt in data/prompts."""
    prompt_diffs, completion_diffs, n = [], [], 0
    with serve(tok.folder, template_version=version, mean_reasoning_words=12, mean_content_words=6) as (fake, client):
        for _name, prompts, frame in _shipped_prompts():
            ours = rendered_prompt_ids(frame, tok, TemplateVersion(version), thinking=True)
            for prompt, ids in zip(prompts, ours, strict=True):  # the frame has a row per prompt
                body = {"messages": prompt.messages, **({"tools": prompt.tools} if prompt.tools else {})}
                r = chat(client, **body)
                assert r.status_code == 200, r.text
                data = r.json()
                n += 1
                if data["usage"]["prompt_tokens"] != len(ids):
                    prompt_diffs.append((prompt.prompt_id, data["usage"]["prompt_tokens"], len(ids)))
                message = data["choices"][0]["message"]
                rebuilt = len(tok.encode(message["reasoning"])) + 1 + len(tok.encode(message["content"])) + 1
                if data["usage"]["completion_tokens"] != rebuilt:
                    completion_diffs.append((prompt.prompt_id, data["usage"]["completion_tokens"], rebuilt))
    assert n == sum(len(p) for _, p, _ in _shipped_prompts()) and n > 250
    assert not completion_diffs, f"(prompt, billed, rebuilt): {completion_diffs[:10]}"
    assert not prompt_diffs, f"{len(prompt_diffs)} of {n} differ (prompt, fake, project): {prompt_diffs[:10]}"


def test_tool_declarations_as_moonshot_renders_them():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get weather",
                "parameters": {
                    "type": "object",
                    "required": ["city"],
                    "properties": {
                        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                        "city": {"type": "string", "description": "City name"},
                    },
                },
            },
        }
    ]
    k25 = render_prompt(HI, tools, version="k2.5")
    assert k25.startswith(
        "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n// Get weather\n"
        'type get_weather = (_: {\n  // City name\n  city: string,\n  // Default: "c"\n'
        '  unit?: "c" | "f"\n}) => any;\n}\n'
        "<|im_end|><|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    )
    k2 = render_prompt(HI, tools, version="k2")
    assert k2.startswith(  # deep-sorted keys, tojson(separators=(',', ':'))
        '<|im_system|>tool_declare<|im_middle|>[{"function":{"description":"Get weather","name":"get_weather",'
        '"parameters":{"properties":{"city":{"description":"City name","type":"string"},'
        '"unit":{"default":"c","enum":["c","f"],"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]<|im_end|>'
    )
    assert k25.endswith("<|im_user|>user<|im_middle|>hi there<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    assert render_prompt(HI, None, thinking=False).endswith("<|im_middle|><think></think>")


def test_history_reasoning_tool_calls_and_results():
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "dropped"},
        {"role": "user", "content": "u2"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "kept",
            "tool_calls": [
                {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
            ],
        },
        {"role": "tool", "name": "f", "tool_call_id": "functions.f:0", "content": "42"},
    ]
    assert render_prompt(messages) == (
        "<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>u1<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>a1<|im_end|><|im_user|>user<|im_middle|>u2<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>kept</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>f<|im_middle|>## Return of functions.f:0\n42<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )


def test_thinking_off_has_no_reasoning_and_no_separator(tok):
    with serve(tok, thinking=False) as (fake, client):
        data = chat(client).json()
    message = data["choices"][0]["message"]
    assert message["reasoning"] == "" and message["content"]
    assert data["usage"]["completion_tokens"] == len(tok.encode(message["content"])) + 1
    assert data["usage"]["prompt_tokens"] == len(tok.encode(render_prompt(HI, thinking=False), allow_special=True))


# -- billing behaviours -----------------------------------------------------------------------


def _cancel_stream_early(client, lines: int = 3) -> str:
    with client.stream("POST", "/chat/completions", json={"model": "m", "messages": HI, "stream": True}) as r:
        assert r.status_code == 200
        gen = r.headers["X-Generation-Id"]
        for i, _ in enumerate(r.iter_lines()):
            if i >= lines:
                break
    return gen


def test_a_cancelled_stream_is_billed_in_full_later(tok):
    slow = dict(chunk_latency_s=0.03, mean_reasoning_words=30, mean_content_words=20, generation_404_s=0.0, seed=11)
    with serve(tok, **slow) as (whole, client):  # the same answer, read to the end: what "full" is
        full = chat(client).json()["usage"]
    # Not billed at the disconnect: a bill an hour away cannot post while this looks (the 0.8 s it once was could,
    # for a test thread descheduled that long on a loaded machine).
    with serve(tok, **slow, late_bill_s=3600.0) as (fake, client):
        gen = _cancel_stream_early(client)
        wait_for(lambda: gen in fake.billing.late_pending, 60, "the server to see the disconnect")
        assert gen not in fake.billing.billed_ids()
        assert client.get("/generation", params={"id": gen}).status_code == 404  # not billed yet
    # ... and billed in full once it is due (here in 0.8 s).
    with serve(tok, **slow, late_bill_s=0.8) as (fake, client):
        gen = _cancel_stream_early(client)
        bill = wait_for(lambda: next((b for b in fake.billing.bills if b.id == gen), None), 60, "the late bill")
        assert bill.kind == "late" and gen not in fake.billing.late_pending
        assert (bill.prompt_tokens, bill.completion_tokens) == (full["prompt_tokens"], full["completion_tokens"])
        assert bill.cost == pytest.approx(full["cost"])
        found = client.get("/generation", params={"id": gen}).json()["data"]
        assert (
            found["total_cost"] == pytest.approx(full["cost"])
            and found["tokens_completion"] == full["completion_tokens"]
        )
        assert found["cancelled"] is True
    with serve(tok, **slow) as (fake, client):  # late_bill_s = 0: billed at the disconnect for what was sent
        gen = _cancel_stream_early(client)
        bill = wait_for(lambda: next((b for b in fake.billing.bills if b.id == gen), None), 60, "the bill")
        assert bill.kind == "aborted_stream" and bill.completion_tokens < full["completion_tokens"]


def test_never_found_generations_are_billed_and_counted_but_never_found(tok):
    with serve(tok, rate_never_found=1.0, generation_404_s=0.0, nonmonotonic_on_key_call=0) as (fake, client):
        gens = [chat(client).headers["X-Generation-Id"] for _ in range(3)]
        assert [b.id for b in fake.billing.bills] == gens and all(
            b.never_found and b.cost > 0 for b in fake.billing.bills
        )
        assert client.get("/key").json()["data"]["usage"] == pytest.approx(fake.billing.total_usd)
        for _ in range(3):
            assert {client.get("/generation", params={"id": g}).status_code for g in gens} == {404}
            time.sleep(0.1)
    with serve(tok, rate_never_found=0.5, generation_404_s=0.0, seed=3) as (fake, client):
        gens = [chat(client).headers["X-Generation-Id"] for _ in range(20)]
        found = {g: client.get("/generation", params={"id": g}).status_code for g in gens}
        hidden = {b.id for b in fake.billing.bills if b.never_found}
        assert 0 < len(hidden) < 20 and {g for g, status in found.items() if status == 404} == hidden


@pytest.mark.parametrize(
    "setting, stream",
    [
        ("rate_error_200", False),
        ("rate_finish_error", False),
        ("rate_finish_error", True),
        ("rate_empty", False),
        ("rate_empty", True),
    ],
)
def test_failed_generations_get_zero_cost_records(tok, setting, stream):
    with serve(tok, **{setting: 1.0}, generation_404_s=0.0) as (fake, client):
        r = chat(client, stream=stream)
        assert r.status_code == 200
        gen = r.headers["X-Generation-Id"]
        (bill,) = fake.billing.bills
        assert (bill.id, bill.kind, bill.cost, bill.completion_tokens) == (
            gen,
            "failed",
            0.0,
            0,
        ) and bill.prompt_tokens > 0
        record = client.get("/generation", params={"id": gen}).json()["data"]
        assert record["total_cost"] == 0 and record["native_tokens_prompt"] == bill.prompt_tokens
        assert fake.billing.total_usd == 0


def test_foreign_spend_moves_the_key_and_eats_the_credit(tok):
    with serve(tok, foreign_spend_usd_per_s=5.0, credit_usd=1.0, nonmonotonic_on_key_call=0) as (fake, client):
        first = client.get("/key").json()["data"]
        time.sleep(0.1)
        second = client.get("/key").json()["data"]
        assert second["usage"] > first["usage"] and second["usage_daily"] == second["usage"]
        assert second["limit_remaining"] == pytest.approx(1.0 - second["usage"])
        assert second["limit_remaining"] < first["limit_remaining"]
        assert fake.billing.bills == []  # another app's spending is not ours
        time.sleep(max(0.0, 0.25 - second["usage"] / 5.0))
        r = chat(client)
        assert r.status_code == 402 and "Insufficient credits" in r.json()["error"]["message"]


def test_a_requests_per_second_cap_answers_429_with_rate_limit_headers(tok):
    window = 3600.0  # a window this long does not end during the test
    with serve(tok, max_rps=3 / window, rate_window_s=window) as (fake, client):
        accepted = [chat(client) for _ in range(3)]
        assert [r.status_code for r in accepted] == [200] * 3
        assert [r.headers["X-RateLimit-Remaining"] for r in accepted] == ["2", "1", "0"]
        assert {r.headers["X-RateLimit-Limit"] for r in accepted} == {"3"}
        reset = {int(r.headers["X-RateLimit-Reset"]) for r in accepted}
        assert len(reset) == 1 and time.time() * 1000 < reset.pop() <= (time.time() + window) * 1000  # epoch ms
        refused = chat(client)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == 429
        assert refused.json()["error"]["message"].startswith("Rate limit exceeded")
        assert refused.headers["X-RateLimit-Remaining"] == "0" and refused.headers["X-RateLimit-Limit"] == "3"
        assert "Retry-After" not in refused.headers and "X-Generation-Id" not in refused.headers
        fake.settings.rate_limit_retry_after = True
        assert int(chat(client).headers["Retry-After"]) >= 1
        assert fake.billing.statuses.count(429) == 2 and len(fake.billing.bills) == 3
    with serve(tok, max_rps=4, rate_window_s=0.5) as (fake, client):  # limit 2 per half second, then a new window
        # Deadlines for a loaded machine: three requests must fall in one half-second window to see a refusal.
        refused = wait_for(lambda: (lambda r: r if r.status_code == 429 else None)(chat(client)), 60, "a refusal")
        wait_for(lambda: time.time() * 1000 >= int(refused.headers["X-RateLimit-Reset"]), 30, "the window to end")
        assert chat(client).status_code == 200


def test_attempt_ids_and_prompt_keys_are_recorded(tok):
    other = [{"role": "user", "content": "another question"}]
    with serve(tok) as (fake, client):
        client.post("/chat/completions", json={"model": "m", "messages": HI}, headers={"X-Eagle3-Attempt": "p1#1"})
        client.post("/chat/completions", json={"model": "m", "messages": HI}, headers={"X-Eagle3-Attempt": "p1#2"})
        client.post("/chat/completions", json={"model": "m", "messages": other})
    assert [b["messages"] for b in fake.billing.requests] == [HI, HI, other]
    assert [i.attempt for i in fake.billing.request_info] == ["p1#1", "p1#2", None]
    assert [b.attempt for b in fake.billing.bills] == ["p1#1", "p1#2", None]
    assert {b.prompt_key for b in fake.billing.bills_for(HI)} == {json.dumps(HI, sort_keys=True)}
    assert len(fake.billing.bills_for(HI)) == 2 and len(fake.billing.bills_for(other)) == 1
    assert [i.generation_id for i in fake.billing.request_info] == [b.id for b in fake.billing.bills]


# -- catalogue and routing --------------------------------------------------------------------


def test_models_and_endpoints_list_the_configured_prices(tok):
    with serve(tok, endpoints=json.dumps(ENDPOINTS)) as (fake, client):
        models = client.get("/models").json()["data"]
        assert [m["id"] for m in models] == ["moonshotai/kimi-k2.5", "moonshotai/kimi-k2-thinking"]
        assert models[0]["pricing"]["prompt"] == "0.0000006" and models[0]["pricing"]["completion"] == "0.0000025"
        assert models[0]["pricing"]["request"] == "0" and isinstance(models[0]["context_length"], int)
        data = client.get("/models/moonshotai/kimi-k2.5/endpoints").json()["data"]
        assert data["id"] == "moonshotai/kimi-k2.5" and data["name"]
        shown = [
            (e["provider_name"], e["quantization"], e["pricing"]["prompt"], e["pricing"]["completion"], e["status"])
            for e in data["endpoints"]
        ]
        assert shown == [
            ("Moonshot AI", "int4", "0.0000006", "0.0000025", 0),
            ("Fireworks", "fp8", "0.0000004", "0.000002", 0),
            ("DeepInfra", "fp4", "0.0000003", "0.000001", 0),
        ]
        assert all(isinstance(e["context_length"], int) and e["name"] for e in data["endpoints"])
        assert client.get("/models/nobody/nothing/endpoints").status_code == 404
    with serve(tok, price_prompt=1e-6, price_completion=3e-6) as (fake, client):  # the default: one endpoint
        (endpoint,) = client.get("/models/moonshotai/kimi-k2.5/endpoints").json()["data"]["endpoints"]
        assert (endpoint["provider_name"], endpoint["quantization"], endpoint["pricing"]["prompt"]) == (
            "FakeProvider",
            "int4",
            "0.000001",
        )


ROUTES = [
    ({}, "Moonshot AI"),
    ({"only": ["Fireworks"]}, "Fireworks"),
    ({"only": ["moonshotai"]}, "Moonshot AI"),  # a slug names the same provider
    ({"ignore": ["Moonshot AI"]}, "Fireworks"),
    ({"quantizations": ["int4", "int8", "fp8", "fp16", "bf16", "fp32"], "sort": "price"}, "Fireworks"),
    ({"quantizations": ["fp4"]}, "DeepInfra"),
    ({"sort": "price"}, "DeepInfra"),
    ({"sort": {"by": "price"}, "ignore": ["deepinfra"]}, "Fireworks"),
    ({"max_price": {"prompt": 0.5, "completion": 2.1}}, "Fireworks"),
    ({"max_price": {"prompt": 0.5}, "sort": "price"}, "DeepInfra"),
    ({"order": ["DeepInfra", "Moonshot AI"]}, "DeepInfra"),
    ({"order": ["Together"]}, "Moonshot AI"),  # falls back
    ({"order": ["Together"], "allow_fallbacks": False}, None),
    ({"only": ["NoSuchProvider"]}, None),
    ({"max_price": {"prompt": 0.1}}, None),
    ({"quantizations": ["bf16"]}, None),
]


@pytest.mark.parametrize("factor", [1.0, 1.5])
def test_routing_by_the_provider_object_and_billing_at_the_serving_prices(tok, factor):
    prices = {e["provider_name"]: (e["price_prompt"], e["price_completion"]) for e in ENDPOINTS}
    with serve(tok, endpoints=json.dumps(ENDPOINTS), billed_price_factor=factor) as (fake, client):
        for provider, served in ROUTES:
            r = chat(client, provider=provider)
            if served is None:
                assert r.status_code == 404, (provider, r.text)
                assert (
                    r.json()["error"]["message"] == "No endpoints found matching your data policy and provider filters"
                )
                continue
            data = r.json()
            assert data["provider"] == served, provider
            usage, bill = data["usage"], fake.billing.bills[-1]
            pp, pc = prices[served]
            expected = (usage["prompt_tokens"] * pp + usage["completion_tokens"] * pc) * factor
            assert (
                usage["cost"] == pytest.approx(expected)
                and bill.cost == pytest.approx(expected)
                and bill.provider == served
            )


def test_the_default_endpoint_keeps_the_known_providers_rule(tok):
    with serve(tok) as (fake, client):
        assert chat(client, provider={"only": ["Together"]}).json()["provider"] == "FakeProvider"
        assert chat(client, provider={"only": ["NoSuchProvider"]}).status_code == 404
        assert chat(client, provider={"quantizations": ["fp8"]}).status_code == 404  # the default endpoint is int4


def test_every_setting_is_a_cli_flag():
    _, settings = parse_args(
        [
            "--late-bill-s",
            "2",
            "--rate-never-found",
            "0.1",
            "--max-rps",
            "5",
            "--rate-limit-retry-after",
            "true",
            "--thinking",
            "false",
            "--template-version",
            "k2",
            "--billed-price-factor",
            "1.2",
            "--endpoints",
            json.dumps(ENDPOINTS[:1]),
            "--foreign-spend-usd-per-s",
            "0.01",
        ]
    )
    assert (settings.late_bill_s, settings.rate_never_found, settings.max_rps, settings.rate_limit_retry_after) == (
        2.0,
        0.1,
        5.0,
        True,
    )
    assert (settings.thinking, settings.template_version, settings.billed_price_factor) == (False, "k2", 1.2)
    assert json.loads(settings.endpoints)[0]["provider_name"] == "Moonshot AI" and math.isclose(
        settings.foreign_spend_usd_per_s, 0.01
    )
    assert parse_args([])[1] == FakeSettings()
