"""`pipeline_status` in the UI: an observable asset (its page shows the latest observation and an Observe button, not
"Never materialized" beside a greyed Materialize), and a board of plain markdown tables (the UI's markdown drops HTML:
a `<br>` between a cell's rows and its failing checks ran them together). Seen in the browser: docs/running.md."""

import dagster as dg
from dagster._core.definitions.observe import observe

from eagle3_assets.common.registry import DATASETS
from eagle3_assets.operations.quality import STATUS_ASSET, board_markdown, pipeline_status
from eagle3_assets.operations.status_model import PARTITIONED, CheckState, DatasetStatus, StageState, Status
from eagle3_resources.storage import DataStore


def failing(name: str, severity: str = "WARN", standin: bool = False) -> CheckState:
    return CheckState(name, False, severity, f"{name} failed", "run", 0.0, "B8", standin)


def test_pipeline_status_is_observable_and_observe_records_the_board(tmp_path):
    assert pipeline_status.is_observable and pipeline_status.key == STATUS_ASSET
    with dg.instance_for_test() as instance:
        assert observe([pipeline_status], instance=instance, resources={"store": DataStore(root=str(tmp_path))}).success
        record = instance.fetch_observations(STATUS_ASSET, limit=1).records[0]
    assert record.asset_observation is not None
    metadata = record.asset_observation.metadata
    assert metadata["datasets"].value == len(DATASETS) and metadata["datasets_complete"].value == 0
    assert str(metadata["board"].value).startswith("**Datasets**")


def test_the_board_is_tables_of_one_line_a_row_with_the_failing_checks_in_their_own_column():
    def stage(asset: str, checks: list[CheckState]) -> StageState:
        return StageState(asset, True, 0.0, "run", {"rows": 28}, checks=checks)

    b8 = {
        "raw_prompts": stage("raw_prompts", []),
        "completions": stage("completions", [failing("truncated_share", standin=True)]),
        "token_ids": stage("token_ids", [failing("separator_and_end_token"), failing("billed", "ERROR")]),
    }
    fresh = {asset: StageState(asset) for asset in PARTITIONED}
    status = Status(
        0.0, None, None, [DatasetStatus("A1", fresh), DatasetStatus("B8", b8)], [StageState("hidden_states")]
    )
    board = board_markdown(status)
    assert "<" not in board  # no HTML: the UI drops it
    tables = [[line for line in block.splitlines() if line.startswith("|")] for block in board.split("\n\n")]
    tables = [t for t in tables if t]
    assert [len(t) for t in tables] == [2 + 2, 2 + 1]  # header, rule and a row per dataset; per stage
    for table in tables:  # every row has the header's cells: none runs into the next
        assert {line.count("|") for line in table} == {table[0].count("|")}
    header, _, a1, row = tables[0]
    assert header == "| dataset | raw_prompts | completions | token_ids | failing checks | complete |"
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["B8", "ok,\u00a028\u00a0rows", "warn,\u00a028\u00a0rows", "**FAIL**,\u00a028\u00a0rows"]
    assert cells[4] == (
        "completions: `truncated_share` (stand-in); token_ids: `billed`, `separator_and_end_token`"  # ERROR first
    )
    assert cells[5] == "no"  # an ERROR check fails on its token_ids
    assert [c.strip() for c in a1.strip("|").split("|")] == ["A1", "—", "—", "—", "none", "no"]
    assert "(stand-in): expected of the tiny stand-in target" in board  # the tag said once, under the table
