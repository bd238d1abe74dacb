"""The spend ledger in PostgreSQL (EAGLE3_LEDGER_URL) against the same ledger in SQLite: one scripted history of
every operation gives the same attempts, scopes and hold in both; the write lock holds across connections. The
money tests (test_money.py) run their two-process and kill -9 cases on PostgreSQL too, judged by the fake
provider's own bills."""

from __future__ import annotations

import threading

import psycopg2
import pytest
from ledger_invariants import check_ledgers
from support import ledger_rows

from eagle3_assets.money import Caps, SpendLedger, open_ledger
from eagle3_assets.money import ledger as L
from eagle3_assets.money.database import PostgresDatabase
from eagle3_assets.money.writer import LedgerWriter
from eagle3_resources.storage import DataLayout

CAPS = Caps(run_usd=1.0, day_usd=None, total_usd=0.05, token_budget=None)


def history(ledger: SpendLedger) -> None:
    """Every operation once or more: reservations up to the total cap, bills, releases, cuts with and without a
    generation id, look-ups in vain (their backoff), the horizon, a late bill of an expired attempt, the hold."""
    now = 1_800_000_000.0
    wants = [L.Want(f"p{i}", 1, 0.004, 400) for i in range(20)]
    ids, block = ledger.write(L.reserve, wants, run_id="r1", dataset="B6", owner="host:1", caps=CAPS, now=now)
    assert len(ids) == 12 and block is not None and "total dollar cap" in block.reason
    for i, attempt in enumerate(ids):
        if i % 4 != 3:
            ledger.write(L.opened, attempt, f"gen-{i}")
    for i in range(0, 6):
        ledger.write(
            L.settle,
            ids[i],
            cost_usd=0.001 * (i + 1),
            prompt_tokens=10 + i,
            completion_tokens=100 + i,
            source="stream",
            now=now + 1 + i,
            finish_reason="stop",
            provider="Moonshot AI",
        )
    assert not ledger.write(
        L.settle, ids[0], cost_usd=9.0, prompt_tokens=1, completion_tokens=1, source="again", now=now + 9
    )
    ledger.write(L.release, ids[6], "refused", now + 7)
    assert ledger.write(L.unsettle, ids[7], None, "cut before its id", now + 8) == "unidentified"
    assert ledger.write(L.unsettle, ids[8], "gen-8", "cut", now + 8) == "unsettled"
    assert ledger.write(L.unsettle, ids[9], "gen-9", "cut", now + 8) == "unsettled"
    assert ledger.write(L.unsettle, ids[10], "gen-10", "cut", now + 8) == "unsettled"
    ledger.write(
        L.settle,
        ids[10],
        cost_usd=0.0015,
        prompt_tokens=12,
        completion_tokens=90,
        source="lookup",
        now=now + 9,
        finish_reason="stop",
    )  # a stuck attempt settled: its worst case leaves the stuck sums
    for k in range(3):
        ledger.write(L.looked_up_in_vain, ids[8], now + 10 + k)
    ledger.write(L.looked_up_in_vain, ids[9], now + 10)
    ledger.write(L.mark_recovered, [ids[3]], True)
    assert sorted(ledger.write(L.expire, now + 8 + 100, 50.0)) == sorted(
        (a, "B6", f"p{i}") for i, a in enumerate(ids) if i in (7, 8, 9)
    )
    ledger.write(
        L.settle,
        ids[9],
        cost_usd=0.002,
        prompt_tokens=5,
        completion_tokens=50,
        source="lookup",
        now=now + 200,
        finish_reason="length",
    )
    ledger.write(L.set_hold, ["account balance $0.40 < minimum $0.50"], {"usage": 1.5}, {"min": 0.5}, now + 300)
    ledger.write(L.set_hold, ["daily cap"], {"usage": 2.5}, {"day": 2.0}, now + 301)  # replaced, one row
    held, _ = ledger.write(
        L.reserve, [L.Want("q", 1, 0.001, 10)], run_id="r2", dataset="B7", owner="host:2", caps=CAPS, now=now + 302
    )
    assert held == []
    ledger.write(L.lift_hold, now + 400, "topped up")


def comparable(ledger: SpendLedger) -> dict:
    """What both databases must agree on; attempt ids are random, so rows are keyed by dataset, prompt and number."""
    rows = sorted(
        (r["dataset"], r["prompt_id"], r["number"], {k: v for k, v in r.items() if k != "attempt_id"})
        for r in ledger_rows(ledger)
    )
    scopes = ledger.read(lambda conn: sorted(conn.execute("select * from scopes").fetchall()))
    log = ledger.read(
        lambda conn: [tuple(r[:2]) for r in conn.execute("select t, event from hold_log order by t").fetchall()]
    )
    figures = ledger.figures(["r1"], now=1_800_000_000.0 + 500)
    return {
        "rows": rows,
        "scopes": scopes,
        "hold_log": log,
        "hold": ledger.hold(),
        "figures": figures,
        "due": [g for _, g in ledger.read(L.due_lookups, 1_800_000_000.0 + 10_000, 10)],
        "lost": sorted(
            ({k: v for k, v in r.items() if k != "attempt_id"} for r in ledger.read(L.lost_answers, "B6")),
            key=lambda r: r["prompt_id"],
        ),
        "blocked": ledger.read(L.blocked_prompts, "B6"),
    }


def test_one_history_gives_the_same_ledger_in_sqlite_and_postgres(tmp_path, postgres_url):
    sqlite, postgres = SpendLedger(tmp_path / "spend.sqlite"), SpendLedger(postgres_url)
    try:
        history(sqlite)
        history(postgres)
        assert postgres.location.startswith("postgresql://postgres@127.0.0.1:")
        ours, theirs = comparable(sqlite), comparable(postgres)
        assert ours["scopes"] and ours["rows"]
        for key in ours:
            assert theirs[key] == ours[key], key
        # Not only equal to each other: each equal to its own rows, summed by code of the test's own.
        assert check_ledgers([sqlite.location, postgres_url]) == []
    finally:
        sqlite.close()
        postgres.close()
    # In its own schema, beside whatever else the database holds (a Dagster instance's tables).
    with psycopg2.connect(postgres_url) as conn, conn.cursor() as cur:
        cur.execute("select table_name from information_schema.tables where table_schema = 'eagle3_spend' order by 1")
        assert [t for (t,) in cur.fetchall()] == ["attempts", "hold", "hold_log", "meta", "scopes"]
        cur.execute(
            "select data_type from information_schema.columns where table_name = 'attempts' "
            "and column_name = 'cost_usd'"
        )
        assert cur.fetchone() == ("double precision",)


def test_writers_on_many_connections_never_share_headroom(postgres_url: str) -> None:
    """Eight connections reserving at once against one total cap: the advisory write lock admits exactly what fits."""
    SpendLedger(postgres_url).close()  # created once; the writers then race on the data only
    granted: list[int] = []
    barrier = threading.Barrier(8)

    def writer(k: int) -> None:
        ledger = SpendLedger(postgres_url)
        try:
            barrier.wait()
            for i in range(10):
                ids, _ = ledger.write(
                    L.reserve,
                    [L.Want(f"w{k}-{i}", 1, 0.001, 10)],
                    run_id=f"r{k}",
                    dataset="B6",
                    owner=f"host:{k}",
                    caps=Caps(total_usd=0.0355),
                    now=1_800_000_000.0,
                )
                granted.append(len(ids))
        finally:
            ledger.close()

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sum(granted) == 35  # 80 asked of $0.001 each under a $0.0355 cap: never 36
    ledger = SpendLedger(postgres_url)
    try:
        assert ledger.figures().total.live_usd == pytest.approx(0.035)
    finally:
        ledger.close()


def test_open_ledger_follows_the_environment_and_the_writer_commits_in_postgres(tmp_path, postgres_url, monkeypatch):
    monkeypatch.setenv("EAGLE3_LEDGER_URL", postgres_url)
    ledger = open_ledger(DataLayout(tmp_path / "data"))
    assert ledger.location.startswith("postgresql://") and not (tmp_path / "data" / "ledger").exists()
    with LedgerWriter(ledger) as writer:
        done = []
        for i in range(50):
            writer.post(
                L.reserve,
                [L.Want(f"p{i}", 1, 0.001, 10)],
                run_id="r",
                dataset="B6",
                owner="h:1",
                caps=Caps(),
                now=1_800_000_000.0,
                on_commit=lambda ok, value: done.append(ok),
            )
        writer.post(
            L.settle,
            "no-such-attempt",
            cost_usd=1.0,
            prompt_tokens=1,
            completion_tokens=1,
            source="x",
            now=0.0,
            on_commit=lambda ok, value: done.append(value),
        )
    assert done == [True] * 50 + [False]  # a no-op settle of an unknown attempt returns False, committed
    assert ledger.figures().total.attempts == 50


def test_a_connection_the_server_dropped_is_made_again(postgres_url):
    """A long-lived process (the code server's credit sensor) keeps its ledger across a server restart or an idle
    drop: the next statement reconnects. A transaction that loses its connection fails, and nothing of it commits."""
    ledger = SpendLedger(postgres_url)

    def drop() -> None:
        with psycopg2.connect(postgres_url) as conn, conn.cursor() as cur:
            cur.execute(
                "select pg_terminate_backend(pid) from pg_stat_activity where application_name like "
                "'eagle3 spend ledger%' and datname = current_database() and pid <> pg_backend_pid()"
            )
            assert cur.fetchall() == [(True,)]

    try:
        assert isinstance(ledger._db, PostgresDatabase)
        first = ledger._db.conn.get_backend_pid()
        drop()
        assert ledger.figures().total.attempts == 0  # a read, on a new connection
        assert ledger._db.conn.get_backend_pid() != first
        drop()
        ids, _ = ledger.write(
            L.reserve,
            [L.Want("p", 1, 0.001, 10)],
            run_id="r",
            dataset="B6",
            owner="h:1",
            caps=Caps(),
            now=1_800_000_000.0,
        )
        assert len(ids) == 1 and ledger.figures().total.attempts == 1  # a write transaction, begun on a new connection

        def dropped_midway(conn):
            L.opened(conn, ids[0], "gen-1")
            drop()
            L.opened(conn, ids[0], "gen-2")  # the connection is gone: the transaction fails

        with pytest.raises(psycopg2.OperationalError):
            ledger.write(dropped_midway)
        assert ledger.read(lambda conn: conn.execute("select state, generation_id from attempts").fetchall()) == [
            ("reserved", None)
        ]
    finally:
        ledger.close()
