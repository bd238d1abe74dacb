r"""The spend ledger: one database shared by every process that spends. By default an SQLite file under
the data root; with EAGLE3_LEDGER_URL, a PostgreSQL database that processes on several hosts share
(eagle3_assets/money/database.py).

Why SQLite in WAL mode by default: transactions across the processes of one host with no server to
run; indexed reads, so the credit sensor's figures cost the same whatever the history (scope rows are
kept up to date in the same transactions as the attempts); and durability against kill -9 without
an fsync per write (a committed transaction is in the OS page cache; with `synchronous=NORMAL`
WAL fsyncs at checkpoints, so only a power cut can lose the last moments). WAL does not work over
network filesystems: hosts that share a data root need the ledger in PostgreSQL instead.

Every attempt of every request is one row, reserved at its worst case (prompt + `max_tokens` at
the highest price the routing allows) just before it is sent (after any pacing wait), in the same
transaction that checks the caps against settled + reserved spend of every process. Its send is then
marked (`sent_at`, committed before a byte leaves the process): after a crash, a reservation without
the mark was never sent and is released at once; one with it may have been billed and is kept.

    reserved --(response headers: generation id)--> open --(bill)--> settled
       |   \--(nothing was generated: refused, not sent)--> released ($0)
       |    \--(cut short with a generation id, no bill)--> unsettled --(look-up finds it)--> settled
       |     \--(marked sent, cut short before any id; its process died)--> unidentified
       |      \--(not marked sent; its process died)--> released ($0)
       \--------------------------- unsettled / unidentified --(horizon passes)--> expired

reserved and open are *live* (a process is waiting on them); unsettled and unidentified are
*stuck*: money possibly spent that no bill confirms yet. Both count against every cap at their
worst case, and a prompt with a stuck attempt is not sent again, until the bill is found or the
horizon passes. Scope rows keep the sums per `total`, `day:<UTC date>`, `run:<id>`, `dataset:<name>`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from eagle3_assets.money.caps import Caps
from eagle3_assets.money.database import Connection, connect

# The partial index's own condition, repeated in queries on unfinished attempts: SQLite uses a partial
# index only where the query's WHERE visibly implies the index's (a sensor tick must not scan history).
UNFINISHED = "state in ('reserved', 'open', 'unsettled', 'unidentified')"
LIVE = ("reserved", "open")
STUCK = ("unsettled", "unidentified")
FINAL = ("settled", "released", "expired")
DEFAULT_HORIZON_S = 15 * 60.0
LOOKUP_BACKOFF_CAP_S = 60.0

SCHEMA = """
create table if not exists meta (key text primary key, value text);
create table if not exists attempts (
    attempt_id text primary key,
    run_id text not null,
    dataset text not null,
    prompt_id text not null,
    number integer not null,
    owner text not null,
    day text not null,
    reserved_at real not null,
    ended_at real,
    settled_at real,
    reserved_usd real not null,
    reserved_tokens integer not null,
    state text not null,
    generation_id text,
    cost_usd real,
    prompt_tokens integer,
    completion_tokens integer,
    source text,
    finish_reason text,
    provider text,
    recovered integer,
    lookups integer not null default 0,
    next_lookup_at real,
    note text,
    sent_at real
);
create index if not exists attempts_unfinished on attempts(state, dataset)
    where state in ('reserved', 'open', 'unsettled', 'unidentified');
create index if not exists attempts_prompt on attempts(dataset, prompt_id);
create index if not exists attempts_due on attempts(next_lookup_at) where state = 'unsettled';
create index if not exists attempts_lost on attempts(dataset) where source = 'lookup' and recovered is null;
create index if not exists attempts_generation on attempts(generation_id) where generation_id is not null;
create table if not exists scopes (
    scope text primary key,
    settled_usd real not null default 0,
    live_usd real not null default 0,
    stuck_usd real not null default 0,
    expired_usd real not null default 0,
    settled_tokens integer not null default 0,
    live_tokens integer not null default 0,
    stuck_tokens integer not null default 0,
    attempts integer not null default 0
);
create table if not exists hold (
    id integer primary key check (id = 1),
    since real not null,
    reasons text not null,
    figures text not null,
    thresholds text not null
);
create table if not exists hold_log (t real not null, event text not null, hold text not null);
"""


def utc_day(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d")


def process_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Want:
    """One attempt asking for admission."""

    prompt_id: str
    number: int
    worst_usd: float
    tokens: int  # max_tokens: the completion tokens it may buy


@dataclass(frozen=True)
class Block:
    """Why admission stopped: a cap (reached = it cannot fit even when nothing is live) or the hold."""

    reason: str
    reached: bool
    hold: bool = False


@dataclass
class Scope:
    settled_usd: float = 0.0
    live_usd: float = 0.0
    stuck_usd: float = 0.0
    expired_usd: float = 0.0
    settled_tokens: int = 0
    live_tokens: int = 0
    stuck_tokens: int = 0
    attempts: int = 0

    @property
    def committed_usd(self) -> float:
        """Billed plus the worst case of everything not yet billed: what a cap is checked against."""
        return self.settled_usd + self.live_usd + self.stuck_usd

    @property
    def committed_tokens(self) -> int:
        return self.settled_tokens + self.live_tokens + self.stuck_tokens


@dataclass
class Figures:
    """What the ledger says, for the sensor, `eagle3 hold` and metadata."""

    total: Scope
    today: Scope
    day: str
    runs: dict[str, Scope] = field(default_factory=dict)
    unsettled: int = 0
    unidentified: int = 0
    live: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "settled_usd": usd(self.total.settled_usd),
            "today_usd": usd(self.today.settled_usd),
            "in_flight_worst_usd": usd(self.total.live_usd),
            "unsettled": self.unsettled,
            "unidentified": self.unidentified,
            "unsettled_worst_usd": usd(self.total.stuck_usd),
            "expired_worst_usd": usd(self.total.expired_usd),
            "runs_usd": {r: usd(s.committed_usd) for r, s in self.runs.items()},
        }


def usd(value: float) -> float:
    """Dollars for people: 6 decimals, and no -0.0 from sums of reservations given back."""
    return round(value, 6) + 0.0


def _scope_keys(run_id: str, dataset: str, day: str) -> tuple[str, str, str, str]:
    return ("total", f"day:{day}", f"run:{run_id}", f"dataset:{dataset}")


def _read_scope(conn: Connection, key: str) -> Scope:
    row = conn.execute(
        "select settled_usd, live_usd, stuck_usd, expired_usd, settled_tokens, live_tokens, stuck_tokens, attempts "
        "from scopes where scope = ?",
        (key,),
    ).fetchone()
    return Scope(*row) if row else Scope()


_batch = threading.local()  # a group commit's pending scope sums (see `batched_scopes`)


def _bump(conn: Connection, keys: tuple[str, ...], **deltas: float) -> None:
    """Add to columns of several scope rows (created on first use); inside `batched_scopes`, once per transaction."""
    pending = getattr(_batch, "op", None)
    if pending is not None:
        for k in keys:
            row = pending.setdefault(k, {})
            for col, v in deltas.items():
                row[col] = row.get(col, 0) + v
        return
    _apply(conn, {k: deltas for k in keys})


def _apply(conn: Connection, sums: dict[str, dict[str, float]]) -> None:
    conn.executemany("insert into scopes(scope) values (?) on conflict do nothing", [(k,) for k in sums])
    for key, deltas in sums.items():
        sets = ", ".join(f"{col} = {col} + ?" for col in deltas)
        conn.execute(f"update scopes set {sets} where scope = ?", (*deltas.values(), key))


class ScopeBatch:
    """Many operations in one transaction: their scope sums are added up and written once (group commit).

    `done(ok)` after each operation (a failed one, rolled back to its savepoint, contributes nothing);
    an operation that reads scopes (`reserve`: caps) runs after `flush()`, unbatched, so it sees every
    sum before it. `close()` writes what is left."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.total: dict[str, dict[str, float]] = {}
        _batch.op = {}

    def done(self, ok: bool) -> None:
        if ok:
            for key, deltas in (_batch.op or {}).items():
                row = self.total.setdefault(key, {})
                for col, v in deltas.items():
                    row[col] = row.get(col, 0) + v
        _batch.op = {}

    def flush(self) -> None:
        if self.total:
            _apply(self.conn, self.total)
            self.total = {}

    @contextmanager
    def unbatched(self) -> Iterator[None]:
        """Run one operation with its sums written at once (call `flush()` first, outside its savepoint)."""
        _batch.op = None
        try:
            yield
        finally:
            _batch.op = {}

    def close(self) -> None:
        _batch.op = None
        self.flush()


class SpendLedger:
    """The ledger database. Thread-safe: one connection, one lock; every change is one transaction."""

    def __init__(self, where: str | os.PathLike[str], *, legacy_journals: Callable[[], list[Path]] | None = None):
        """`where`: the SQLite file's path, or a PostgreSQL URL (postgresql://user:password@host:port/database)."""
        self._db = connect(where)
        self.location = self._db.location  # for people: the file, or the URL without its password
        self._lock = threading.RLock()
        self._create(legacy_journals)

    def _create(self, legacy_journals: Callable[[], list[Path]] | None) -> None:
        with self.transaction() as conn:  # under the write lock: processes starting together create it once
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(self._db.schema(statement))
            _add_sent_at(conn, self._db.schema)
            done = conn.execute("select value from meta where key = 'legacy_import'").fetchone()
            if done is None:
                imported = import_journals(conn, legacy_journals() if legacy_journals else [])
                conn.execute("insert into meta values ('legacy_import', ?)", (json.dumps(imported),))

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One write transaction, the database's write lock taken up front (across processes and hosts)."""
        with self._lock:
            self._db.begin()
            try:
                yield self._db
            except BaseException:
                self._db.rollback()
                raise
            self._db.commit()

    def read(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return fn(self._db, *args, **kwargs)

    def write(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self.transaction() as conn:
            return fn(conn, *args, **kwargs)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- convenience for callers outside a request loop (sensor, CLI, tests) -------------------

    def figures(self, run_ids: list[str] | None = None, now: float | None = None) -> Figures:
        return self.read(figures, run_ids or [], time.time() if now is None else now)

    def hold(self) -> dict[str, Any] | None:
        return self.read(get_hold)


def _add_sent_at(conn: Connection, schema: Callable[[str], str]) -> None:
    """A ledger written before sends were marked gets the column; its unfinished attempts count as sent (a process of
    that version may have sent them), so recovery never releases what may have been billed."""
    columns = {c[0] for c in conn.execute("select * from attempts limit 0").description}
    if "sent_at" in columns:
        return
    conn.execute(schema("alter table attempts add column sent_at real"))
    conn.execute(f"update attempts set sent_at = reserved_at where {UNFINISHED}")


# -- operations: each takes a connection inside a transaction ---------------------------------


def reserve(
    conn: Connection, wants: list[Want], *, run_id: str, dataset: str, owner: str, caps: Caps, now: float
) -> tuple[list[str], Block | None]:  # reads scopes: run unbatched (reserve.reads_scopes)
    """Reserve the longest prefix of `wants` that fits every cap; returns their attempt ids and what blocked the rest.

    Checked against settled + live + stuck spend of every process (this transaction holds the
    database's write lock, so two processes cannot both take the same headroom).
    """
    hold = get_hold(conn)
    if hold is not None:
        return [], Block("spending hold: " + "; ".join(hold["reasons"]), reached=True, hold=True)
    day = utc_day(now)
    keys = _scope_keys(run_id, dataset, day)
    scopes = _Scopes(*(_read_scope(conn, k) for k in keys))
    granted: list[tuple] = []
    added_usd, added_tokens = 0.0, 0
    block = None
    for want in wants:
        block = _does_not_fit(want, caps, scopes, added_usd, added_tokens)
        if block is not None:
            break
        attempt_id = os.urandom(12).hex()
        granted.append(
            (attempt_id, run_id, dataset, want.prompt_id, want.number, owner, day, now, want.worst_usd, want.tokens)
        )
        added_usd += want.worst_usd
        added_tokens += want.tokens
    if granted:
        conn.executemany(
            "insert into attempts(attempt_id, run_id, dataset, prompt_id, number, owner, day, reserved_at, "
            "reserved_usd, reserved_tokens, state) values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'reserved')",
            granted,
        )
        _bump(conn, keys, live_usd=added_usd, live_tokens=added_tokens, attempts=len(granted))
    return [g[0] for g in granted], block


reserve.reads_scopes = True  # type: ignore[attr-defined]


@dataclass(frozen=True)
class _Scopes:
    """The scopes one reservation counts against (`_scope_keys` order), read once per `reserve`."""

    total: Scope
    today: Scope
    run: Scope
    dataset: Scope


def _does_not_fit(want: Want, caps: Caps, scopes: _Scopes, added_usd: float, added_tokens: int) -> Block | None:
    """What blocks `want` after the wants before it in this `reserve` (`added_usd`, `added_tokens`), if anything."""
    ds = scopes.dataset
    if caps.token_budget is not None:
        committed = ds.committed_tokens + added_tokens
        if committed + want.tokens > caps.token_budget:
            reached = ds.settled_tokens + ds.stuck_tokens + want.tokens > caps.token_budget
            return Block(
                f"token budget {caps.token_budget:,} reached ({ds.settled_tokens:,} completion tokens billed, "
                f"{ds.live_tokens + ds.stuck_tokens + added_tokens:,} reserved, next request up to {want.tokens:,})",
                reached,
            )
    for cap, scope, what in (
        (caps.run_usd, scopes.run, "run"),
        (caps.day_usd, scopes.today, "daily"),
        (caps.total_usd, scopes.total, "total"),
    ):
        if cap is None:
            continue
        if scope.committed_usd + added_usd + want.worst_usd > cap:
            reached = scope.settled_usd + scope.stuck_usd + want.worst_usd > cap
            return Block(
                f"{what} dollar cap ${cap:.2f} reached (${scope.settled_usd:.4f} billed, "
                f"${scope.live_usd + scope.stuck_usd + added_usd:.4f} reserved, "
                f"next request up to ${want.worst_usd:.4f})",
                reached,
            )
    return None


def _row(conn: Connection, attempt_id: str) -> tuple | None:
    return conn.execute(
        "select state, reserved_usd, reserved_tokens, run_id, dataset, day from attempts where attempt_id = ?",
        (attempt_id,),
    ).fetchone()


def sending(conn: Connection, attempt_id: str, now: float) -> None:
    """The attempt is about to leave the process (committed before its first byte is sent): it may be billed from now
    on."""
    conn.execute("update attempts set sent_at = ? where attempt_id = ? and sent_at is null", (now, attempt_id))


def opened(conn: Connection, attempt_id: str, generation_id: str) -> None:
    """The response's headers named the generation: from now on it can be looked up."""
    conn.execute(
        "update attempts set state = case when state = 'reserved' then 'open' else state end, generation_id = ? "
        "where attempt_id = ?",
        (generation_id, attempt_id),
    )


def settle(  # 11 parameters: the bill's fields by keyword, as every settler (and the tests) name them
    conn: Connection,
    attempt_id: str,
    *,
    cost_usd: float,
    prompt_tokens: int | None,
    completion_tokens: int | None,
    source: str,
    now: float,
    generation_id: str | None = None,
    state: str = "settled",
    finish_reason: str | None = None,
    provider: str | None = None,
) -> bool:
    """Record what an attempt cost (idempotent: a settled attempt stays as it is). False if nothing changed."""
    row = _row(conn, attempt_id)
    if row is None or row[0] in ("settled", "released"):
        return False
    old, reserved_usd, reserved_tokens, run_id, dataset, day = row
    keys = _scope_keys(run_id, dataset, day)
    tokens = completion_tokens or 0
    if old in LIVE:
        _bump(
            conn,
            keys,
            live_usd=-reserved_usd,
            live_tokens=-reserved_tokens,
            settled_usd=cost_usd,
            settled_tokens=tokens,
        )
    elif old in STUCK:
        _bump(
            conn,
            keys,
            stuck_usd=-reserved_usd,
            stuck_tokens=-reserved_tokens,
            settled_usd=cost_usd,
            settled_tokens=tokens,
        )
    else:  # expired, then found after all
        _bump(conn, keys, expired_usd=-reserved_usd, settled_usd=cost_usd, settled_tokens=tokens)
    conn.execute(
        "update attempts set state = ?, cost_usd = ?, prompt_tokens = ?, completion_tokens = ?, source = ?, "
        "settled_at = ?, ended_at = coalesce(ended_at, ?), generation_id = coalesce(?, generation_id), "
        "finish_reason = ?, provider = ? where attempt_id = ?",
        (
            state,
            cost_usd,
            prompt_tokens,
            completion_tokens,
            source,
            now,
            now,
            generation_id,
            finish_reason,
            provider,
            attempt_id,
        ),
    )
    return True


def release(conn: Connection, attempt_id: str, why: str, now: float) -> bool:
    """Nothing was generated (refused, never sent): the reservation is given back, $0."""
    return settle(
        conn,
        attempt_id,
        cost_usd=0.0,
        prompt_tokens=None,
        completion_tokens=None,
        source=why,
        now=now,
        state="released",
    )


def unsettle(conn: Connection, attempt_id: str, generation_id: str | None, why: str, now: float) -> str | None:
    """A live attempt ended without a bill: stuck until a look-up finds it (or, without an id, the horizon)."""
    row = _row(conn, attempt_id)
    if row is None or row[0] not in LIVE:
        return None
    _, reserved_usd, reserved_tokens, run_id, dataset, day = row
    state = "unsettled" if generation_id else "unidentified"
    _bump(
        conn,
        _scope_keys(run_id, dataset, day),
        live_usd=-reserved_usd,
        live_tokens=-reserved_tokens,
        stuck_usd=reserved_usd,
        stuck_tokens=reserved_tokens,
    )
    conn.execute(
        "update attempts set state = ?, generation_id = coalesce(?, generation_id), ended_at = ?, next_lookup_at = ?, "
        "note = ? where attempt_id = ?",
        (state, generation_id, now, now, why, attempt_id),
    )
    return state


def looked_up_in_vain(conn: Connection, attempt_id: str, now: float) -> None:
    """Not found yet: look again later, backing off (0.5 s doubling, at most a minute)."""
    row = conn.execute("select lookups from attempts where attempt_id = ?", (attempt_id,)).fetchone()
    if row is None:
        return
    delay = min(LOOKUP_BACKOFF_CAP_S, 0.5 * 2 ** min(row[0], 8))
    conn.execute(
        "update attempts set lookups = lookups + 1, next_lookup_at = ? where attempt_id = ?", (now + delay, attempt_id)
    )


def expire(conn: Connection, now: float, horizon_s: float) -> list[tuple[str, str, str]]:
    """Stuck attempts older than the horizon give up their reservation: (attempt, dataset, prompt) each."""
    rows = conn.execute(
        f"select attempt_id, dataset, prompt_id, reserved_usd, reserved_tokens, run_id, day from attempts "
        f"where {UNFINISHED} and state in ('unsettled', 'unidentified') and ended_at < ?",
        (now - horizon_s,),
    ).fetchall()
    for attempt_id, dataset, _, reserved_usd, reserved_tokens, run_id, day in rows:
        _bump(
            conn,
            _scope_keys(run_id, dataset, day),
            stuck_usd=-reserved_usd,
            stuck_tokens=-reserved_tokens,
            expired_usd=reserved_usd,
        )
        conn.execute("update attempts set state = 'expired', settled_at = ? where attempt_id = ?", (now, attempt_id))
    return [(r[0], r[1], r[2]) for r in rows]


def due_lookups(
    conn: Connection, now: float, limit: int, attempt_ids: list[str] | None = None
) -> list[tuple[str, str]]:
    """(attempt id, generation id) of unsettled attempts whose next look-up is due, oldest first."""
    if attempt_ids is not None:
        marks = ",".join("?" * len(attempt_ids))
        return conn.execute(
            f"select attempt_id, generation_id from attempts where state = 'unsettled' and attempt_id in ({marks})",
            attempt_ids,
        ).fetchall()
    return conn.execute(
        "select attempt_id, generation_id from attempts where state = 'unsettled' and next_lookup_at <= ? "
        "order by next_lookup_at limit ?",
        (now, limit),
    ).fetchall()


def blocked_prompts(conn: Connection, dataset: str) -> dict[str, str]:
    """prompt id -> state, for prompts of a dataset with an attempt not yet final (never to be sent twice)."""
    return dict(
        conn.execute(
            "select prompt_id, state from attempts where dataset = ? and state in "
            "('reserved', 'open', 'unsettled', 'unidentified')",
            (dataset,),
        ).fetchall()
    )


def unsettled_ids(conn: Connection, dataset: str, max_lookups: int = 3) -> list[str]:
    """A dataset's unsettled attempts not yet looked up `max_lookups` times (worth waiting for; older ones are left to
    the backoff, so a generation that is never found does not delay every later run of its dataset)."""
    return [
        r[0]
        for r in conn.execute(
            f"select attempt_id from attempts where {UNFINISHED} and dataset = ? and state = 'unsettled' "
            "and lookups < ?",
            (dataset, max_lookups),
        )
    ]


def lost_answers(conn: Connection, dataset: str) -> list[dict[str, Any]]:
    """Finished generations a look-up found billed whose answer never reached the journal (a kill, a cut stream)."""
    cur = conn.execute(
        "select attempt_id, prompt_id, generation_id, cost_usd, prompt_tokens, completion_tokens, finish_reason, "
        "provider "
        "from attempts where dataset = ? and state = 'settled' and source = 'lookup' and recovered is null "
        "and finish_reason in ('stop', 'length', 'content_filter')",
        (dataset,),
    )
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def mark_recovered(conn: Connection, attempt_ids: list[str], recovered: bool) -> None:
    conn.executemany(
        "update attempts set recovered = ? where attempt_id = ?", [(int(recovered), a) for a in attempt_ids]
    )


def live_attempts(conn: Connection, dataset: str) -> list[tuple[str, str, str | None, float, float | None]]:
    """(attempt, prompt, generation id, reserved_usd, sent_at) of a dataset's live attempts."""
    return conn.execute(
        f"select attempt_id, prompt_id, generation_id, reserved_usd, sent_at from attempts "
        f"where {UNFINISHED} and dataset = ? and state in ('reserved', 'open')",
        (dataset,),
    ).fetchall()


def datasets_with_live_attempts(conn: Connection) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            f"select distinct dataset from attempts where {UNFINISHED} and state in ('reserved', 'open')"
        )
    ]


def figures(conn: Connection, run_ids: list[str], now: float) -> Figures:
    day = utc_day(now)
    counts = dict(
        conn.execute(
            "select state, count(*) from attempts where state in ('reserved', 'open', 'unsettled', "
            "'unidentified') group by state"
        ).fetchall()
    )
    return Figures(
        total=_read_scope(conn, "total"),
        today=_read_scope(conn, f"day:{day}"),
        day=day,
        runs={r: _read_scope(conn, f"run:{r}") for r in run_ids},
        unsettled=counts.get("unsettled", 0),
        unidentified=counts.get("unidentified", 0),
        live=counts.get("reserved", 0) + counts.get("open", 0),
    )


def scope(conn: Connection, key: str) -> Scope:
    return _read_scope(conn, key)


def settled_series(conn: Connection) -> list[tuple[str, float, float]]:
    """(dataset, settled_at, cost) of every billed attempt, in time order (the `spend` asset's picture)."""
    return conn.execute(
        "select dataset, settled_at, cost_usd from attempts where settled_at is not null and cost_usd > 0 "
        "order by settled_at"
    ).fetchall()


def stuck_attempts(conn: Connection, limit: int = 20) -> list[dict[str, Any]]:
    cur = conn.execute(
        f"select dataset, prompt_id, state, generation_id, reserved_usd, ended_at, lookups from attempts "
        f"where {UNFINISHED} and state in ('unsettled', 'unidentified') order by ended_at limit ?",
        (limit,),
    )
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


# -- the hold: one row, read by every admission ----------------------------------------------


def get_hold(conn: Connection) -> dict[str, Any] | None:
    row = conn.execute("select since, reasons, figures, thresholds from hold where id = 1").fetchone()
    if row is None:
        return None
    return {
        "since": row[0],
        "reasons": json.loads(row[1]),
        "figures": json.loads(row[2]),
        "thresholds": json.loads(row[3]),
    }


def set_hold(
    conn: Connection, reasons: list[str], figs: dict[str, Any], thresholds: dict[str, Any], now: float
) -> dict[str, Any]:
    hold = {"since": now, "reasons": reasons, "figures": figs, "thresholds": thresholds}
    conn.execute(
        "insert into hold(id, since, reasons, figures, thresholds) values (1, ?, ?, ?, ?) on conflict (id) do update "
        "set since = excluded.since, reasons = excluded.reasons, figures = excluded.figures, "
        "thresholds = excluded.thresholds",
        (now, json.dumps(reasons), json.dumps(figs, default=str), json.dumps(thresholds)),
    )
    conn.execute("insert into hold_log values (?, 'set', ?)", (now, json.dumps(hold, default=str)))
    return hold


def lift_hold(conn: Connection, now: float, why: str) -> dict[str, Any] | None:
    hold = get_hold(conn)
    if hold is not None:
        conn.execute("delete from hold where id = 1")
        conn.execute("insert into hold_log values (?, ?, ?)", (now, "lifted: " + why, json.dumps(hold, default=str)))
    return hold


# -- the ledger's first use on a data root that already has journals --------------------------


def import_journals(conn: Connection, journals: list[Path]) -> dict[str, Any]:
    """Bills recorded in journals written before the ledger existed, as settled attempts (once)."""
    from eagle3_resources.journal import read_journal

    imported = {"journals": 0, "bills": 0, "usd": 0.0}
    for path in journals:
        dataset = path.parent.name
        imported["journals"] += 1
        for i, r in enumerate(read_journal(path).records):
            if r.get("type") not in ("result", "orphan") or (r.get("type") == "result" and not r.get("status")):
                continue
            cost = float(r.get("cost_usd") or 0.0)
            tokens = int(r.get("completion_tokens") or 0) if r.get("type") == "result" else 0
            t = float(r.get("t") or 0.0)
            attempt_id = f"import:{dataset}:{i}"
            run_id, day = r.get("run_id") or "", utc_day(t)
            conn.execute(
                "insert into attempts(attempt_id, run_id, dataset, prompt_id, number, owner, day, reserved_at, "
                "reserved_usd, reserved_tokens, state, generation_id, cost_usd, completion_tokens, source, settled_at) "
                "values (?, ?, ?, ?, 1, 'journal', ?, ?, 0, 0, 'settled', ?, ?, ?, 'journal-import', ?) "
                "on conflict do nothing",
                (
                    attempt_id,
                    run_id,
                    dataset,
                    r.get("prompt_id") or "",
                    day,
                    t,
                    r.get("generation_id"),
                    cost,
                    tokens,
                    t,
                ),
            )
            _bump(conn, _scope_keys(run_id, dataset, day), settled_usd=cost, settled_tokens=tokens, attempts=1)
            imported["bills"] += 1
            imported["usd"] += cost
    return imported
