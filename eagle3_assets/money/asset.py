"""`spend`: money at a glance, an observable asset (Observe in the UI reads it now; the credit sensor observes it
whenever a figure changes)."""

from dataclasses import asdict

import dagster as dg

from eagle3_assets.money import SpendPolicy, get_hold, open_ledger, view
from eagle3_assets.money.hold import active_spending_runs
from eagle3_resources.storage import DataStore


@dg.observable_source_asset(  # type: ignore[call-overload]  # `kinds` goes through **kwargs, which dagster 1.13's overloads leave out
    key="spend",
    group_name="completions",
    kinds={"openrouter", "sqlite"},
    description="Money at a glance, observed by the credit sensor when a figure changes (else every 15 min), or now "
    "with Observe: the OpenRouter balance and usage, dollars billed today and in all, per dataset and per run, "
    "requests in flight, unsettled attempts and their worst case, the projected cost of the prompts still pending, "
    "the thresholds, and whether spending is ON HOLD and why (lift it with `eagle3 hold lift` or the lift_spend_hold "
    "job). Each observation keeps the figures (Events tab); `spend_over_time` pictures dollars per dataset over time "
    "against the thresholds. Only Observe (or the daemon's sensor) records an observation: it is never materialized.",
)
def spend(context, store: DataStore, spend_policy: SpendPolicy) -> dg.ObserveResult:
    ledger = open_ledger(store.layout)
    try:
        account = spend_policy.read_account()
    except Exception as e:  # noqa: BLE001 - the ledger's figures are shown without the account's
        context.log.warning(f"could not read the account ({type(e).__name__}: {e}); showing the ledger's figures only")
        account = None
    hold, thresholds = get_hold(ledger), spend_policy.thresholds()
    runs = [r.run_id for r in active_spending_runs(context.instance)]
    figures = view.current_figures(
        context.instance, ledger, asdict(account) if account else None, hold, thresholds, runs
    )
    return dg.ObserveResult(
        metadata=view.observation_metadata(
            {"summary": view.headline(figures, hold), **figures}, view.picture(ledger, thresholds, hold)
        )
    )
