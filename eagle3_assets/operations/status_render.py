"""`eagle3 status` in words: a `Status` as text for a terminal (with colour where it is wanted) and as JSON."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from eagle3_assets.common.registry import DATASETS
from eagle3_assets.common.standin import STANDIN_TAG, STANDIN_TARGET
from eagle3_assets.operations.status_model import PARTITIONED, StageState, Status

WIDTH = 118


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 48 * 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}" if s < 10 * 3600 else f"{s // 3600}h"
    return f"{s // 86400}d"


def count(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    n = int(value)
    if abs(n) < 1_000_000:
        return f"{n:,}"
    if abs(n) < 1_000_000_000:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e9:.1f}G"


def dollars(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.0f}"


def nbytes(value: Any) -> str:
    if value is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{int(value)} B"


def span(datasets: Sequence[str]) -> str:
    """A run's datasets, short: `B6`, `A1,B2`, `A1...B8` for a registry range of three or more."""
    names = list(DATASETS)
    if not datasets:
        return "-"
    idx = [names.index(d) for d in datasets if d in names]
    if len(idx) == len(datasets) >= 3 and idx == list(range(idx[0], idx[-1] + 1)):
        return f"{datasets[0]}...{datasets[-1]}"
    return ",".join(datasets)


def _age_of(status: Status, stage: StageState) -> str:
    """How long ago the stage was materialized, as the status was read."""
    return age(status.at - stage.timestamp if stage.timestamp is not None else None)


def utc(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M UTC")


class _Paint:
    def __init__(self, on: bool):
        self.on = on

    def __call__(self, text: str, colour: str) -> str:
        codes = {"green": "32", "yellow": "33", "red": "31", "dim": "2", "bold": "1"}
        return f"\033[{codes[colour]}m{text}\033[0m" if self.on and text.strip() else text


def _checks_cell(stage: StageState) -> tuple[str, str]:
    """(text, colour) of a stage's checks in the table: ok, `2 WARN`, `1 ERROR`, or - when none was evaluated."""
    failing = stage.failing
    if not stage.checks:
        return "-", "dim"
    if not failing:
        return "ok", "green"
    worst = "ERROR" if any(c.severity == "ERROR" for c in failing) else "WARN"
    return f"{len(failing)} {worst}", "red" if worst == "ERROR" else "yellow"


# (label, width) per stage group of the dataset table: when, figures, checks
GROUP_COLUMNS = {
    "raw_prompts": [("age", 5), ("rows", 7), ("tokens", 9), ("checks", 7)],
    "completions": [("age", 5), ("rows", 7), ("tokens", 9), ("usd", 8), ("checks", 7)],
    "token_ids": [("age", 5), ("rows", 7), ("tokens", 9), ("checks", 7)],
}
GAP = "  "


def _group_width(asset: str) -> int:
    cols = GROUP_COLUMNS[asset]
    return sum(w for _, w in cols) + len(cols) - 1


def _dataset_table(status: Status, paint: _Paint) -> list[str]:
    name_w = max([7, *(len(d.dataset) for d in status.datasets)])
    head1 = f"{'':{name_w}}" + "".join(GAP + f"{PARTITIONED[a][0]:<{_group_width(a)}}" for a in GROUP_COLUMNS)
    head2 = f"{'dataset':{name_w}}" + "".join(
        GAP + " ".join(f"{label:>{w}}" if label not in ("age", "checks") else f"{label:<{w}}" for label, w in cols)
        for cols in GROUP_COLUMNS.values()
    )
    lines = [paint(head1.rstrip(), "bold"), paint(head2.rstrip(), "bold")]
    shared_any = False
    for row in status.datasets:
        line = f"{row.dataset:{name_w}}"
        notes = []
        for asset, cols in GROUP_COLUMNS.items():
            stage = row.stages[asset]
            line += GAP
            if not stage.materialized:
                line += paint(f"{'not materialized':<{_group_width(asset)}}", "dim")
                if stage.failing:
                    notes.append(f"{PARTITIONED[asset][0]}: " + ", ".join(c.shown for c in stage.failing))
                continue
            cells = []
            for label, w in cols:
                if label == "age":
                    cells.append(f"{_age_of(status, stage):<{w}}")
                elif label == "checks":
                    text, colour = _checks_cell(stage)
                    cells.append(paint(f"{text:<{w}}", colour))
                else:
                    value = stage.figures.get(label)
                    text = dollars(value) if label == "usd" else count(value)
                    if label in stage.shared:
                        text += "*"
                        shared_any = True
                    cells.append(f"{text:>{w}}")
            line += " ".join(cells)
            if stage.failing:
                notes.append(f"{PARTITIONED[asset][0]}: " + ", ".join(c.shown for c in stage.failing))
        lines.append(line.rstrip())
        if notes:
            indent = " " * (name_w + len(GAP))
            for wrapped in textwrap.wrap("failing: " + "; ".join(notes), WIDTH - len(indent)):
                lines.append(indent + paint(wrapped, "yellow"))
    if shared_any:
        lines.append("* the run's total over all its datasets (its metadata holds no figure of this dataset alone)")
    return lines


def _standin_legend(status: Status) -> list[str]:
    """Under the dataset table, where a failure shown is the stand-in's: what its tag means (one line)."""
    stages = [*(s for d in status.datasets for s in d.stages.values()), *status.stages]
    if not any(c.standin for s in stages for c in s.failing):
        return []
    return textwrap.wrap(
        f"{STANDIN_TAG} expected of {STANDIN_TARGET}, not a fault; each check's description says why", WIDTH
    )


def _stage_table(status: Status, paint: _Paint) -> list[str]:
    lines = [paint(f"{'stage':<15} {'age':<5} {'figures':<58} checks", "bold")]
    for stage in status.stages:
        if not stage.materialized:
            lines.append(f"{stage.asset:<15} {'-':<5} " + paint("not materialized", "dim"))
            continue
        parts = []
        for label, value in stage.figures.items():
            text = nbytes(value) if label == "bytes" else count(value)
            parts.append(f"{label} {text}")
        text, colour = _checks_cell(stage)
        checks = paint(", ".join(c.shown for c in stage.failing) if stage.failing else text, colour)
        lines.append(f"{stage.asset:<15} {_age_of(status, stage):<5} {'  '.join(parts):<58} {checks}")
    return lines


def _runs_lines(status: Status, paint: _Paint) -> list[str]:
    if not status.runs:
        return ["no runs in progress (queued, starting, started or cancelling)"]
    lines = [paint(f"{'run':<8}  {'status':<11} {'job':<22} {'datasets':<14} {'queued':>7} {'running':>8}", "bold")]
    for r in status.runs:
        running = age(status.at - r.started) if r.started else "-"
        colour = "red" if r.status == "CANCELING" else "yellow" if r.status in ("QUEUED", "NOT_STARTED") else "green"
        lines.append(
            f"{r.run_id[:8]:<8}  {paint(f'{r.status:<11}', colour)} {r.job[:22]:<22} {span(r.datasets)[:14]:<14} "
            f"{age(status.at - r.created):>7} {running:>8}" + ("  spends" if r.spends else "")
        )
        lines += [f"{'':10}{ds}: {line}" for ds, line in sorted(r.progress.items())]
    return lines


def _money_lines(status: Status, paint: _Paint) -> list[str]:
    m = status.money
    if m is None:
        return ["spend ledger: not read"]
    lines = [
        (
            f"billed ${m.billed_usd:.4f} in all, ${m.today_usd:.4f} today ({m.day} UTC); in flight {m.in_flight} "
            f"(worst ${m.in_flight_worst_usd:.4f}); unsettled {m.unsettled + m.unidentified} "
            f"(worst ${m.unsettled_worst_usd:.4f})"
        )
    ]
    if m.expired_worst_usd:
        lines.append(f"expired unsettled (never billed, horizon passed): worst ${m.expired_worst_usd:.4f}")
    if m.per_dataset:
        per = ", ".join(
            f"{ds} ${f['billed_usd']:.4f}"
            + (
                f" (+${f['in_flight_worst_usd'] + f['unsettled_worst_usd']:.4f} open)"
                if f["in_flight_worst_usd"] + f["unsettled_worst_usd"]
                else ""
            )
            for ds, f in m.per_dataset.items()
        )
        lines += textwrap.wrap("per dataset: " + per, WIDTH, subsequent_indent="  ")
    if m.hold is None:
        lines.append("spending hold: none")
    else:
        lines.append(
            paint(f"SPENDING HELD since {utc(m.hold['since'])} ({age(status.at - m.hold['since'])} ago):", "red")
        )
        for reason in m.hold["reasons"]:
            lines += textwrap.wrap(reason, WIDTH, initial_indent="  ", subsequent_indent="    ")
        lines.append("  `eagle3 hold lift` lifts it (the credit sensor sets it again while a threshold is crossed)")
    lines.append(paint(f"ledger {m.ledger}", "dim"))
    return lines


def render_text(status: Status, colour: bool = False) -> str:
    paint = _Paint(colour)
    out = [
        paint(f"eagle3 status at {utc(status.at)}", "bold"),
        f"DAGSTER_HOME {status.dagster_home or '-'}",
        f"data root    {status.data_dir or '-'}",
        "",
    ]
    out += _dataset_table(status, paint) + _standin_legend(status)
    out += [""] + _stage_table(status, paint)
    out += ["", paint("runs", "bold")] + _runs_lines(status, paint)
    out += ["", paint("money", "bold")] + _money_lines(status, paint)
    if status.errors:
        out += ["", paint("could not read:", "red")] + [f"  {e}" for e in status.errors]
    return "\n".join(out) + "\n"


def _iso(t: float | None) -> str | None:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds") if t is not None else None


def as_json(status: Status) -> dict[str, Any]:
    """The same data as the text, for scripts: times as ISO 8601 UTC (and `age_s`), money in dollars."""

    def stage(s: StageState) -> dict[str, Any]:
        d = asdict(s)
        d["materialized_at"], d["age_s"] = (
            _iso(s.timestamp),
            (round(status.at - s.timestamp, 1) if s.timestamp else None),
        )
        d["checks"] = {c.name: {**asdict(c), "at": _iso(c.timestamp)} for c in s.checks}
        d["failing"] = [c.label for c in s.failing]
        d.pop("timestamp")
        return d

    money = asdict(status.money) if status.money else None
    if money and money["hold"]:
        money["hold"]["since"] = _iso(money["hold"]["since"])
    return {
        "at": _iso(status.at),
        "dagster_home": status.dagster_home,
        "data_dir": status.data_dir,
        "datasets": {d.dataset: {asset: stage(s) for asset, s in d.stages.items()} for d in status.datasets},
        "stages": {s.asset: stage(s) for s in status.stages},
        "runs": [{**asdict(r), "created": _iso(r.created), "started": _iso(r.started)} for r in status.runs],
        "money": money,
        "errors": status.errors,
    }


def colour_wanted(stream=None) -> bool:
    stream = stream or sys.stdout
    return (
        hasattr(stream, "isatty")
        and stream.isatty()
        and not os.environ.get("NO_COLOR")
        and os.environ.get("TERM") != "dumb"
    )
