"""Tests run in any order (pytest-xdist hands each worker other files first): a Dagster instance closed out of order in
one test must not break the next test's `Definitions` (conftest's no_dead_dagster_state_storage)."""

from __future__ import annotations

import gc

import dagster as dg
from dagster._core.storage.defs_state.base import DefsStateStorage


@dg.asset
def one() -> int:
    return 1


def test_instances_closed_out_of_order_leave_a_collected_instances_storage_current(tmp_path):
    (tmp_path / "first").mkdir(), (tmp_path / "second").mkdir()
    first = dg.DagsterInstance.local_temp(str(tmp_path / "first"))
    second = dg.DagsterInstance.local_temp(str(tmp_path / "second"))
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the storage before `first`: none
    second.__exit__(None, None, None)  # the storage before `second`: `first`'s, closed
    del first, second
    gc.collect()
    storage = DefsStateStorage.get()
    ref = storage._instance_weakref if storage is not None else None
    assert ref is not None and ref() is None  # what the next test meets without the fixture


def test_the_next_test_resolves_definitions():
    assert dg.Definitions(assets=[one], jobs=[dg.define_asset_job("j", [one])]).resolve_job_def("j").name == "j"
