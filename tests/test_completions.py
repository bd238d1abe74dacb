"""Completion backends against real parts: the stand-in model in-process, loopback HTTP servers."""

import pytest
from aiohttp import web
from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread

from eagle3_assets.common.registry import DATASETS
from eagle3_assets.money import Caps
from eagle3_assets.stages.completions.run import (
    build_requests,
    completions_frame,
    final_results,
    run_completions,
)
from eagle3_assets.stages.raw_prompts.prompts import prompts_frame, read_prompts
from eagle3_assets.stages.token_ids.reconstruct import build_token_ids
from eagle3_resources.completions.local import TransformersBackend
from eagle3_resources.completions.local_generate import InverseCdfSampler
from eagle3_resources.completions.openrouter import OpenRouterBackend, request_body
from eagle3_resources.completions.sglang import SGLangBackend
from eagle3_resources.completions.types import SamplingSettings
from eagle3_resources.errors import RunFatalError
from eagle3_resources.tokenizer.chat_format import TemplateVersion


def requests_for(tok, name, n):
    df = prompts_frame(read_prompts(DATASETS[name]), name).head(n)
    return df, build_requests(df, tok, TemplateVersion.K2_5, True)


def test_local_backend_generates_and_resume_sends_nothing(tok, target_model, tmp_path, ledger):
    df, reqs = requests_for(tok, "B7", 6)
    journal = tmp_path / "journal.jsonl"
    backend = TransformersBackend(target_model, tok, batch_size=4)
    settings = SamplingSettings(max_tokens=48)
    run = run_completions("B7", reqs, backend, settings, journal, ledger=ledger, log=print)
    assert run.sent == 6 and sum(run.results.values()) == 6
    frame = completions_frame("B7", reqs, journal, df)
    assert frame.height == 6 and set(frame["status"]) <= {"ok", "truncated"}
    for row in frame.iter_rows(named=True):
        ids = row["completion_ids"]
        assert 0 < len(ids) <= 48 and row["completion_tokens"] == len(ids)
        assert (ids[-1] == 163586) == (row["status"] == "ok")
    ids = build_token_ids(frame, tok)
    assert ids["text_roundtrip_ok"].all()  # the model's own ids decode to the text the split returned
    again = run_completions("B7", reqs, backend, settings, journal, ledger=ledger, log=print)
    assert again.sent == 0 and again.resumed_done == 6


def test_token_budget_stops_admission(tok, target_model, tmp_path, ledger):
    _, reqs = requests_for(tok, "A1", 8)
    run = run_completions(
        "A1",
        reqs,
        TransformersBackend(target_model, tok, batch_size=2),
        SamplingSettings(max_tokens=32),
        tmp_path / "j.jsonl",
        caps=Caps(token_budget=100),
        ledger=ledger,
        log=print,
    )
    assert run.stopped_by and "token budget" in run.stopped_by
    assert 1 <= run.sent < 8
    # Admission counts the worst case of what is in flight: the budget is never overshot.
    assert ledger.read(lambda c: c.execute("select sum(completion_tokens) from attempts").fetchone()[0]) <= 100


def test_sampler_matches_nucleus_distribution():
    import torch

    torch.manual_seed(0)
    logits = torch.randn(2, 300) * 3
    sampler = InverseCdfSampler(0.8, 0.9, None, seed=1)
    counts = torch.zeros_like(logits)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 8,000 calls of tiny ops: under a busy machine, each op's thread hand-off dominates
    try:
        for _ in range(8000):
            counts += (sampler(None, logits.clone()) == 0).float()
    finally:
        torch.set_num_threads(threads)
    p = torch.softmax(logits / 0.8, -1)
    sp, si = p.sort(-1, descending=True)
    keep = (sp.cumsum(-1) - sp) < 0.9
    q = torch.zeros_like(p).scatter(-1, si, sp * keep)
    q /= q.sum(-1, keepdim=True)
    emp = counts / counts.sum(-1, keepdim=True)
    assert ((emp > 0) <= (q > 0)).all()  # never outside the nucleus
    assert (emp - q).abs().max() < 0.03


@pytest.fixture
def fake_openrouter(tok):
    fake = FakeOpenRouter(tok, FakeSettings(api_key="k-test"))
    with ServerThread(fake.app) as server:
        yield fake, f"{server.base_url}/api/v1"


def test_openrouter_request_shape_and_ledger(tok, fake_openrouter, tmp_path, ledger):
    fake, url = fake_openrouter
    df, reqs = requests_for(tok, "A2", 5)
    settings = SamplingSettings(max_tokens=4096)
    run = run_completions(
        "A2",
        reqs,
        OpenRouterBackend(url, "k-test", concurrency=3),
        settings,
        tmp_path / "j.jsonl",
        ledger=ledger,
        log=print,
    )
    assert run.results["ok"] == 5
    body = fake.billing.requests[0]
    assert body["model"] == "moonshotai/kimi-k2.5" and body["max_tokens"] == 4096
    assert body["reasoning"] == {"enabled": True} and "stop" not in body
    assert body["provider"]["quantizations"] == ["int4", "int8", "fp8", "fp16", "bf16", "fp32"]
    assert body["provider"]["require_parameters"] is True
    with_tools = [b for b in fake.billing.requests if b.get("tools")]
    assert with_tools, "A2 prompts with tools send them"
    frame = completions_frame("A2", reqs, tmp_path / "j.jsonl", df)
    assert frame["cost_usd"].sum() == pytest.approx(fake.billing.total_usd)
    assert frame["generation_id"].str.starts_with("gen-").all()


def test_openrouter_retries_429_without_duplicates(tok, tmp_path, ledger):
    fake = FakeOpenRouter(tok, FakeSettings(api_key="k", rate_429=0.4, retry_after_s=0.01, seed=3))
    _, reqs = requests_for(tok, "B6", 20)
    with ServerThread(fake.app) as server:
        backend = OpenRouterBackend(
            f"{server.base_url}/api/v1", "k", concurrency=8, max_attempts=12, backoff_base_s=0.01
        )
        run = run_completions("B6", reqs, backend, SamplingSettings(), tmp_path / "j.jsonl", ledger=ledger, log=print)
    assert 429 in fake.billing.statuses and run.results["ok"] == 20
    done, _ = final_results(tmp_path / "j.jsonl")
    assert len(done) == 20 and len(fake.billing.bills) == 20  # each prompt billed exactly once


def test_openrouter_bad_key_stops_the_run(tok, fake_openrouter, tmp_path, ledger):
    _, url = fake_openrouter
    _, reqs = requests_for(tok, "B4", 6)
    with pytest.raises(RunFatalError, match="401"):
        run_completions(
            "B4",
            reqs,
            OpenRouterBackend(url, "wrong", concurrency=2),
            SamplingSettings(),
            tmp_path / "j.jsonl",
            ledger=ledger,
            log=print,
        )
    done, _ = final_results(tmp_path / "j.jsonl")
    assert done == {}  # nothing was served, so everything is sent again on resume


def test_openrouter_length_is_recorded_as_truncated(tok, fake_openrouter, tmp_path, ledger):
    _, url = fake_openrouter
    _, reqs = requests_for(tok, "B5", 2)
    run = run_completions(
        "B5",
        reqs,
        OpenRouterBackend(url, "k-test"),
        SamplingSettings(max_tokens=5),
        tmp_path / "j.jsonl",
        ledger=ledger,
        log=print,
    )
    assert run.results["truncated"] == 2


def test_request_body_has_tools_only_when_present(tok):
    _, reqs = requests_for(tok, "A2", 31)
    bodies = [request_body(r, SamplingSettings()) for r in reqs]
    assert any("tools" in b for b in bodies) and any("tools" not in b for b in bodies)


def test_sglang_backend_keeps_server_ids(tok, tmp_path, ledger):
    received = []

    async def generate(request):
        body = await request.json()
        received.append(body)
        out = tok.encode("thinking") + [163607] + tok.encode("answer") + [163586]
        return web.json_response(
            {
                "text": "thinking</think>answer",
                "output_ids": out,
                "meta_info": {
                    "id": "r1",
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(out),
                    "finish_reason": {"type": "stop", "matched": 163586},
                },
            }
        )

    app = web.Application()
    app.router.add_post("/generate", generate)
    df, reqs = requests_for(tok, "A1", 3)
    with ServerThread(app) as server:
        run = run_completions(
            "A1",
            reqs,
            SGLangBackend(server.base_url, tok, concurrency=2),
            SamplingSettings(max_tokens=64),
            tmp_path / "j.jsonl",
            ledger=ledger,
            log=print,
        )
    assert run.results["ok"] == 3
    assert received[0]["input_ids"] == reqs[0].prompt_ids and received[0]["sampling_params"]["stop_token_ids"] == [
        163586,
        163585,
    ]
    frame = completions_frame("A1", reqs, tmp_path / "j.jsonl", df)
    row = frame.row(0, named=True)
    assert row["reasoning"] == "thinking" and row["content"] == "answer" and row["completion_ids"][-1] == 163586
