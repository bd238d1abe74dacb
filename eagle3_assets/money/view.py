"""What the operator sees of money: the `spend` asset's figures, picture and cadence.

The credit sensor ticks every few seconds; an observation per tick would bury the asset's history
(923 in two hours). One is recorded when a figure a person reads changes (to the cent, a count,
the hold) or, unchanged, every `HEARTBEAT_S`, so the asset's events show what happened and when
(Dagster 1.13 draws no Plots tab for an observable asset; `spend_over_time` is the picture).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from datetime import UTC
from typing import Any, cast

import dagster as dg

from eagle3_assets.common.registry import DATASETS
from eagle3_assets.money.ledger import Figures, Scope, SpendLedger, scope, settled_series, usd

HEARTBEAT_S = 900.0
SERIES_POINTS = 400  # points per dataset in the picture


def dataset_scopes(ledger: SpendLedger, datasets: list[str]) -> dict[str, Scope]:
    """Each dataset's ledger scope (every run, every attempt), for datasets that ever spent or reserved."""
    out = {}
    for name in datasets:
        s = ledger.read(scope, f"dataset:{name}")
        if s.attempts:
            out[name] = s
    return out


def spend_figures(
    ledger: Figures,
    by_dataset: Mapping[str, Scope],
    account: dict[str, Any] | None,
    hold: dict[str, Any] | None,
    thresholds: Mapping[str, float | None],
    projected: Mapping[str, float],
) -> dict[str, Any]:
    """The figures of one observation (numbers stay numbers in the metadata)."""
    out: dict[str, Any] = {
        "spending": f"ON HOLD since {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(hold['since']))}: "
        + "; ".join(hold["reasons"])
        if hold
        else "allowed (no hold)",
        "spent_total_usd": usd(ledger.total.settled_usd),
        "spent_today_usd": usd(ledger.today.settled_usd),
        "in_flight": ledger.live,
        "in_flight_worst_usd": usd(ledger.total.live_usd),
        "unsettled": ledger.unsettled + ledger.unidentified,
        "unsettled_worst_usd": usd(ledger.total.stuck_usd),
        "projected_pending_usd": usd(sum(projected.values())),
    }
    if account is not None:
        out["account_usage_usd"] = usd(account["usage_usd"])
        if account.get("limit_remaining_usd") is not None:
            out["account_balance_usd"] = usd(account["limit_remaining_usd"])
    for name, s in by_dataset.items():
        out[f"spent_{name}_usd"] = usd(s.settled_usd)
    for name, value in thresholds.items():
        if value is not None:
            out[f"threshold_{name}"] = value
    # Billed, like every other `spent_` figure; what the run cap is checked against (billed + the worst case of what is
    # in flight or unsettled) beside it.
    out["spent_by_run_usd"] = {run: usd(s.settled_usd) for run, s in ledger.runs.items()}
    out["committed_by_run_usd"] = {run: usd(s.committed_usd) for run, s in ledger.runs.items()}
    out["projected_pending_by_dataset_usd"] = {k: usd(v) for k, v in projected.items()}
    return out


def fingerprint(figures: Mapping[str, Any]) -> str:
    """What must change for a new observation: every figure to the cent (those per run and per dataset too), counts,
    the hold's text, which runs are spending and whether each has been billed yet.

    The per-run figures once stayed out of it: a run that started, or spent its first dollars while the totals
    moved by less than a cent, left the last observation showing it at $0 (docs/images/spend_while_running.png).
    """

    def rounded(v):
        if isinstance(v, dict):
            return {k: rounded(x) for k, x in v.items()}
        return round(v, 2) if isinstance(v, float) else v

    keep = {k: rounded(v) for k, v in figures.items()}
    keep["runs_billed"] = {run: value > 0 for run, value in (figures.get("spent_by_run_usd") or {}).items()}
    return hashlib.sha1(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def due(figures: Mapping[str, Any], last: dict[str, Any] | None, now: float, heartbeat_s: float = HEARTBEAT_S) -> bool:
    """Record an observation now? When a figure changed, or when the last one is older than the heartbeat."""
    return last is None or last.get("fingerprint") != fingerprint(figures) or now - last.get("t", 0.0) >= heartbeat_s


def spend_plot(series: list[tuple[str, float, float]], thresholds: Mapping[str, float | None], hold: dict | None):
    """Cumulative dollars billed over time, per dataset and in all, against the total and day thresholds."""
    import matplotlib

    matplotlib.use("Agg")
    from datetime import datetime

    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    by_dataset: dict[str, list[tuple[float, float]]] = {}
    total, running = [], 0.0
    for name, t, cost in series:
        running += cost
        total.append((t, running))
        points = by_dataset.setdefault(name, [])
        points.append((t, (points[-1][1] if points else 0.0) + cost))

    def draw(points, **kw):
        step = max(1, len(points) // SERIES_POINTS)
        kept = points[::step] + ([points[-1]] if (len(points) - 1) % step else [])
        times = [datetime.fromtimestamp(t, UTC) for t, _ in kept]
        # matplotlib converts datetimes through its units registry; its stubs list only array-likes of numbers
        ax.step(times, [v for _, v in kept], where="post", **kw)  # type: ignore[arg-type]

    for name, points in sorted(by_dataset.items()):
        draw(points, label=name, lw=1.2)
    if len(by_dataset) > 1:
        draw(total, label="all", color="black", lw=2)
    for name, style in (("max_total_usd", "--"), ("max_day_usd", ":")):
        limit = thresholds.get(name)
        if limit is not None:
            ax.axhline(limit, color="red", ls=style, lw=1, label=f"{name} ${limit:,.2f}")
    ax.set_ylabel("dollars billed")
    title = f"spend over time: ${running:,.4f} in all"
    ax.set_title(title + ("  (SPENDING ON HOLD)" if hold else ""), color="red" if hold else "black")
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M", tz=UTC))
    fig.autofmt_xdate()
    if by_dataset or any(thresholds.get(n) is not None for n in ("max_total_usd", "max_day_usd")):
        ax.legend(fontsize=7, ncol=4, loc="upper left")
    else:
        ax.text(0.5, 0.5, "nothing billed yet", ha="center", va="center", transform=ax.transAxes)
    plt.close(fig)
    return fig


def pending_projections(instance: dg.DagsterInstance, datasets: list[str]) -> dict[str, float]:
    """Dollars the prompts still pending should cost, per dataset: its pilot's projection, scaled to what is left."""
    out = {}
    for name in datasets:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[name]), limit=1
        ).records
        materialization = records[0].asset_materialization if records else None
        meta = materialization.metadata if materialization is not None else {}
        if "projection" not in meta or "status_pending" not in meta:
            continue
        # the pilot's projection (JSON: prompts, usd) and the prompts still pending, as the completions asset has them
        projection = cast(dict[str, Any], meta["projection"].value)
        pending = cast(int, meta["status_pending"].value)
        if pending and projection.get("prompts"):
            out[name] = projection["usd"] * min(1.0, pending / projection["prompts"])
    return out


def current_figures(
    instance: dg.DagsterInstance,
    ledger: SpendLedger,
    account: dict[str, Any] | None,
    hold: dict[str, Any] | None,
    thresholds: Mapping[str, float | None],
    runs: list[str],
) -> dict[str, Any]:
    """Every figure of the `spend` asset, read now from the ledger, the account and the instance.

    `runs`: the ids of the runs spending now (`hold.active_spending_runs`; the credit sensor has them already).
    """
    return spend_figures(
        ledger.figures(runs),
        dataset_scopes(ledger, list(DATASETS)),
        account,
        hold,
        thresholds,
        pending_projections(instance, list(DATASETS)),
    )


def headline(figures: Mapping[str, Any], hold: dict[str, Any] | None) -> str:
    """The observation's description: the hold first, when there is one."""
    if hold:
        return figures["spending"]
    return (
        f"${figures['spent_today_usd']:,.4f} billed today, ${figures['spent_total_usd']:,.4f} in all; "
        f"{figures['unsettled']} unsettled"
    )


def picture(
    ledger: SpendLedger, thresholds: Mapping[str, float | None], hold: dict[str, Any] | None
) -> dg.MetadataValue:
    from eagle3_assets.common.metadata import png_markdown  # polars, matplotlib: loaded when a picture is drawn

    return png_markdown(spend_plot(ledger.read(settled_series), thresholds, hold))


def observation_metadata(figures: Mapping[str, Any], picture: dg.MetadataValue) -> dict[str, Any]:
    """Figures as Dagster metadata: numbers as numbers, dicts as JSON, the picture last."""
    out: dict[str, Any] = {}
    for key, value in figures.items():
        out[key] = dg.MetadataValue.json(value) if isinstance(value, dict) else value
    out["spend_over_time"] = picture
    return out
