"""The OpenRouter client against the loopback fake server: every outcome class, scale, caps, stops."""

import collections
import math
import os
import signal
import threading
import time

import pytest
from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread
from support import bills_not_in_ledger, ledger_rows, wait_for

from eagle3_assets.money import Caps, Pricing, SpendLedger
from eagle3_assets.stages.completions.run import final_results, run_completions
from eagle3_resources.completions.openrouter import OpenRouterBackend
from eagle3_resources.completions.sse import (
    SSEDecoder,
    StreamedResponse,
    fold_events,
)
from eagle3_resources.completions.types import (
    CompletionRequest,
    ProviderRouting,
    SamplingSettings,
)
from eagle3_resources.errors import RunFatalError, StreamError
from eagle3_resources.journal import read_journal

KEY = "k-test"
PRICING = Pricing(0.60e-6, 2.50e-6)  # the fake's prices


def synthetic_requests(tok, n, prefix="p"):
    reqs = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}]
        reqs.append(CompletionRequest(f"{prefix}{i:05d}", messages, None, tok.encode(messages[0]["content"])))
    return reqs


def backend_for(server, **kw):
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("backoff_cap_s", 0.2)
    return OpenRouterBackend(f"{server.base_url}/api/v1", kw.pop("key", KEY), **kw)


def ledger_of(tmp_path) -> SpendLedger:
    return SpendLedger(tmp_path / "ledger.sqlite")


def run(server, tok, tmp_path, reqs, settings=None, **kw):
    options = {k: kw.pop(k) for k in ("caps", "pricing", "resend_unsettled", "unsettled_wait_s", "run_id") if k in kw}
    options.setdefault("pricing", Pricing(0.60e-6, 2.50e-6))
    return run_completions(
        "T",
        reqs,
        backend_for(server, **kw),
        settings or SamplingSettings(max_tokens=4096),
        tmp_path / "journal.jsonl",
        ledger=ledger_of(tmp_path),
        log=print,
        **options,
    )


def billed_in_ledger(tmp_path) -> float:
    return ledger_of(tmp_path).figures().total.settled_usd


@pytest.fixture
def fake(tok):
    def make(**settings):
        server = FakeOpenRouter(tok, FakeSettings(api_key=KEY, **settings))
        thread = ServerThread(server.app)
        thread.__enter__()
        made.append(thread)
        server.url = thread.base_url
        return server, thread

    made: list[ServerThread] = []
    yield make
    for t in made:
        t.__exit__(None, None, None)


def requests_per_prompt(server):
    return collections.Counter(b["messages"][0]["content"] for b in server.billing.requests)


# -- SSE -----------------------------------------------------------------------------------


def test_sse_keepalives_usage_chunk_and_done():
    lines = [
        ": OPENROUTER PROCESSING",
        "",
        'data: {"id": "gen-1", "choices": [{"delta": {"role": "assistant", "content": ""}}]}',
        "",
        'data: {"choices": [{"delta": {"reasoning": "thin"}}]}',
        "",
        ": OPENROUTER PROCESSING",
        "",
        'data: {"choices": [{"delta": {"reasoning": "king"}}]}',
        "",
        'data: {"choices": [{"delta": {"content": "ok"}}]}',
        "",
        'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}',
        "",
        'data: {"choices": [], "usage": {"completion_tokens": 5, "cost": 0.01}}',
        "",
        "data: [DONE]",
        "",
    ]
    folded, decoder = StreamedResponse(), SSEDecoder()
    for line in lines:
        fold_events(decoder.line(line), folded)
    body = folded.as_body()
    assert folded.done and body["id"] == "gen-1" and body["usage"]["cost"] == 0.01
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ok", "reasoning": "thinking"}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_sse_error_chunk_midstream():
    folded, decoder = StreamedResponse(), SSEDecoder()
    with pytest.raises(StreamError, match="mid-stream"):
        for line in [
            'data: {"choices": [{"delta": {"content": "a"}}]}',
            'data: {"error": {"code": 502, "message": "down"}}',
        ]:
            fold_events(decoder.line(line), folded)


def test_sse_tool_call_deltas_are_joined():
    folded = StreamedResponse()
    folded.add(
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "functions.f:0", "function": {"name": "f", "arguments": '{"a"'}}
                        ]
                    }
                }
            ]
        }
    )
    folded.add(
        {
            "choices": [
                {
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        }
    )
    call = folded.as_body()["choices"][0]["message"]["tool_calls"][0]
    assert call["id"] == "functions.f:0" and call["function"] == {"name": "f", "arguments": '{"a": 1}'}


# -- outcome classes -----------------------------------------------------------------------


RETRYABLE = [
    (f, stream)
    for f in ("rate_429", "rate_503", "rate_408", "rate_500", "rate_reset", "rate_truncate")
    for stream in (True, False)
]
RETRYABLE += [("rate_error_200", False), ("rate_error_midstream", True)]  # an error inside HTTP 200 / inside the stream


@pytest.mark.slow
@pytest.mark.parametrize("fault, stream", RETRYABLE)
def test_retryable_faults_end_ok_with_one_result_each_and_ledger_equal_to_billing(tok, fake, tmp_path, fault, stream):
    server, thread = fake(**{fault: 0.35}, seed=7)
    reqs = synthetic_requests(tok, 24)
    # A non-streaming request whose connection broke before any answer may still be generating (and billed): the
    # prompt is not sent again unless the run says so explicitly (test_a_broken_non_streaming_request_is_not_resent).
    resend = fault == "rate_reset" and not stream
    result = run(thread, tok, tmp_path, reqs, stream=stream, concurrency=6, max_attempts=25, resend_unsettled=resend)
    assert result.results["ok"] == 24, result.errors
    assert any(n > 1 for n in requests_per_prompt(server).values()), "the fault never fired"
    done, _ = final_results(tmp_path / "journal.jsonl")
    assert len(done) == 24
    assert {r["generation_id"] for r in done.values()} <= {b.id for b in server.billing.bills if b.kind == "complete"}
    # every dollar billed is in the ledger, lost bodies and partial streams included (looked up by generation id)
    assert bills_not_in_ledger(server, ledger_of(tmp_path)) == []
    assert math.isclose(billed_in_ledger(tmp_path), server.billing.total_usd, rel_tol=1e-9, abs_tol=1e-12)


def test_a_broken_non_streaming_request_is_not_resent(tok, fake, tmp_path):
    server, thread = fake(rate_reset=0.35, seed=7)
    reqs = synthetic_requests(tok, 24)
    result = run(thread, tok, tmp_path, reqs, stream=False, concurrency=6, max_attempts=25)
    assert result.results["deferred"] > 0 and result.results["ok"] + result.results["deferred"] == 24
    assert set(requests_per_prompt(server).values()) == {1}  # none sent twice
    figures = ledger_of(tmp_path).figures()
    assert figures.unidentified == result.results["deferred"]  # each held at its worst case until the horizon
    again = run(thread, tok, tmp_path, reqs, stream=False, concurrency=6, max_attempts=25)
    assert again.sent == 0 and again.blocked == result.results["deferred"]


@pytest.mark.parametrize(
    "setting, status, error_code",
    [
        ("rate_content_filter", "filtered", None),
        ("rate_finish_error", "failed", "finish:502"),
        ("rate_empty", "failed", "empty"),
    ],
)
def test_per_sample_outcomes_are_recorded_and_never_resent(tok, fake, tmp_path, setting, status, error_code):
    server, thread = fake(**{setting: 1.0})
    reqs = synthetic_requests(tok, 5)
    result = run(thread, tok, tmp_path, reqs)
    assert result.results[status] == 5
    assert set(requests_per_prompt(server).values()) == {1}
    done, _ = final_results(tmp_path / "journal.jsonl")
    assert {r["status"] for r in done.values()} == {status}
    if error_code:
        assert {r["error_code"] for r in done.values()} == {error_code}
    again = run(thread, tok, tmp_path, reqs)
    assert again.sent == 0 and len(server.billing.requests) == 5


def test_length_and_bad_request_are_per_sample(tok, fake, tmp_path):
    server, thread = fake(context_limit=5000)
    result = run(thread, tok, tmp_path, synthetic_requests(tok, 3), settings=SamplingSettings(max_tokens=4))
    assert result.results["truncated"] == 3
    result = run_completions(
        "T2",
        synthetic_requests(tok, 3, "big"),
        backend_for(thread),
        SamplingSettings(max_tokens=9000),
        tmp_path / "big.jsonl",
        ledger=ledger_of(tmp_path),
        log=print,
    )
    assert result.results["failed"] == 3 and dict(result.errors) == {"400@-": 3}
    assert server.billing.statuses.count(400) == 3  # never re-sent


def test_one_throttle_shrinks_concurrency_a_little_and_successes_restore_it():
    import asyncio

    from eagle3_resources.completions.throttle import AdaptiveLimiter

    async def scenario():
        lim = AdaptiveLimiter(100, recover_after=2, cooldown_s=0.0)
        lim.throttled()
        assert lim.limit == 80  # one 429 does not stall the other workers
        for _ in range(10):
            await lim.succeeded()
        assert lim.limit == 85
        for _ in range(100):
            lim.throttled()
        assert lim.limit == lim.floor == 4
        async with lim.slot():
            assert lim.active == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "kw, server_kw, status",
    [({"key": "wrong"}, {}, "401"), ({}, {"credit_usd": 0.0}, "402"), ({}, {}, "404")],
)
def test_run_fatal_errors_stop_admission_at_once(tok, fake, tmp_path, kw, server_kw, status):
    server, thread = fake(**server_kw)
    settings = (
        SamplingSettings(provider=ProviderRouting(only=["NoSuchProvider"])) if status == "404" else SamplingSettings()
    )
    with pytest.raises(RunFatalError, match=status):
        run(thread, tok, tmp_path, synthetic_requests(tok, 200), settings=settings, concurrency=4, **kw)
    if status == "404":
        assert len(server.billing.requests) <= 4 + 4  # the ones in flight when it came, and no new ones
    else:  # a bad or spent key is found by reading /key (unbilled) before a single request goes out
        assert server.billing.requests == []
    done, _ = final_results(tmp_path / "journal.jsonl")
    assert done == {}  # nothing final: all of it is sent again once the cause is fixed


def test_inflight_402_is_retried_after_retry_after(tok, fake, tmp_path):
    # Credit for ~3 worst-case requests at a time: the rest get the in-flight 402 and wait.
    server, thread = fake(credit_usd=0.04, latency_s=0.05)
    result = run(
        thread,
        tok,
        tmp_path,
        synthetic_requests(tok, 12),
        settings=SamplingSettings(max_tokens=4096),
        concurrency=12,
        max_attempts=60,
    )
    assert 402 in server.billing.statuses and result.results["ok"] == 12


# -- scale ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_2000_prompts_with_15pct_429s_no_duplicate_none_lost_ledger_equals_billing(tok, fake, tmp_path):
    server, thread = fake(rate_429=0.15, retry_after_s=0.05, seed=11, mean_reasoning_words=8, mean_content_words=6)
    reqs = synthetic_requests(tok, 2000)
    result = run(thread, tok, tmp_path, reqs, concurrency=2000, max_attempts=40)
    assert result.results["ok"] == 2000
    records = [r for r in read_journal(tmp_path / "journal.jsonl").records if r.get("type") == "result"]
    assert sorted(r["prompt_id"] for r in records) == sorted(r.prompt_id for r in reqs)  # none lost, none twice
    assert len(server.billing.bills) == 2000 and server.billing.statuses.count(429) > 200
    assert math.isclose(billed_in_ledger(tmp_path), server.billing.total_usd, rel_tol=1e-9)


# -- caps ----------------------------------------------------------------------------------


@pytest.mark.parametrize("on_cap", ["finish", "cancel"])
def test_dollar_cap_is_never_overshot_and_is_reported(tok, fake, tmp_path, on_cap):
    server, thread = fake(latency_s=0.1, chunk_latency_s=0.01)
    pricing = Pricing(prompt=0.60e-6, completion=2.50e-6)
    settings = SamplingSettings(max_tokens=400)
    cap = 0.003  # about 3 requests' worst case; actual answers cost much less
    result = run(
        thread,
        tok,
        tmp_path,
        synthetic_requests(tok, 60),
        settings=settings,
        concurrency=8,
        caps=Caps(run_usd=cap, on_cap=on_cap),
        pricing=pricing,
    )
    assert result.stopped_by and "run dollar cap $0.00" in result.stopped_by
    assert server.billing.total_usd <= cap + 1e-12
    assert result.cost_usd <= cap and 0 < result.sent < 60
    done, _ = final_results(tmp_path / "journal.jsonl")
    assert len(done) < 60


def test_total_cap_counts_the_whole_ledger(tok, fake, tmp_path):
    _, thread = fake()
    pricing = Pricing(prompt=0.60e-6, completion=2.50e-6)
    result = run(
        thread,
        tok,
        tmp_path,
        synthetic_requests(tok, 20),
        settings=SamplingSettings(max_tokens=200),
        caps=Caps(total_usd=1.0),
        pricing=pricing,
    )
    assert result.results["ok"] == 20
    spent = billed_in_ledger(tmp_path)
    # Another dataset, another run: the total cap sees what every earlier run billed.
    result = run_completions(
        "U",
        synthetic_requests(tok, 20, "q"),
        backend_for(thread),
        SamplingSettings(max_tokens=200),
        tmp_path / "other.jsonl",
        ledger=ledger_of(tmp_path),
        caps=Caps(total_usd=spent + 1e-6),
        pricing=pricing,
        log=print,
    )
    assert result.sent == 0 and result.stopped_by is not None and "total dollar cap" in result.stopped_by


# -- stop ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigint_stops_within_2s_cuts_the_streams_keeps_every_paid_result_and_resumes(tok, fake, tmp_path, request):
    # Ctrl-C at a terminal meets Python's own handler; a test run started in the background by a
    # non-interactive shell inherits SIGINT ignored, and the signal would never arrive.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    server, thread = fake(latency_s=0.3, chunk_latency_s=0.05)
    reqs = synthetic_requests(tok, 400)
    journal = tmp_path / "journal.jsonl"
    sent_at = {}

    def interrupt():
        while not journal.exists() or journal.read_bytes().count(b'"status":"ok"') < 20:
            time.sleep(0.05)
        sent_at["t"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    ledger = ledger_of(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run_completions(
            "T",
            reqs,
            backend_for(thread, concurrency=32),
            SamplingSettings(max_tokens=4096),
            journal,
            ledger=ledger,
            pricing=PRICING,
            log=print,
        )
    stopped_in = time.monotonic() - sent_at["t"]
    assert stopped_in < 2.0, stopped_in  # issue 3's acceptance: a stop within 2 s; it cut the streams (below)
    wait_for(lambda: not server.inflight_worst, 60, "the server to bill the streams it saw cancelled")
    records = read_journal(journal).records
    finals = {r["generation_id"] for r in records if r.get("type") == "result" and r["status"] == "ok"}
    assert len(finals) >= 20  # every response received before the stop is in the journal
    aborted = [r for r in records if r.get("status") == "aborted"]
    assert aborted and all(r["error_code"] == "cancelled" for r in aborted) and records[-1]["type"] == "end"
    assert records[-1]["stopped_by"] == "SIGINT received"
    n_done = len(finals)
    # Each cancelled request the server saw is held until its bill is known; one cancelled before its send (waiting for
    # its send to be marked) was never billable and is released.
    seen = {info.attempt for info in server.billing.request_info}
    held = {r["attempt_id"] for r in ledger_rows(ledger) if r["state"] in ("unsettled", "unidentified")}
    assert {r["attempt_id"] for r in aborted if r["attempt_id"] in seen} <= held <= {r["attempt_id"] for r in aborted}
    again = run_completions(
        "T",
        reqs,
        backend_for(thread, concurrency=32),
        SamplingSettings(max_tokens=4096),
        journal,
        ledger=ledger,
        pricing=PRICING,
        log=print,
    )
    # The resume looked up the cancelled streams' bills before sending their prompts again (an answer the provider had
    # finished is fetched from its stored content instead of being bought twice); a stream cut before its generation
    # id reached us cannot be looked up, and its prompt waits (blocked) for the horizon.
    assert again.resumed_done == n_done
    assert again.results["ok"] + again.recovered_answers + again.blocked == 400 - n_done
    assert again.blocked == ledger.figures().unidentified
    counts = requests_per_prompt(server)
    done_before = {r["prompt_id"] for r in records if r.get("type") == "result" and r["status"] == "ok"}
    assert all(
        counts[f"Question number {int(p[1:])}: what is {int(p[1:])} plus {int(p[1:])}?"] == 1 for p in done_before
    )
    assert bills_not_in_ledger(server, ledger) == []  # every dollar the server billed, cancelled streams included


# -- the fake server's account endpoints and billing -----------------------------------------


def test_fake_account_endpoints_lag_and_move_the_wrong_way_once(tok, fake, tmp_path):
    import httpx

    # The lag is an hour while the run and the first reading happen, then none: a wall-clock lag of
    # a fraction of a second made this test depend on how fast a loaded CI machine answered.
    # The client reads /key once before fanning out: the test's readings are the 2nd, 3rd and 4th calls.
    server, thread = fake(key_lag_s=3600.0, nonmonotonic_on_key_call=4, refund_usd=0.0001, generation_404_s=0.0)
    run(thread, tok, tmp_path, synthetic_requests(tok, 10))
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=f"{thread.base_url}/api/v1", headers=headers) as client:
        first = client.get("/key").json()["data"]["usage"]
        server.settings.key_lag_s = 0.0
        second = client.get("/key").json()["data"]["usage"]
        third = client.get("/key").json()["data"]["usage"]
        assert first < second == pytest.approx(server.billing.total_usd)  # the balance lags
        assert third < second  # and once moves the wrong way
        assert client.get("/credits").status_code == 403  # needs a management key
        gen = server.billing.bills[0].id
        assert (
            client.get("/generation", params={"id": gen}).json()["data"]["total_cost"] == server.billing.bills[0].cost
        )


def test_fake_bills_a_non_streaming_request_after_its_client_left(tok, fake):
    import asyncio

    import httpx

    server, thread = fake(latency_s=0.5)

    async def leave_early():
        async with httpx.AsyncClient(
            base_url=f"{thread.base_url}/api/v1", headers={"Authorization": f"Bearer {KEY}"}
        ) as c:
            # leaves while waiting for the answer (read 0.1 s), never before the request is sent: a connect timeout
            # as short, on a loaded machine, left before the fake saw anything to bill
            with pytest.raises(httpx.ReadTimeout):
                await c.post(
                    "/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    timeout=httpx.Timeout(60.0, read=0.1),
                )

    asyncio.run(leave_early())
    wait_for(lambda: server.billing.bills, 30, "the fake to bill the abandoned request")
    assert [b.kind for b in server.billing.bills] == ["after_disconnect"]  # what kill -9 cost in the history
