"""The spend ledger's figures checked from outside, after every test that opened a ledger.

The ledger keeps per-scope sums (`total`, `day:<UTC date>`, `run:<id>`, `dataset:<name>`) up to date in the same
transactions as its attempt rows, so a cap reads one row instead of the history. A wrong delta in one branch of
settle/unsettle/expire leaves every cap charged with phantom spend (or missing real spend), and two databases
running the same code agree on the wrong figure. So this module reads the database with its own connection and
its own SQL (nothing from eagle3_assets.money) and checks:

1. every scope row equals the sums over its attempt rows, by state: a row with a bill (`cost_usd` set) counts its
   cost as settled; `unsettled`/`unidentified` (stuck) and `expired` count their worst case there; any other state
   without a bill (reserved, open, or a newer pre-send state) is live at its worst case; `released` is $0;
2. every dollar the fake provider billed is in the ledger: settled at its exact cost (matched by generation id, or
   by the attempt id the client sent), or held (live, stuck, or expired after the horizon) at a worst case no
   smaller; every settled dollar in the ledger is a bill of the fake's (no phantom settlement);
3. when nothing is live, stuck or expired, what the ledgers settled equals what the fakes billed, to the dollar.

`Watch` (installed by the autouse fixture in conftest.py) records every SpendLedger and FakeOpenRouter a test
creates in-process and runs these checks when the test ends; a test that drove its fake from a subprocess passes
the bills itself (`read_billing_log` reads the fake's `--log-billing` lines).
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STUCK = ("unsettled", "unidentified")
USD_COLUMNS = ("settled_usd", "live_usd", "stuck_usd", "expired_usd")
COUNT_COLUMNS = ("settled_tokens", "live_tokens", "stuck_tokens", "attempts")
ATTEMPT_COLUMNS = (
    "attempt_id",
    "run_id",
    "dataset",
    "day",
    "state",
    "reserved_usd",
    "reserved_tokens",
    "cost_usd",
    "completion_tokens",
    "generation_id",
    "source",
)


def _rows(cur, sql: str) -> list[dict[str, Any]]:
    cur.execute(sql)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]  # a name per column


def read_ledger(location: str) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]] | None:
    """(attempt rows, scope rows by key) read with a connection of our own; None if there is no ledger there."""
    attempts = f"select {', '.join(ATTEMPT_COLUMNS)} from attempts"
    scopes = f"select scope, {', '.join(USD_COLUMNS + COUNT_COLUMNS)} from scopes"
    if location.startswith(("postgresql:", "postgres:", "postgresql+psycopg2:")):
        import psycopg2

        conn = psycopg2.connect(location.replace("postgresql+psycopg2:", "postgresql:"))
        try:
            with conn.cursor() as cur:
                cur.execute(
                    "select 1 from information_schema.tables where table_schema = 'eagle3_spend' "
                    "and table_name = 'scopes'"
                )
                if cur.fetchone() is None:
                    return None
                cur.execute("set search_path to eagle3_spend")
                rows, scope_rows = _rows(cur, attempts), _rows(cur, scopes)
        finally:
            conn.close()
    else:
        if not Path(location).exists():
            return None
        conn = sqlite3.connect(f"file:{location}?mode=ro", uri=True, timeout=60)
        try:
            rows, scope_rows = _rows(conn.cursor(), attempts), _rows(conn.cursor(), scopes)
        finally:
            conn.close()
    return rows, {s.pop("scope"): s for s in scope_rows}


def expected_scopes(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The scope sums the attempt rows imply (see the module's docstring for the rule per state)."""
    sums: dict[str, dict[str, float]] = {}
    for r in rows:
        delta = dict.fromkeys(USD_COLUMNS + COUNT_COLUMNS, 0)
        delta["attempts"] = 1
        if r["state"] in STUCK:
            delta["stuck_usd"], delta["stuck_tokens"] = r["reserved_usd"], r["reserved_tokens"]
        elif r["state"] == "expired":
            delta["expired_usd"] = r["reserved_usd"]
        elif r["cost_usd"] is not None:  # settled (or released: $0 with no tokens)
            delta["settled_usd"], delta["settled_tokens"] = r["cost_usd"], r["completion_tokens"] or 0
        elif r["state"] != "released":  # reserved, open, or any state before a bill: live at the worst case
            delta["live_usd"], delta["live_tokens"] = r["reserved_usd"], r["reserved_tokens"]
        for key in ("total", f"day:{r['day']}", f"run:{r['run_id']}", f"dataset:{r['dataset']}"):
            row = sums.setdefault(key, dict.fromkeys(USD_COLUMNS + COUNT_COLUMNS, 0))
            for col, v in delta.items():
                row[col] += v
    return sums


def scope_problems(rows: list[dict[str, Any]], scopes: dict[str, dict[str, Any]]) -> list[str]:
    want = expected_scopes(rows)
    problems = []
    for key in sorted(set(want) | set(scopes)):
        have, should = scopes.get(key), want.get(key)
        if have is None:
            problems.append(f"scope {key}: no row, attempts imply {should}")
            continue
        should = should or dict.fromkeys(USD_COLUMNS + COUNT_COLUMNS, 0)
        for col in USD_COLUMNS:
            if not math.isclose(have[col], should[col], rel_tol=1e-9, abs_tol=1e-9):
                problems.append(f"scope {key}: {col} {have[col]!r}, its attempts sum to {should[col]!r}")
        for col in COUNT_COLUMNS:
            if have[col] != should[col]:
                problems.append(f"scope {key}: {col} {have[col]!r}, its attempts sum to {should[col]!r}")
    return problems


@dataclass
class BillRecord:
    id: str
    cost: float
    attempt: str | None
    kind: str


def bills_of(fakes: Iterable[Any]) -> list[BillRecord]:
    """The bills of in-process fakes (their own state, as they billed)."""
    return [BillRecord(b.id, b.cost, b.attempt, b.kind) for fake in fakes for b in list(fake.billing.bills)]


def read_billing_log(text: str) -> list[BillRecord]:
    """The bills a fake started with `--log-billing` printed (one JSON object a line; other lines skipped)."""
    bills = []
    for line in text.splitlines():
        try:
            b = json.loads(line)
        except ValueError:
            continue
        if isinstance(b, dict) and "cost" in b and "id" in b:
            bills.append(BillRecord(b["id"], b["cost"], b.get("attempt"), b.get("kind", "")))
    return bills


def bill_problems(rows: list[dict[str, Any]], bills: list[BillRecord]) -> list[str]:
    """Bills against attempt rows (of every ledger the test used), both ways, and the sums once all is settled."""
    problems = []
    by_generation = {r["generation_id"]: r for r in rows if r["generation_id"]}
    by_attempt = {r["attempt_id"]: r for r in rows}
    billed = {b.id: b for b in bills}
    for b in bills:
        row = by_generation.get(b.id) or by_attempt.get(b.attempt or "")
        if row is None:
            if b.cost:
                problems.append(f"bill {b.id} ({b.kind}, ${b.cost:.6f}): not in any ledger")
        elif row["cost_usd"] is not None:  # settled (released: $0)
            if not math.isclose(row["cost_usd"], b.cost, rel_tol=1e-9, abs_tol=1e-12):
                problems.append(f"bill {b.id} ${b.cost:.6f}: {row['state']} in the ledger at ${row['cost_usd']:.6f}")
        elif row["reserved_usd"] + 1e-12 < b.cost:  # live, stuck, or expired (the horizon passed: in expired_usd)
            problems.append(f"bill {b.id} ${b.cost:.6f}: {row['state']} in the ledger, ${row['reserved_usd']:.6f} held")
    for r in rows:
        if r["cost_usd"] and r["source"] != "journal-import" and r["generation_id"] not in billed:
            problems.append(
                f"attempt {r['attempt_id']} settled at ${r['cost_usd']:.6f} for {r['generation_id']}: no such bill"
            )
    if not any(
        r["state"] in STUCK + ("expired",) or (r["cost_usd"] is None and r["state"] != "released") for r in rows
    ):
        settled = math.fsum(r["cost_usd"] or 0.0 for r in rows if r["source"] != "journal-import")
        total = math.fsum(b.cost for b in bills)
        if not math.isclose(settled, total, rel_tol=1e-9, abs_tol=1e-12):
            problems.append(f"everything is settled, at ${settled:.6f}; the fakes billed ${total:.6f}")
    return problems


def unfinished(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Attempts still live or stuck (any state without a bill but released and expired)."""
    return [r for r in rows if r["cost_usd"] is None and r["state"] not in ("released", "expired")]


def check_ledgers(
    locations: Iterable[str], bills: list[BillRecord] | None = None, *, settled: bool = False
) -> list[str]:
    """Every check above on the ledgers at `locations` (paths or PostgreSQL URLs); [] when all hold. `bills`: the
    provider's, when a fake was driven (None: no provider to compare with). `settled`: nothing may be live or stuck."""
    problems, all_rows, read_any = [], [], False
    for where in dict.fromkeys(str(w) for w in locations):
        read = read_ledger(where)
        if read is None:
            continue
        read_any = True
        rows, scopes = read
        problems += [f"{where}: {p}" for p in scope_problems(rows, scopes)]
        if settled:
            problems += [
                f"{where}: attempt {r['attempt_id']} of {r['dataset']} still {r['state']}" for r in unfinished(rows)
            ]
        all_rows += rows
    if bills is not None and read_any:  # (a test that drove a fake with no ledger at all has nothing to compare)
        problems += bill_problems(all_rows, bills)
    return problems


@dataclass
class Watch:
    """The ledgers and fakes a test made in this process, checked when it ends."""

    ledgers: list[str] = field(default_factory=list)
    fakes: list[Any] = field(default_factory=list)

    def install(self, monkeypatch) -> Watch:
        from fakes.openrouter.server import FakeOpenRouter

        from eagle3_assets.money.ledger import SpendLedger

        ledger_init, fake_init = SpendLedger.__init__, FakeOpenRouter.__init__

        def ledger(this, where, *args, **kwargs):
            ledger_init(this, where, *args, **kwargs)
            self.ledgers.append(str(where))

        def fake(this, *args, **kwargs):
            fake_init(this, *args, **kwargs)
            self.fakes.append(this)

        monkeypatch.setattr(SpendLedger, "__init__", ledger)
        monkeypatch.setattr(FakeOpenRouter, "__init__", fake)
        return self

    def problems(self) -> list[str]:
        return check_ledgers(self.ledgers, bills_of(self.fakes) if self.fakes else None)
