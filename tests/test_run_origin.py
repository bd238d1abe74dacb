"""A run `eagle3 run` / `eagle3 prompts` executes in-process carries the origin a launched run has.

The UI's timeline (Overview) leaves out a run without a remote job origin, as `dg.execute_job` makes them; the Runs
page lists it anyway. Here the run's origin is compared with the one Dagster gives a run of the same job launched
from the workspace (`dagster job launch -w workspace.yaml`, the UI): the workspace loaded by Dagster, its code server
started. That the landing page then shows the run: tests/test_ui_browser.py.
"""

import shutil

import dagster as dg
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import WorkspaceFileTarget

from eagle3_assets.operations.cli import main

REPO_WORKSPACE = "workspace.yaml"


def test_an_in_process_run_has_the_workspace_job_origin(tmp_path, standin_dir, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(standin_dir, data / "standin")  # the tokenizer raw_prompts counts tokens with
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("EAGLE3_DATA_DIR", str(data))
    assert main(["prompts", "--datasets", "B6"]) == 0  # the import job, through the same code as `eagle3 run`

    with dg.DagsterInstance.get() as instance:
        [run] = instance.get_runs()
        origin = run.remote_job_origin
        assert origin is not None, "a run without a remote job origin is not on the UI's timeline"
        assert run.job_code_origin is not None  # still reconstructable from the run alone, as execute_job's are
        assert run.tags["dagster/code_location"] == "eagle3_assets.definitions"  # the Runs page's location filter
        with WorkspaceProcessContext(instance, WorkspaceFileTarget(paths=[REPO_WORKSPACE])) as workspace:
            request = workspace.create_request_context()
            location = request.get_code_location(origin.repository_origin.code_location_origin.location_name)
            repository = location.get_repository(origin.repository_origin.repository_name)
            launched = repository.get_full_job(run.job_name).get_remote_origin()
    assert origin == launched
