"""The credit sensor puts right what a killed process left in the ledger, and leaves alone a dataset a run completes.

Recovery is money's (money/settle.py: `settle_idle`, `recover_idle_datasets`): the sensor reaches no stage for it. The
oracle is the ledger's rows, read with SQL here, and the `spend` observation the tick returned.
"""

import time

import dagster as dg

from eagle3_assets.money import Caps, SpendPolicy, open_ledger
from eagle3_assets.money import ledger as L
from eagle3_assets.money.settle import partition_lock
from eagle3_assets.operations.sensors import credit_sensor
from eagle3_resources.alerts import AlertSink
from eagle3_resources.storage import DataStore

ENV = (
    "OPENROUTER_API_KEY",
    "EAGLE3_MIN_BALANCE_USD",
    "EAGLE3_MAX_RUN_USD",
    "EAGLE3_MAX_DAY_USD",
    "EAGLE3_MAX_TOTAL_USD",
)


def test_the_sensor_puts_right_a_dead_process_attempts_and_leaves_a_locked_dataset_alone(tmp_path, monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    store = DataStore(root=str(tmp_path))
    ledger = open_ledger(store.layout)
    now = time.time()
    wants = [L.Want("p1", 1, 0.01, 50), L.Want("p2", 1, 0.01, 50)]
    (never_sent, sent), _ = ledger.write(
        L.reserve, wants, run_id="killed", dataset="A1", owner="gone:1", caps=Caps(), now=now
    )
    ledger.write(L.sending, sent, now)  # it may have reached the provider: kept as unidentified, never released
    (busy,), _ = ledger.write(
        L.reserve, [L.Want("p3", 1, 0.01, 50)], run_id="alive", dataset="B2", owner="here:2", caps=Caps(), now=now
    )
    store.layout.completions_journal("A1").parent.mkdir(parents=True)
    store.layout.completions_journal("A1").write_text("")
    resources = {"spend_policy": SpendPolicy(), "store": store, "alerts": AlertSink()}
    with dg.instance_for_test() as instance:
        with partition_lock(store.layout.completions_journal("B2"), "a run completing B2"):
            result = credit_sensor(dg.build_sensor_context(instance=instance, resources=resources))

    states = ledger.read(lambda conn: dict(conn.execute("select attempt_id, state from attempts").fetchall()))
    assert states == {never_sent: "released", sent: "unidentified", busy: "reserved"}
    assert isinstance(result, dg.SensorResult)
    (observation,) = result.asset_events
    assert observation.metadata["settled_this_tick"].value == {
        "recovered": {"A1": {"settled_from_journal": 0, "unsettled": 0, "unidentified": 1, "released": 1}}
    }
