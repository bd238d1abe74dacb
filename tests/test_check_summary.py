"""`all_datasets`: one check of a per-dataset asset that fails while any dataset's latest evaluation fails.

Dagster's "Latest check results" on an asset's page are one dataset's (the last evaluated); a WARN failure on another
dataset showed only in that check's Partitions tab. The summary check is evaluated with every materialization, from
this run's verdicts and the recorded ones of the datasets the run left alone. Real parts: the project's instance
configuration (SQLite), runs materialized in-process as the pipeline's are (`per_dataset_results`), `eagle3 status`'s
reading and the alert sensor, which both leave the summary out. What the UI shows of it: tests/test_ui_browser.py.
"""

from pathlib import Path

import dagster as dg
from dagster._core.definitions.asset_checks.asset_check_evaluation import AssetCheckEvaluationPlanned
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.events import DagsterEvent, DagsterEventType
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from eagle3_assets.common.outcome import CheckOutcome, Checks
from eagle3_assets.common.per_dataset import SUMMARY_CHECK, dataset_check_specs, per_dataset_results
from eagle3_assets.common.registry import DATASETS, dataset_partitions
from eagle3_assets.common.standin import STANDIN_KEY
from eagle3_assets.operations.instance import INSTANCE_YAML
from eagle3_assets.operations.status import gather_status


def truncated(fail: bool) -> CheckOutcome:
    """Few answers hit max_tokens."""
    if fail:
        return CheckOutcome(False, "3 of 28 hit max_tokens", {"truncated": 3, STANDIN_KEY: True})
    return CheckOutcome(True, "0 of 28 hit max_tokens", {"truncated": 0})


def complete(fail: bool) -> CheckOutcome:
    """Every prompt has a final outcome."""
    return CheckOutcome(not fail, "27 of 28 final" if fail else "28 of 28 final")


CHECKS: Checks = {"complete": (complete, "ERROR"), "truncated_share": (truncated, "WARN")}


class ProbeConfig(dg.Config):
    failing: list[str] = []  # "check@dataset"


@dg.asset(
    name="completions",  # as `eagle3 status` names the stage
    partitions_def=dataset_partitions,
    check_specs=dataset_check_specs("completions", CHECKS),
    backfill_policy=dg.BackfillPolicy.single_run(),
)
def probe(context: dg.AssetExecutionContext, config: ProbeConfig):
    """A per-dataset asset whose checks fail where the run's config says, recorded as the pipeline's are."""
    datasets = context.partition_keys
    outcomes = {d: {name: fn(f"{name}@{d}" in config.failing) for name, (fn, _) in CHECKS.items()} for d in datasets}
    yield from per_dataset_results(context, {d: {"rows": 28} for d in datasets}, CHECKS, outcomes)


def materialize(instance: dg.DagsterInstance, datasets: list[str], failing: set[str]):
    """One run over `datasets` (a range when several); the `all_datasets` evaluation it recorded."""
    tags = {ASSET_PARTITION_RANGE_START_TAG: datasets[0], ASSET_PARTITION_RANGE_END_TAG: datasets[-1]}
    result = dg.materialize(
        [probe],
        instance=instance,
        partition_key=datasets[0] if len(datasets) == 1 else None,
        tags=tags if len(datasets) > 1 else {},
        run_config={"ops": {"completions": {"config": {"failing": sorted(failing)}}}},
    )
    assert result.success
    summaries = [e for e in result.get_asset_check_evaluations() if e.check_name == SUMMARY_CHECK]
    assert len(summaries) == 1, "one summary per run, whatever the number of datasets"
    assert summaries[0].partition is None
    return summaries[0]


def plan_evaluation(instance: dg.DagsterInstance, check: str, dataset: str) -> None:
    """What a run that evaluates `check` on `dataset` records at its start: the evaluation planned, in progress."""
    run = instance.create_run_for_job(dg.Definitions(assets=[probe]).resolve_implicit_global_asset_job_def())
    planned = AssetCheckEvaluationPlanned(
        asset_key=dg.AssetKey("completions"),
        check_name=check,
        partitions_subset=dataset_partitions.subset_with_partition_keys([dataset]),
    )
    event = DagsterEvent(
        event_type_value=DagsterEventType.ASSET_CHECK_EVALUATION_PLANNED.value,
        job_name=run.job_name,
        event_specific_data=planned,
    )
    instance.report_dagster_event(event, run_id=run.run_id)
    latest = instance.event_log_storage.get_latest_asset_check_execution_by_key(
        [dg.AssetCheckKey(dg.AssetKey("completions"), check)], partition_filter=PartitionKeyFilter(key=dataset)
    )
    assert [r.status.value for r in latest.values()] == ["PLANNED"]


def test_the_summary_fails_while_any_dataset_fails_and_names_each(tmp_path: Path):
    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text(INSTANCE_YAML)
    names = list(DATASETS)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        # Every dataset in one run, B8's WARN check failing (its last dataset B8 is not the one shown "latest" below).
        first = materialize(instance, names, {"truncated_share@B8"})
        assert not first.passed and first.severity == dg.AssetCheckSeverity.WARN
        assert first.description.splitlines()[0] == f"1 check failing on B8 ({len(names)} datasets evaluated):"
        assert "- B8 `truncated_share` WARN (stand-in): 3 of 28 hit max_tokens" in first.description
        assert first.metadata["failed_datasets"].value == ["B8"] and first.metadata["failing"].value == (
            "B8 truncated_share"
        )
        assert first.metadata[STANDIN_KEY].value is True  # every failure named is the stand-in's
        assert first.target_materialization_data is not None  # the asset's latest materialization: "latest" in the UI

        # Another run has planned B8's evaluation (it runs now): B8's last completed one is what counts meanwhile.
        plan_evaluation(instance, "truncated_share", "B8")
        # A later run of B6 alone passes everywhere it looks: B8's recorded failure still fails the summary.
        later = materialize(instance, ["B6"], set())
        assert not later.passed and "B8 `truncated_share`" in later.description and "B6" not in later.description
        # What the asset's page shows as "latest" for the check itself is B6's, passed; the summary is what fails.
        latest = instance.event_log_storage.get_latest_asset_check_execution_by_key(
            [dg.AssetCheckKey(dg.AssetKey("completions"), "truncated_share")]
        )
        assert [(r.partition, r.evaluation.passed) for r in latest.values() if r.evaluation] == [("B6", True)]

        # An ERROR check failing elsewhere makes the summary ERROR, each dataset named in registry order.
        worse = materialize(instance, ["A1", "A2"], {"complete@A2"})
        assert worse.severity == dg.AssetCheckSeverity.ERROR
        assert worse.description.splitlines()[1:] == [
            "- A2 `complete` ERROR: 27 of 28 final",
            "- B8 `truncated_share` WARN (stand-in): 3 of 28 hit max_tokens",
        ]
        assert STANDIN_KEY not in worse.metadata  # not every failure is the stand-in's

        # Both fixed: the summary passes.
        fixed = materialize(instance, ["A2"], set())
        assert not fixed.passed and "A2" not in fixed.description  # B8 still fails
        fixed = materialize(instance, ["B8"], set())
        assert fixed.passed and fixed.description == f"every check passes on all {len(names)} datasets evaluated"

        # `eagle3 status` reads each dataset's own evaluations; the summary is not a check of a dataset.
        materialize(instance, ["B8"], {"truncated_share@B8"})
        status = gather_status(instance, None)
        shown = {c.name for d in status.datasets for c in d.stages["completions"].checks}
        assert shown == {"complete", "truncated_share"}
        b8 = status.datasets[names.index("B8")].stages["completions"]
        assert [c.name for c in b8.failing] == ["truncated_share"]


def test_a_first_run_of_some_datasets_says_which_are_not_evaluated_yet(tmp_path: Path):
    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text(INSTANCE_YAML)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        summary = materialize(instance, ["B6", "B7"], set())
    rest = [d for d in DATASETS if d not in ("B6", "B7")]
    assert summary.passed
    assert summary.description == (
        f"every check passes on all 2 datasets evaluated\n\n(not evaluated yet: {', '.join(rest)})"
    )
