"""Money: prices, caps, admission, reservations, the ledger, settlement, the hold and the sensor's figures.

Everything that sums or limits dollars lives here; other modules call it.

    caps.py       Caps and Pricing (the worst case of one request); Limits and run_caps: the one place a
                  run config's cap meets the environment's (the tighter holds)
    ledger.py     the SQLite ledger shared by every process on the data root
    writer.py     the ledger from an event loop (group commit)
    admission.py  the feed a completion backend pulls attempts from
    settle.py     look-ups of unsettled generations, the horizon, recovery after a crash
    prices.py     the model's prices from the API, checked against what the pilot was billed
    projection.py what the rest of a partition will cost, from its pilot
    policy.py     thresholds, the account, what crossed them
    hold.py       the spending hold and which Dagster runs spend
    view.py       the `spend` asset's figures and tables
    asset.py      the `spend` asset (observable: the ledger's figures in the UI)

May import `common` and `eagle3_resources`; never `stages` or `operations` (tests/test_import_direction.py).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from eagle3_assets.money.caps import Caps, Limits, Pricing, run_caps
from eagle3_assets.money.database import LEDGER_URL_ENV
from eagle3_assets.money.hold import (
    ACTIVE_STATUSES,
    cancel_spending,
    cancelling,
    get_hold,
    lift_hold,
    set_hold,
    spends,
)
from eagle3_assets.money.ledger import DEFAULT_HORIZON_S, Figures, SpendLedger
from eagle3_assets.money.policy import SpendPolicy
from eagle3_resources.storage import DataLayout, default_data_dir

_ledgers: dict[tuple[int, str], SpendLedger] = {}
_lock = threading.Lock()


def open_ledger(layout: DataLayout) -> SpendLedger:
    """The ledger every spending process shares (one connection per process; created, with old journals imported, on
    first use): the PostgreSQL database of EAGLE3_LEDGER_URL when set (processes on several hosts), else the SQLite
    file under the data root (one host)."""
    url = os.environ.get(LEDGER_URL_ENV, "").strip()
    where = url or str(Path(layout.ledger()).resolve())
    key = (os.getpid(), where)
    with _lock:
        if key not in _ledgers:
            _ledgers[key] = SpendLedger(where, legacy_journals=layout.all_completion_journals)
        return _ledgers[key]


def open_data_root_ledger() -> SpendLedger:
    """The ledger of the data root this process uses (EAGLE3_DATA_DIR, else the default): `eagle3 ledger`, `eagle3
    hold` and `eagle3 status` read this one."""
    return open_ledger(DataLayout(default_data_dir()))


__all__ = [
    "ACTIVE_STATUSES",
    "Caps",
    "Limits",
    "DEFAULT_HORIZON_S",
    "Figures",
    "Pricing",
    "SpendLedger",
    "SpendPolicy",
    "cancel_spending",
    "cancelling",
    "get_hold",
    "lift_hold",
    "open_data_root_ledger",
    "open_ledger",
    "run_caps",
    "set_hold",
    "spends",
]
