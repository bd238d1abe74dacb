"""Shared fixtures: the stand-in tokenizer and target, built once per test session.

Nothing here reaches a hub or a paid API: the stand-ins are built from the shipped prompt
files, and every server a test talks to runs on 127.0.0.1 inside the test process.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

import file_seconds
import pytest
from fakes.openrouter import ServerThread
from support import Webhook

from eagle3_assets.money import SpendLedger
from eagle3_resources.target.resource import TargetModelResource
from eagle3_resources.tokenizer.resource import TokenizerResource

REPO = Path(__file__).resolve().parents[1]

# slow_guard: the `slow` marker, and a run that fails on a test over a minute without it. pytester: its own test.
pytest_plugins = ["slow_guard", "pytester"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (their measured seconds, `file_seconds.json`; a file not measured yet counts 30 s a
    `slow` test), the rest after in their own order: the workers (`--dist loadfile --no-loadscope-reorder` hands out
    whole files in this order; xdist's own reorder, by test count, ran the one-test 3-minute files last, one worker
    alone for minutes) then end on short files together. The longest file that needs no stand-in goes second, so
    while the first worker builds the stand-ins (a minute, on one core) the second runs tests instead of waiting on
    the build's lock."""
    measured = file_seconds.load()
    slow: dict[Path, int] = {}
    standin: set[Path] = set()
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
        if "standin_dir" in getattr(item, "fixturenames", ()):
            standin.add(item.path)
    weight = {path: measured.get(path.name, 30.0 * n) for path, n in slow.items()}
    order = sorted(weight, key=lambda path: -weight[path])
    if order and order[0] in standin:
        without = next((path for path in order if path not in standin), None)
        if without is not None:
            order.remove(without)
            order.insert(1, without)
    rank = {path: i for i, path in enumerate(order)}
    items.sort(key=lambda item: rank[item.path])  # stable: a file's tests keep their order


@pytest.fixture
def webhook():
    """A real loopback server that records every alert posted to it (`hook.url`)."""
    hook = Webhook()
    with ServerThread(hook.app) as server:
        hook.url = f"{server.base_url}/hook"
        yield hook


@pytest.fixture(scope="session")
def standin_dir(tmp_path_factory) -> Path:
    """Built once per test run (a minute or two); EAGLE3_TEST_STANDIN_DIR names a folder to build it in once and reuse.

    Under pytest-xdist every worker is a session of its own: the first to ask builds the stand-ins in the run's
    shared temporary folder while the others wait on a file lock, then all load the same files."""
    reuse = os.environ.get("EAGLE3_TEST_STANDIN_DIR")
    if reuse:
        return Path(reuse)
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return tmp_path_factory.mktemp("standin")
    shared = tmp_path_factory.getbasetemp().parent / "standin"
    shared.mkdir(exist_ok=True)
    with open(shared.parent / "standin.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        TargetModelResource(standin_dir=str(shared)).folder(TokenizerResource(standin_dir=str(shared)), log=print)
    return shared


@pytest.fixture(scope="session")
def tokenizer_resource(standin_dir) -> TokenizerResource:
    return TokenizerResource(standin_dir=str(standin_dir))


@pytest.fixture(scope="session")
def tok(tokenizer_resource):
    return tokenizer_resource.load()


@pytest.fixture(scope="session")
def target_resource(standin_dir) -> TargetModelResource:
    return TargetModelResource(standin_dir=str(standin_dir))


@pytest.fixture(scope="session")
def target_model(target_resource, tokenizer_resource):
    return target_resource.load_model(tokenizer_resource, log=lambda m: None)


@pytest.fixture
def data_dir_with_standin(tmp_path, standin_dir, target_model) -> Path:
    """A fresh data root that already holds the session's stand-in tokenizer and target."""
    root = tmp_path / "data"
    shutil.copytree(standin_dir, root / "standin")
    return root


@pytest.fixture
def ledger(tmp_path) -> SpendLedger:
    """A fresh spend ledger (the shared one a data root would hold) for tests that drive run_completions directly."""
    return SpendLedger(tmp_path / "ledger" / "spend.sqlite")


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for the session, started on first use (tests/fakes/postgres_server.py) and stopped
    by its pid."""
    from fakes.postgres_server import PostgresServer

    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server, request) -> str:
    """A fresh database of the session's server for this test; its URL."""
    slug = "".join(c if c.isalnum() else "_" for c in request.node.name.lower())[:40]
    name = f"t_{slug}_{hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]}"  # unique within 63 characters
    return postgres_server.create_database(name)


@pytest.fixture
def ledger_in(request, monkeypatch) -> str:
    """Where open_ledger puts the spend ledger, by indirect parameter: "sqlite" (the data root's file, the default) or
    "postgres" (EAGLE3_LEDGER_URL: a fresh database of the session's server). Subprocesses inherit it."""
    where = getattr(request, "param", "sqlite")
    if where == "postgres":
        monkeypatch.setenv("EAGLE3_LEDGER_URL", request.getfixturevalue("postgres_url"))
    else:
        monkeypatch.delenv("EAGLE3_LEDGER_URL", raising=False)
    return where


@pytest.fixture(autouse=True)
def ledger_invariants(monkeypatch):
    """After every test: each spend ledger it opened in this process has scope figures equal to the sums over its
    attempt rows, and agrees with the bills of every fake provider it started (tests/ledger_invariants.py)."""
    from ledger_invariants import Watch

    watch = Watch().install(monkeypatch)
    yield watch
    problems = watch.problems()
    assert not problems, "the spend ledger disagrees with its own rows or the provider's bills:\n" + "\n".join(
        problems[:30]
    )


@pytest.fixture(scope="session")
def sglang_release_source() -> Path:
    """The pinned sglang wheel's Python source (downloaded from PyPI once, read by `ast`, never imported)."""
    from sglang_source import sglang_source

    return sglang_source()


@pytest.fixture(autouse=True)
def no_dead_dagster_state_storage():
    """Dagster keeps the open instance's definitions-state storage in a context variable, reset when the instance is
    closed, but to the value before it was opened: instances closed out of the order they were opened leave it
    pointing at one closed and collected, and the next `Definitions` resolved in this process raises "undefined
    DagsterInstance weakref" (seen under xdist, where another file's tests ran first in the same worker). Cleared
    before and after each test when it is dead."""
    from dagster._core.storage.defs_state.base import DefsStateStorage, _current_storage

    def clear_if_dead() -> None:
        storage = DefsStateStorage.get()
        ref = getattr(storage, "_instance_weakref", None)
        if storage is not None and ref is not None and ref() is None:
            _current_storage.set(None)

    clear_if_dead()
    yield
    clear_if_dead()


@pytest.fixture
def one_thread():
    """torch on one thread, as the CPU benchmarks run by default (their documented figures are on one thread); set
    back afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def torch_on_one_thread_from_the_start():
    """One thread before a worker's first module fixtures too (`torch_on_one_thread`'s reasons)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def torch_on_one_thread():
    """Every test starts and ends with torch on one thread (so module fixtures built between tests get one too):
    three workers share 2 cores (`-n 3`), so a worker's torch work on two threads oversubscribes them, and at the
    stand-in's sizes (width 64, one token a decode step) the threads' hand-offs cost more than the split gains
    (test_speculative.py: 846 s on two threads, 117 s on one, loaded). A test about the stages' own choice calls it
    (`apply_torch_threads`) or sets its count; the processes a test starts choose theirs as a user's would."""
    import torch

    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)
