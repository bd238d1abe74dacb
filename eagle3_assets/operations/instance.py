"""The Dagster instance `eagle3` runs against: embedded SQLite by default, PostgreSQL for a team.

    EAGLE3_POSTGRES_URL   postgresql://user:password@host:5432/dagster: runs, event log, schedules and
                          concurrency slots in that database (dagster-postgres, the `postgres` extra);
                          unset: SQLite files under DAGSTER_HOME

The default home is `var/dagster` (SQLite) or `var/dagster-postgres` (PostgreSQL), so switching one
variable never points an instance's dagster.yaml at the other storage. A home whose dagster.yaml says
otherwise than the variable is refused with both named. `deploy/dagster.yaml` is the PostgreSQL file,
checked in for hosts that set DAGSTER_HOME themselves (tests/test_postgres.py keeps it identical).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from eagle3_assets.money.database import POSTGRES_SCHEMES
from eagle3_resources.storage import PROJECT_ROOT

POSTGRES_URL_ENV = "EAGLE3_POSTGRES_URL"
DEFAULT_DAGSTER_HOME = PROJECT_ROOT / "var" / "dagster"
DEFAULT_POSTGRES_DAGSTER_HOME = PROJECT_ROOT / "var" / "dagster-postgres"
GPU_POOL = "gpu"
# Held while one `eagle3` makes the home, the instance's storage, the data root and the ledger usable (first_use).
FIRST_USE_LOCK = ".eagle3-first-use.lock"
# Dagster's daemons heartbeat every 30 s (dagster._daemon.controller): a heartbeat younger than three
# intervals means a daemon is serving the instance.
DAEMON_LIVE_S = 90.0

SETTINGS_YAML = """\
telemetry:
  enabled: false
# The UI opens on the project, not on Dagster's "Join the Dagster community" sign-up form.
nux:
  enabled: false
concurrency:
  runs:
    max_concurrent_runs: 4
    # One queued run per dataset at a time: a second waits in the queue. A backfill from the UI
    # tags its runs with a partition range instead (start = end for one dataset), hence the second
    # limit. What these cannot see (a range run beside a `dagster/partition` run of the same
    # dataset, runs executed in-process such as `dagster asset materialize`) meets the completions
    # asset's lock, which fails a second spending run on the same dataset at once.
    tag_concurrency_limits:
      - key: dagster/partition
        value:
          applyLimitPerUniqueValue: true
        limit: 1
      - key: dagster/asset_partition_range_start
        value:
          applyLimitPerUniqueValue: true
        limit: 1
  pools:
    # Steps in a pool (hidden_states and eagle3_drafter are in "gpu") run one at a time.
    default_limit: 1
# A run no process owns must never hold its dataset's queue slot: the daemon ends runs stuck
# CANCELING (a terminate that reached no process) and runs that never started.
run_monitoring:
  enabled: true
  start_timeout_seconds: 300
  cancel_timeout_seconds: 120
  poll_interval_seconds: 30
"""

INSTANCE_YAML = "# Written by `eagle3` on first use; edit freely.\n" + SETTINGS_YAML

POSTGRES_INSTANCE_YAML = (
    f"""\
# The team's instance: runs, event log, schedules and concurrency slots in PostgreSQL, so the UI, the
# daemon and every run worker (on this host or others) share one queue, one set of pool slots and one
# history. The URL is read from the environment when the instance loads: no password in this file.
# Written by `eagle3` when {POSTGRES_URL_ENV} is set; also deploy/dagster.yaml.
storage:
  postgres:
    postgres_url:
      env: {POSTGRES_URL_ENV}
"""
    + SETTINGS_YAML
)


def postgres_url() -> str | None:
    """EAGLE3_POSTGRES_URL, checked: a PostgreSQL URL with a driver dagster-postgres works with; None when unset."""
    url = os.environ.get(POSTGRES_URL_ENV, "").strip()
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in POSTGRES_SCHEMES or not parts.hostname or not parts.path.strip("/"):
        raise SystemExit(
            f"{POSTGRES_URL_ENV}: expected postgresql://user:password@host:port/database "
            f"(scheme one of {', '.join(POSTGRES_SCHEMES)}), got scheme {parts.scheme!r}, "
            f"host {parts.hostname!r}, database {parts.path.strip('/')!r}"
        )
    return url


def uses_postgres(yaml_text: str) -> bool:
    import yaml

    return "postgres" in ((yaml.safe_load(yaml_text) or {}).get("storage") or {})


def dagster_home() -> Path:
    """DAGSTER_HOME (set from the default if unset), its dagster.yaml written on first use, the gpu pool shown.

    Everything a first command creates (dagster.yaml, the instance's tables, the data root, the spend
    ledger) is made under an OS lock on a file in the home: Dagster's SQLite storage creates its tables
    without one, and two commands started together on a new home failed with "table secondary_indexes
    already exists". The first to arrive creates; the others wait, then find everything made.
    """
    url = postgres_url()
    default = DEFAULT_POSTGRES_DAGSTER_HOME if url else DEFAULT_DAGSTER_HOME
    home = Path(os.environ.get("DAGSTER_HOME") or default).resolve()
    home.mkdir(parents=True, exist_ok=True)
    with first_use(home):
        config = home / "dagster.yaml"
        if not config.exists():
            written = config.with_name(f".dagster.yaml.{os.getpid()}")  # whole or absent, for readers without the lock
            written.write_text(POSTGRES_INSTANCE_YAML if url else INSTANCE_YAML)
            os.replace(written, config)
        elif uses_postgres(config.read_text()) != bool(url):
            kept = "PostgreSQL" if url is None else "SQLite"
            raise SystemExit(
                f"{config} keeps the instance in {kept}, but {POSTGRES_URL_ENV} is "
                f"{'unset' if url is None else 'set'}: point DAGSTER_HOME at another folder, "
                f"or {'set' if url is None else 'unset'} {POSTGRES_URL_ENV}"
            )
        os.environ["DAGSTER_HOME"] = str(home)
        show_pools()  # DagsterInstance.get() creates (or migrates) the instance's storage
        prepare_data_root()
    return home


@contextmanager
def first_use(home: Path) -> Iterator[None]:
    """An exclusive flock on the home's lock file: one process at a time initialises this home (released on exit,
    also when the process dies, since the OS drops a dead process's flocks)."""
    with open(home / FIRST_USE_LOCK, "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def prepare_data_root() -> None:
    """The data root, and its SQLite spend ledger created (schema, old journals imported) before any run opens it.

    A ledger in PostgreSQL (EAGLE3_LEDGER_URL) is left to its first user: its creation takes the database's own lock,
    and a command that spends nothing should not need the database server.
    """
    from eagle3_assets.money.database import LEDGER_URL_ENV
    from eagle3_assets.money.ledger import SpendLedger
    from eagle3_resources.storage import DataLayout, default_data_dir

    layout = DataLayout(default_data_dir())
    layout.root.mkdir(parents=True, exist_ok=True)
    if not os.environ.get(LEDGER_URL_ENV, "").strip():
        SpendLedger(layout.ledger(), legacy_journals=layout.all_completion_journals).close()


def show_pools() -> None:
    """Give the `gpu` pool its limit explicitly: the UI's Concurrency page lists only pools with a stored limit,
    and says "No pool limits" for one that only `default_limit` governs."""
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        storage = instance.event_log_storage
        if storage.supports_global_concurrency_limits and GPU_POOL not in storage.get_concurrency_keys():
            limit = (instance.get_settings("concurrency").get("pools") or {}).get("default_limit") or 1
            storage.set_concurrency_slots(GPU_POOL, int(limit))


def live_daemon_age(now: float | None = None) -> float | None:
    """Seconds since the instance's newest daemon heartbeat, if a daemon is serving it (DAEMON_LIVE_S); else None."""
    import time

    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        beats = instance.get_daemon_heartbeats()
    if not beats:
        return None
    age = (time.time() if now is None else now) - max(beat.timestamp for beat in beats.values())
    return age if age < DAEMON_LIVE_S else None


def forget_daemon() -> None:
    """After our own daemon stopped (`eagle3 dev` started it as the instance's only one): drop its heartbeats, so
    that the next `eagle3 dev` starts a daemon at once instead of taking them for a live one for DAEMON_LIVE_S."""
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        instance.run_storage.wipe_daemon_heartbeats()
