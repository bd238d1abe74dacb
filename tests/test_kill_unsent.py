"""A kill -9 blocks only what may have been sent: reservations never marked sent are released, and no reservation waits
for pacing.

The provider is the fake OpenRouter in a process of its own, capped in requests per second, so a spending process
(tests/spend_worker.py) has most of its requests waiting for their turn; its process group is killed with SIGKILL
while requests are in flight. The fake's own account (its `/_fake/stats` and its `--log-billing` lines) is the oracle
of what reached the provider and what it was still generating; the ledger is read with plain SQL.
"""

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ledger_invariants import check_ledgers, read_billing_log
from spend_worker import synthetic
from support import free_port, ledger_rows, port_open, stop_group, wait_for

from eagle3_assets.money import Caps, SpendLedger, open_ledger
from eagle3_assets.money import ledger as L
from eagle3_assets.money.settle import recover_idle_datasets
from eagle3_assets.stages.completions.run import final_results
from eagle3_resources.storage import DataLayout

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("spend_worker.py")
KEY = "k-kill-unsent"
PRICE_PROMPT, PRICE_COMPLETION = 0.60e-6, 2.50e-6  # the fake's default prices (the worker's PRICING)
RPS = 5  # the provider's cap: requests per 1 s window
PROMPTS, CONCURRENCY, MAX_TOKENS = 60, 48, 400
STUCK = ("unsettled", "unidentified")


def start_fake(tmp_path, tok) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / "fake.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fakes.openrouter",
            "--port",
            str(port),
            "--tokenizer",
            str(tok.folder),
            "--api-key",
            KEY,
            "--latency-s",
            "1.0",
            "--max-rps",
            str(RPS),
            "--rate-window-s",
            "1.0",
            "--log-billing",
        ],
        cwd=REPO / "tests",
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for(lambda: port_open(port), 120, "the fake OpenRouter")
    return proc, f"http://127.0.0.1:{port}", log


def stats(base: str) -> dict:
    return httpx.get(f"{base}/_fake/stats", timeout=10).json()


def bills(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        try:
            b = json.loads(line)
        except ValueError:
            continue
        if isinstance(b, dict) and "kind" in b:
            out.append(b)
    return out


def spend(tmp_path, base: str, tok, data: Path, run_id: str, name: str) -> subprocess.Popen:
    args = [
        sys.executable,
        str(WORKER),
        "--url",
        f"{base}/api/v1",
        "--key",
        KEY,
        "--tokenizer",
        str(tok.folder),
        "--data",
        str(data),
        "--run-id",
        run_id,
        "--datasets",
        "K",
        "--prompts",
        str(PROMPTS),
        "--concurrency",
        str(CONCURRENCY),
        "--max-tokens",
        str(MAX_TOKENS),
        "--stream",
        "0",
    ]
    return subprocess.Popen(
        args,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / f"{name}.log", "w"),
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_after_a_kill_only_what_the_provider_was_generating_is_blocked(tmp_path, tok):
    data = tmp_path / "data"
    fake, base, log = start_fake(tmp_path, tok)
    try:
        worker = spend(tmp_path, base, tok, data, "run-killed", "killed")
        try:
            # Non-streaming requests: a generation id arrives only with the answer, so a request in flight at the kill
            # is known to the ledger by its send mark alone.
            wait_for(
                lambda: stats(base)["answered"].get("200", 0) >= 2 * RPS and stats(base)["generating"],
                120,
                "paced requests in flight",
            )
            # Mid-window: this window's turns were taken at its start and answers come at the next one, so nothing is
            # between its send mark and the provider, or between an answer and the journal.
            time.sleep((1.5 - time.time() % 1.0) % 1.0)
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(30)
        finally:
            stop_group(worker)
        at_kill = stats(base)  # after the kill: what the provider generates now, its client is gone
        wait_for(lambda: not stats(base)["generating"], 120, "the provider to finish what it was generating")

        ledger = open_ledger(DataLayout(data))
        live = [r for r in ledger_rows(ledger) if r["state"] in ("reserved", "open")]
        unmarked = [r for r in live if r["sent_at"] is None]
        in_flight = {
            b["attempt"] for b in bills(log) if b["kind"] == "after_disconnect"
        }  # the client left before its answer
        print(
            f"at the kill: the provider had received {at_kill['received']} requests, was generating "
            f"{len(at_kill['generating'])}, answered {at_kill['answered']}; the ledger held {len(live)} live attempts, "
            f"{len(unmarked)} not marked sent"
        )
        # Whatever the provider was still generating after the kill was billed as such (the snapshot may come after it
        # finished some of them, on a loaded machine: a subset, not the same set).
        assert in_flight and set(at_kill["generating"]) <= in_flight
        # Reservations are taken after pacing: ~40 requests were waiting for their turn, none of them reserved (the
        # few that may be between their reservation and their mark are at most one window's turns).
        assert len(unmarked) <= RPS

        resumed = spend(tmp_path, base, tok, data, "run-resumed", "resumed")
        try:
            out = json.loads(resumed.communicate(timeout=300)[0].strip().splitlines()[-1])
        finally:
            stop_group(resumed)
    finally:
        stop_group(fake)

    rows = ledger_rows(ledger)
    stuck = {r["attempt_id"]: r for r in rows if r["state"] in STUCK}
    all_bills = bills(log)
    generated = {b["attempt"]: b for b in all_bills if b["kind"] in ("complete", "after_disconnect")}
    print(
        f"after the resume: {len(stuck)} attempts held, the provider's in flight at the kill {len(in_flight)}, "
        f"{len(set(stuck) - set(generated))} marked sent but not received; {out}"
    )
    # Every request the provider was generating at the kill is held (it is billed: never released at $0), and nothing
    # else is, but a request the provider generated (an answer that came as the process died) or one marked sent that
    # had not reached it yet: the kill is aimed mid-window, when no request is between its mark and the provider, but
    # a loaded machine may delay the kill, or the worker's marks, past that; at most one window's turns are.
    marked = {r["attempt_id"] for r in rows if r["run_id"] == "run-killed" and r["sent_at"] is not None}
    assert in_flight <= set(stuck) <= set(generated) | marked
    unsent = set(stuck) - set(generated)
    assert len(unsent) <= RPS, unsent
    # The worst case held is theirs alone: prompt tokens as the provider counted them (as the client did, for one it
    # had not received), at the worst-case prices.
    prompt_tokens = {r.prompt_id: len(r.prompt_ids) for r in synthetic(tok, "K", PROMPTS)}
    counted = {
        a: generated[a]["prompt_tokens"] if a in generated else prompt_tokens[stuck[a]["prompt_id"]] for a in stuck
    }
    worst = sum(counted[a] * PRICE_PROMPT + MAX_TOKENS * PRICE_COMPLETION for a in stuck)
    total = ledger.figures().total
    assert total.live_usd == pytest.approx(0.0, abs=1e-12)
    assert total.stuck_usd == pytest.approx(worst, rel=1e-9)
    # Every other prompt completed on the resume, and no prompt was generated twice.
    blocked = {r["prompt_id"] for r in stuck.values()}
    done, _ = final_results(data / "completions" / "K" / "journal.jsonl")
    assert set(done) | blocked == {f"K-{i:04d}" for i in range(PROMPTS)} and not set(done) & blocked
    assert {r["status"] for r in done.values()} == {"ok"} and out["results"].get("ok", 0) > 0
    assert max(collections.Counter(b["prompt_key"] for b in generated.values()).values()) == 1
    # The ledger's figures against its rows and the provider's billing log (tests/ledger_invariants.py).
    assert check_ledgers([ledger.location], read_billing_log(log.read_text())) == []


@pytest.mark.parametrize("by", ["sensor", "cli"])
@pytest.mark.parametrize("ledger_in", ["sqlite", "postgres"], indirect=True)
def test_recovery_releases_reservations_never_marked_sent(tmp_path, ledger_in, by):
    """What the credit sensor and `eagle3 ledger settle` do for a dataset whose process died: the reservations it never
    marked sent are released at once; the one it marked sent (no generation id) is held to the horizon, the one with an
    id is looked up."""
    layout = DataLayout(tmp_path / "data")
    ledger = open_ledger(layout)
    worst = [0.001 * (i + 1) for i in range(6)]
    wants = [L.Want(f"K-{i}", 1, w, MAX_TOKENS) for i, w in enumerate(worst)]
    ids, block = ledger.write(L.reserve, wants, run_id="r", dataset="K", owner="gone:1", caps=Caps(), now=time.time())
    assert block is None and len(ids) == 6
    ledger.write(L.sending, ids[0], time.time())
    ledger.write(L.sending, ids[1], time.time())
    ledger.write(L.opened, ids[1], "gen-1")

    counts = {"settled_from_journal": 0, "unsettled": 1, "unidentified": 1, "released": 4}
    if by == "sensor":
        assert recover_idle_datasets(layout, ledger) == {"K": counts}
    else:
        env = {k: v for k, v in os.environ.items() if k != "OPENROUTER_API_KEY"}  # nothing to look up: recovery only
        env["EAGLE3_DATA_DIR"] = str(layout.root)
        done = subprocess.run(
            [sys.executable, "-m", "eagle3_assets.operations.cli", "ledger", "settle"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert f"K: attempts left by a process that ended, put right: {counts}" in done.stdout, (
            done.stdout + done.stderr
        )
    states = {r["attempt_id"]: r["state"] for r in ledger_rows(ledger)}
    assert [states[a] for a in ids] == ["unidentified", "unsettled"] + ["released"] * 4
    for scope in ("total", "run:r", "dataset:K"):
        figures = ledger.read(L.scope, scope)
        assert figures.live_usd == pytest.approx(0.0, abs=1e-12)
        assert figures.stuck_usd == pytest.approx(worst[0] + worst[1], rel=1e-12)
        assert figures.settled_usd == 0.0
    assert ledger.read(L.blocked_prompts, "K") == {"K-0": "unidentified", "K-1": "unsettled"}


@pytest.mark.parametrize("ledger_in", ["sqlite", "postgres"], indirect=True)
def test_a_ledger_written_before_send_marks_opens_and_keeps_its_live_attempts(tmp_path, ledger_in):
    """A ledger from before the `sent_at` column: it opens, and its live attempts count as sent (a process of that
    version may have sent them), so recovery holds them instead of releasing them."""
    layout = DataLayout(tmp_path / "data")
    where = os.environ.get("EAGLE3_LEDGER_URL") or str(layout.ledger())
    old = SpendLedger(where)
    ids, _ = old.write(
        L.reserve,
        [L.Want("K-0", 1, 0.002, MAX_TOKENS), L.Want("K-1", 1, 0.003, MAX_TOKENS)],
        run_id="r",
        dataset="K",
        owner="gone:1",
        caps=Caps(),
        now=time.time(),
    )
    old.write(L.release, ids[1], "refused", time.time())
    old.write(lambda conn: conn.execute("alter table attempts drop column sent_at"))  # as it was written then
    old.close()

    ledger = SpendLedger(where)
    rows = {r["attempt_id"]: r for r in ledger_rows(ledger)}
    assert rows[ids[0]]["sent_at"] is not None and rows[ids[1]]["sent_at"] is None
    assert recover_idle_datasets(layout, ledger)["K"]["unidentified"] == 1
    assert ledger.read(L.scope, "total").stuck_usd == pytest.approx(0.002, rel=1e-12)
    ledger.close()
