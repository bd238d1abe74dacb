"""The run cap (`max_run_usd`) as an operator sets it: a real Dagster instance materializes a dataset's completions
against the loopback fake OpenRouter, and the fake's own bills are the oracle.

Every answer here runs to `max_tokens` (the fake's answers are far longer), so each bill equals its reservation's
worst case: an admission that reserved less than the worst case would let the run bill beyond its cap, which a
run of short answers (costing a fraction of their worst case) hides."""

from __future__ import annotations

import dagster as dg
import pytest
from fakes.openrouter import FakeOpenRouter, FakeSettings, ServerThread
from ledger_invariants import bills_of, check_ledgers

from eagle3_assets.money import SpendPolicy, open_ledger
from eagle3_assets.money import ledger as L
from eagle3_assets.stages.completions.asset import completions
from eagle3_assets.stages.raw_prompts.asset import raw_prompts
from eagle3_resources.completions.resource import BackendKind, CompletionsResource
from eagle3_resources.journal import read_journal
from eagle3_resources.storage import DataStore
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

KEY = "k-run-cap"
MAX_TOKENS = 48
CAP_USD = 0.003  # about 10 of B6's 28 worst cases ($0.0082 in all): the cap, not the prompts, ends the run


@pytest.mark.timeout(600)
def test_a_run_capped_in_dagster_never_bills_beyond_its_cap_when_every_answer_costs_its_worst_case(
    data_dir_with_standin, tok, monkeypatch
):
    for var in ("EAGLE3_MAX_RUN_USD", "EAGLE3_MAX_DAY_USD", "EAGLE3_MAX_TOTAL_USD", "EAGLE3_MIN_BALANCE_USD"):
        monkeypatch.delenv(var, raising=False)
    fake = FakeOpenRouter(tok, FakeSettings(api_key=KEY, latency_s=0.1, mean_reasoning_words=400))
    store = DataStore(root=str(data_dir_with_standin))
    with ServerThread(fake.app) as server, dg.instance_for_test() as instance:
        resources = {
            "store": store,
            "tokenizer": TokenizerResource(standin_dir=str(data_dir_with_standin / "standin")),
            "target": TargetModelResource(standin_dir=str(data_dir_with_standin / "standin")),
            "completions_backend": CompletionsResource(
                backend=BackendKind.OPENROUTER, openrouter_base_url=f"{server.base_url}/api/v1", openrouter_api_key=KEY
            ),
            "spend_policy": SpendPolicy(),
        }
        result = dg.materialize(
            [raw_prompts, completions],
            instance=instance,
            resources=resources,
            partition_key="B6",
            raise_on_error=False,
            run_config={
                "ops": {"completions": {"config": {"max_tokens": MAX_TOKENS, "pilot_size": 0, "max_run_usd": CAP_USD}}}
            },
        )
    bills = fake.billing.bills
    billed = fake.billing.total_usd
    print(f"{len(bills)} bills, ${billed:.6f} billed under a ${CAP_USD} run cap")
    # The premise: every answer was cut at max_tokens, so it cost exactly the worst case admission reserved for it.
    assert bills and all(b.completion_tokens == MAX_TOKENS and b.finish_reason == "length" for b in bills)
    assert billed <= CAP_USD  # the fake's own sum: the cap held
    assert billed > CAP_USD - 2 * max(b.cost for b in bills)  # and the run spent up to it (not stopped early)
    ends = [r for r in read_journal(store.layout.completions_journal("B6")).records if r.get("type") == "end"]
    assert any("run dollar cap" in (e.get("stopped_by") or "") for e in ends), ends
    ledger = open_ledger(store.layout)
    run_scope = ledger.read(L.scope, f"run:{result.run_id}")
    assert run_scope.settled_usd == pytest.approx(billed, rel=1e-9)
    assert check_ledgers([ledger.location], bills_of([fake]), settled=True) == []
