"""`eagle3`: the project's command. It sets DAGSTER_HOME so nobody has to.

    eagle3 run [--datasets A1,B2] [--real-prompts]
                                    run eagle3_pipeline now, in this process, against the embedded
                                    SQLite instance; ends with a finished run recorded there
    eagle3 prompts [--real] [--datasets B1,B3] [--sources DIR]
                                    build raw_prompts only (nothing is spent) and print each dataset's
                                    import: rows, rejects, duplicates, filtered, selected
    eagle3 dev [--port 3000]        the Dagster UI and daemon (`dagster dev`) on 127.0.0.1; the UI alone
                                    when another daemon serves the instance (one daemon per instance)
    eagle3 dagster ARGS...          any `dagster` command with this project's DAGSTER_HOME,
                                    e.g. `eagle3 dagster job launch -j eagle3_pipeline`
    eagle3 hold [show|lift]         the credit sensor's spending hold: why it stands, what is unsettled; lift it
    eagle3 ledger [show|settle]     the spend ledger: billed, in flight, unsettled; look up unsettled bills now
    eagle3 status [--json]          the picture over SSH: every dataset's stages (rows, tokens, dollars, checks),
                                    the training stages, runs in progress, money and the spending hold
    eagle3 env                      print the environment lines, for a shell that runs dagster itself
    eagle3 gpu-check [--model PATH] [--tp N] [--tokens N] [--data-dir DIR] [--no-capture] [--json]
                                    the first command on a new host: install, driver, GPUs, /dev/shm, the
                                    data root's write speed and free space, sglang's API contract, short
                                    captures checked against ground truth; the fix for each failure (gpu_check.py)

The instance lives in `var/dagster` (git-ignored, SQLite) unless DAGSTER_HOME is already set; with
EAGLE3_POSTGRES_URL set, in that PostgreSQL database, configured from `var/dagster-postgres`
(eagle3_assets/operations/instance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from eagle3_assets.operations.instance import DAEMON_LIVE_S, dagster_home
from eagle3_resources.storage import PROJECT_ROOT, default_data_dir

DEFS_MODULE = "eagle3_assets.definitions"  # the code location, as workspace.yaml loads it

if TYPE_CHECKING:  # dagster and the ledger are imported when a command needs them: `eagle3 env` starts at once
    import dagster as dg
    from dagster._core.remote_origin import RemoteJobOrigin
    from dagster._core.storage.dagster_run import DagsterRun

    from eagle3_assets.money.ledger import SpendLedger


def _dataset_range(datasets: list[str] | None) -> tuple[str, str] | None:
    """The first and last dataset of `--datasets` (names, or `B1...B6`), which must be contiguous in the registry."""
    from eagle3_assets.common.registry import DATASETS

    names = list(DATASETS)
    chosen = []
    for item in datasets or names:
        first, _, last = item.partition("...")
        if last and first in DATASETS and last in DATASETS:
            if names.index(first) > names.index(last):
                order = ", ".join(names)
                print(f"{item}: {first} comes after {last} in the registry order: {order}", file=sys.stderr)
                return None
            chosen += names[names.index(first) : names.index(last) + 1]
        else:
            chosen += [first, last] if last else [first]
    unknown = [d for d in chosen if d not in DATASETS]
    if unknown:
        print(f"unknown dataset(s) {unknown}; the registry lists {', '.join(names)}", file=sys.stderr)
        return None
    idx = sorted(names.index(d) for d in chosen)
    if idx != list(range(idx[0], idx[-1] + 1)):
        print("--datasets must be a contiguous range of the registry order: " + ", ".join(names), file=sys.stderr)
        return None
    return names[idx[0]], names[idx[-1]]


def workspace_job_origin(job_name: str) -> RemoteJobOrigin:
    """The origin a run of `job_name` gets when the UI or `dagster job launch` starts it from workspace.yaml.

    The UI's timeline (Overview) places a run by its code location and repository, read from this origin, and leaves
    out a run without one, as `execute_job` makes them (the Runs page lists it anyway). The location is the one of
    the project's workspace.yaml that loads this code (`dagster dev` and `eagle3 dev` read the same file).
    """
    from dagster._core.remote_origin import (
        ManagedGrpcPythonEnvCodeLocationOrigin,
        RemoteJobOrigin,
        RemoteRepositoryOrigin,
    )
    from dagster._core.workspace.load import location_origin_from_module_name, location_origins_from_yaml_paths

    workspace = PROJECT_ROOT / "workspace.yaml"
    origins = location_origins_from_yaml_paths([str(workspace)]) if workspace.exists() else []
    ours = [
        o
        for o in origins
        if isinstance(o, ManagedGrpcPythonEnvCodeLocationOrigin) and o.loadable_target_origin.module_name == DEFS_MODULE
    ]
    location = ours[0] if ours else location_origin_from_module_name(DEFS_MODULE, None, str(PROJECT_ROOT))
    from eagle3_assets.definitions import defs

    return RemoteJobOrigin(RemoteRepositoryOrigin(location, defs.get_repository_def().name), job_name)


def _execute(
    job_fn: Callable[[], dg.JobDefinition], start: str, end: str, run_config: dict[str, Any] | None = None
) -> tuple[dg.ExecuteJobResult, DagsterRun]:
    """Run a job of the code location (`job_fn` returns it) now, in this process, over the range start...end.

    As `dg.execute_job` does (a run created in the instance, then executed here), but the run is created with the
    workspace's job origin, as a launched run is, so the UI's timeline shows it (`workspace_job_origin`).
    """
    import dagster as dg
    from dagster._core.execution.api import execute_run
    from dagster._core.storage.tags import (
        ASSET_PARTITION_RANGE_END_TAG,
        ASSET_PARTITION_RANGE_START_TAG,
    )

    recon = dg.reconstructable(job_fn)
    load_data = recon.repository.get_definition().repository_load_data
    recon = recon.with_repository_load_data(load_data)
    job_def = recon.get_definition()
    tags = {ASSET_PARTITION_RANGE_START_TAG: start, ASSET_PARTITION_RANGE_END_TAG: end}
    with dg.DagsterInstance.get() as instance:
        created = instance.create_run_for_job(
            job_def=job_def,
            run_config={"execution": {"config": {"in_process": {}}}, **(run_config or {})},
            tags={**job_def.run_tags, **tags},
            job_code_origin=recon.get_python_origin(),
            remote_job_origin=workspace_job_origin(job_def.name),
            repository_load_data=load_data,
        )
        result = execute_run(recon, created, instance)
        run = instance.get_run_by_id(result.run_id)
        assert run is not None, "the run was created in the instance"
        return result, run


def run_pipeline(datasets: list[str] | None, config_file: str | None = None) -> int:
    home = dagster_home()
    span = _dataset_range(datasets)
    if span is None:
        return 2
    start, end = span
    print(f"DAGSTER_HOME={home}\nEAGLE3_DATA_DIR={default_data_dir()}\nrunning eagle3_pipeline for {start}...{end}")
    started = time.monotonic()
    import yaml

    run_config = yaml.safe_load(Path(config_file).read_text()) if config_file else None
    result, run = _execute(_pipeline_job, start, end, run_config)
    minutes = (time.monotonic() - started) / 60
    drafter = default_data_dir() / "eagle3_drafter"
    print(f"run {result.run_id}: {run.status.value} in {minutes:.1f} min")
    if result.success:
        print(f"drafter checkpoint: {drafter}")
        print("open the UI with `eagle3 dev` to see every stage's metadata")
    return 0 if result.success else 1


def prompts_command(datasets: list[str] | None, mode: str, sources: str | None) -> int:
    """Build raw_prompts only (nothing is spent) and print what each dataset's import did."""
    dagster_home()
    span = _dataset_range(datasets)
    if span is None:
        return 2
    start, end = span
    config = {"prompts": mode, **({"sources_dir": str(Path(sources).resolve())} if sources else {})}
    print(
        f"building raw_prompts for {start}...{end} from the {mode} prompts"
        + (f" (sources under {sources})" if sources else " (real: from the Hugging Face Hub)" if mode == "real" else "")
    )
    started = time.monotonic()
    result, run = _execute(_import_job, start, end, {"ops": {"raw_prompts": {"config": config}}})
    print(f"run {result.run_id}: {run.status.value} in {time.monotonic() - started:.1f} s")
    for event in result.all_events:
        if event.event_type_value == "STEP_FAILURE":
            print(
                event.step_failure_data.user_failure_data.description
                if event.step_failure_data.user_failure_data
                else event.message,
                file=sys.stderr,
            )
    mats = result.asset_materializations_for_node("raw_prompts")  # one per dataset, each with its own figures
    if mats:
        print(f"{'dataset':8} {'rows':>9} {'rejected':>9} {'dups':>7} {'filtered':>9} {'selected':>9}  prompts file")
    for mat in mats:
        r, name = mat.metadata["import_report"].value, mat.partition
        dups = r["duplicates_within"] + sum(r["duplicates_of_earlier"].values())
        print(
            f"{name:8} {r['rows']:>9,} {r['rejected']:>9,} {dups:>7,} {sum(r['filtered'].values()):>9,} "
            f"{r['selected']:>9,}  {mat.metadata['path'].value}"
        )
        if "rejects_file" in mat.metadata and r["rejected"]:
            print(
                f"{'':8} rejects: {mat.metadata['rejects_file'].value} "
                f"({', '.join(f'{k}: {v}' for k, v in r['reject_reasons'].items())})"
            )
    from eagle3_assets.common.per_dataset import SUMMARY_CHECK

    # each dataset's own checks (`all_datasets` also reads datasets this run left alone)
    failed = [c for c in result.get_asset_check_evaluations() if not c.passed and c.check_name != SUMMARY_CHECK]
    for check in failed:  # the description starts with the dataset
        print(f"check {check.check_name} FAILED: {check.description}", file=sys.stderr)
    return 0 if result.success and not failed else 1


def _ledger() -> SpendLedger:
    from eagle3_assets.money import open_data_root_ledger

    return open_data_root_ledger()


def _print_ledger(ledger: SpendLedger) -> None:
    from eagle3_assets.money import ledger as L

    figs = ledger.figures()
    print(
        f"ledger {ledger.location}: billed ${figs.total.settled_usd:.4f} in all, "
        f"${figs.today.settled_usd:.4f} today ({figs.day} UTC); "
        f"in flight {figs.live} (worst ${figs.total.live_usd:.4f})"
    )
    stuck = figs.unsettled + figs.unidentified
    print(
        f"unsettled: {stuck} attempt(s) started without a bill, worst case ${figs.total.stuck_usd:.4f} "
        f"({figs.unsettled} with a generation id, looked up; {figs.unidentified} cut before their id arrived)"
    )
    for row in ledger.read(L.stuck_attempts, 10):
        age = time.time() - (row["ended_at"] or time.time())
        print(
            f"  {row['dataset']}/{row['prompt_id']}: {row['state']} {row['generation_id'] or '(no id)'} up to "
            f"${row['reserved_usd']:.4f}, {age / 60:.1f} min ago, {row['lookups']} look-up(s)"
        )
    if stuck:
        print(
            "their prompts are not sent again until they settle or the horizon passes (EAGLE3_UNSETTLED_HORIZON_S); "
            "`eagle3 ledger settle` looks them up now"
        )


def hold_command(action: str) -> int:
    from eagle3_assets.money import SpendPolicy, get_hold, lift_hold
    from eagle3_assets.money.policy import crossed

    ledger = _ledger()
    hold = get_hold(ledger)
    if hold is None:
        print("no spending hold")
    else:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(hold["since"]))
        print(f"spending held since {since}:\n  " + "\n  ".join(hold["reasons"]))
        print("thresholds: " + json.dumps(hold["thresholds"]))
    _print_ledger(ledger)
    if action == "lift" and hold is not None:
        lift_hold(ledger, "lifted with `eagle3 hold lift`")
        print("hold lifted")
        still = crossed(SpendPolicy().thresholds(), None, ledger.figures()).reasons
        if still:
            print(
                "still crossed now, so the credit sensor sets it again (raise the threshold to go on): "
                + "; ".join(still)
            )
    return 0


def ledger_command(action: str, wait_s: float) -> int:
    import asyncio

    from eagle3_assets.money import SpendPolicy
    from eagle3_assets.money.settle import settle_due
    from eagle3_assets.money.writer import LedgerWriter
    from eagle3_resources.completions.openrouter_account import OpenRouterAccount

    ledger = _ledger()
    if action == "settle":
        from eagle3_assets.money.settle import recover_idle_datasets
        from eagle3_resources.storage import DataLayout

        # Attempts of processes that ended (killed): never sent ones released, the others held and looked up below.
        for dataset, counts in recover_idle_datasets(DataLayout(default_data_dir()), ledger).items():
            print(f"{dataset}: attempts left by a process that ended, put right: {counts}")
        policy = SpendPolicy()
        endpoint = policy.account_endpoint()
        if endpoint is None:
            print("OPENROUTER_API_KEY is not set: nothing can be looked up", file=sys.stderr)
            return 2

        async def settle() -> None:
            with LedgerWriter(ledger) as writer:
                async with OpenRouterAccount(*endpoint) as account:
                    deadline = time.monotonic() + wait_s
                    while True:
                        report = await settle_due(
                            writer,
                            account.generation,
                            deadline_s=max(1.0, deadline - time.monotonic()),
                            horizon_s=policy.horizon_s,
                        )
                        print(report.line())
                        if not ledger.figures().unsettled or time.monotonic() >= deadline:
                            return
                        await asyncio.sleep(min(5.0, max(0.0, deadline - time.monotonic())))

        asyncio.run(settle())
    _print_ledger(ledger)
    return 0


def _pipeline_job() -> dg.JobDefinition:
    """Module-level so the run can be reconstructed by the executor."""
    from eagle3_assets.definitions import defs

    return defs.get_job_def("eagle3_pipeline")


def _import_job() -> dg.JobDefinition:
    from eagle3_assets.definitions import defs

    return defs.get_job_def("import_prompts")


def dev_command(port: int, workspace: str) -> int:
    """`dagster dev` (UI + daemon), or the UI alone when another daemon already serves this instance.

    Dagster runs one daemon per instance: two dequeue the same queued run, and a run launched twice
    is executed twice or failed (measured on PostgreSQL, tests/test_postgres.py). A team's second
    `eagle3 dev` on a shared instance therefore gets the UI; the first one's daemon runs everything.
    """
    from eagle3_assets.operations.instance import forget_daemon, live_daemon_age

    bin_dir = Path(sys.executable).parent
    age = live_daemon_age()
    if age is None:
        try:
            return run_in_group([str(bin_dir / "dagster"), "dev", "-w", workspace, "-h", "127.0.0.1", "-p", str(port)])
        finally:
            forget_daemon()  # stopped (its process group is gone): a restart need not wait for the heartbeat to age
    print(
        f"a daemon already serves this instance (its last heartbeat {age:.0f} s ago): starting the UI only, as "
        "Dagster runs one daemon per instance. If that daemon has stopped, run `eagle3 dev` again once its "
        f"heartbeat is older than {DAEMON_LIVE_S:.0f} s.",
        flush=True,
    )
    return run_in_group([str(bin_dir / "dagster-webserver"), "-w", workspace, "-h", "127.0.0.1", "-p", str(port)])


def run_in_group(cmd: list[str]) -> int:
    """Run a long-lived command (dagster dev) in its own process group; stop the whole group.

    Started from a non-interactive shell `dagster dev` ignores SIGINT/SIGTERM and its code
    servers outlive it, so default handlers are restored and the group is signalled.
    """
    proc = subprocess.Popen(
        cmd,
        start_new_session=True,
        preexec_fn=lambda: (
            signal.signal(signal.SIGINT, signal.SIG_DFL),
            signal.signal(signal.SIGTERM, signal.SIG_DFL),
        ),
    )

    def stop(signum: int, _frame: FrameType | None) -> None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        return proc.wait()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(1)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _add_pipeline_commands(sub: argparse._SubParsersAction) -> None:
    """`run`, `prompts`, `dev`, `dagster`: building the assets and the Dagster tools."""
    p_run = sub.add_parser("run", help="run eagle3_pipeline now and wait for it")
    p_run.add_argument("--datasets", help="contiguous datasets: A1,A2 or B1...B6 (default: all)")
    p_run.add_argument(
        "--real-prompts", action="store_true", help="import each dataset's real source (EAGLE3_PROMPTS=real)"
    )
    p_run.add_argument(
        "--config",
        help="a Dagster run config YAML for the run (as `dagster job launch --config` takes), e.g. "
        "ops: {eagle3_drafter: {config: {epochs: 6}}}",
    )
    p_prompts = sub.add_parser("prompts", help="build raw_prompts only and report the import (nothing is spent)")
    p_prompts.add_argument("--datasets", help="contiguous datasets: A1,A2 or B1...B6 (default: all)")
    p_prompts.add_argument("--real", action="store_true", help="import the real sources named in data/datasets.yaml")
    p_prompts.add_argument(
        "--sources",
        help="a local copy of the sources (<dir>/<hub id>/<files>); default: "
        "EAGLE3_SOURCES_DIR, else the Hugging Face Hub",
    )
    p_dev = sub.add_parser("dev", help="Dagster UI + daemon on 127.0.0.1")
    p_dev.add_argument("--port", type=int, default=3000)
    p_dev.add_argument(
        "--workspace",
        default="workspace.yaml",
        help="the workspace file, relative to the project (default: workspace.yaml, this project's code)",
    )
    p_dg = sub.add_parser("dagster", help="any dagster command with this project's DAGSTER_HOME")
    p_dg.add_argument("args", nargs=argparse.REMAINDER)


def _add_operator_commands(sub: argparse._SubParsersAction) -> None:
    """`hold`, `ledger`, `status`, `env`: what an operator reads and puts right."""
    p_hold = sub.add_parser("hold", help="show or lift the spending hold")
    p_hold.add_argument("action", choices=["show", "lift"], nargs="?", default="show")
    p_ledger = sub.add_parser(
        "ledger",
        help="the spend ledger; `settle` puts right what killed processes left "
        "(never-sent reservations released) and looks up unsettled bills now",
    )
    p_ledger.add_argument("action", choices=["show", "settle"], nargs="?", default="show")
    p_ledger.add_argument("--wait", type=float, default=0.0, help="with settle: keep looking up for this many seconds")
    p_status = sub.add_parser("status", help="each dataset's stages, runs in progress, money and the hold")
    p_status.add_argument("--json", action="store_true", help="print the same data as JSON")
    sub.add_parser("env", help="print DAGSTER_HOME and EAGLE3_DATA_DIR as shell lines")


def _add_gpu_check_command(sub: argparse._SubParsersAction) -> None:
    p_gpu = sub.add_parser("gpu-check", help="CUDA, sglang, its API contract, and short hidden-state captures")
    p_gpu.add_argument("--model", help="also capture from this target folder (e.g. Kimi-K2.5) with SGLang")
    p_gpu.add_argument(
        "--tp", type=int, help="tensor-parallel GPUs for SGLang (tiny model: 1, --model: 8); asks for the SGLang rows"
    )
    p_gpu.add_argument("--json", action="store_true", help="print the rows as JSON")
    p_gpu.add_argument(
        "--data-dir", type=Path, default=None, help="the data root to measure (default: EAGLE3_DATA_DIR)"
    )
    p_gpu.add_argument(
        "--tokens", type=int, help="tokens you plan to capture (default: the merged dataset's); asks for the disk rows"
    )
    p_gpu.add_argument(
        "--max-forward-tokens",
        type=int,
        help="tokens of one SGLang forward, the rows of one /dev/shm "
        "hand-off slab (default: EAGLE3_SGLANG_MAX_FORWARD_TOKENS, else 32768)",
    )
    p_gpu.add_argument(
        "--handoff-slabs", type=int, help="slabs in the /dev/shm hand-off ring (default: the backend's, 2)"
    )
    p_gpu.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="where shared memory is mounted")
    p_gpu.add_argument(
        "--disk-mib", type=int, default=256, help="MiB written (fsync'd, then removed) to time the data root"
    )
    p_gpu.add_argument("--min-disk-gbps", type=float, help="fail the disk write row below this many GB/s")
    p_gpu.add_argument(
        "--no-capture", action="store_true", help="host, install and contract rows only (no tiny-model captures)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_pipeline_commands(sub)
    _add_operator_commands(sub)
    _add_gpu_check_command(sub)
    return parser


def _gpu_check_command(args: argparse.Namespace) -> int:
    from eagle3_assets.operations.gpu_check import HostPlan, gpu_check

    host = HostPlan(
        data_dir=(args.data_dir or default_data_dir()).resolve(),
        tokens=args.tokens,
        max_forward_tokens=args.max_forward_tokens,
        handoff_slabs=args.handoff_slabs,
        shm_dir=args.shm_dir,
        disk_mib=args.disk_mib,
        min_disk_gbps=args.min_disk_gbps,
    )
    return gpu_check(
        str(Path(args.model).resolve()) if args.model else None,
        args.tp,
        args.json,
        host,
        capture=not args.no_capture,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "gpu-check":
        return _gpu_check_command(args)

    os.chdir(PROJECT_ROOT)
    if args.command == "run":
        if args.real_prompts:
            os.environ["EAGLE3_PROMPTS"] = "real"
        return run_pipeline(args.datasets.split(",") if args.datasets else None, args.config)
    if args.command == "prompts":
        return prompts_command(
            args.datasets.split(",") if args.datasets else None, "real" if args.real else "sample", args.sources
        )
    home = dagster_home()
    if args.command == "hold":
        return hold_command(args.action)
    if args.command == "ledger":
        return ledger_command(args.action, args.wait)
    if args.command == "status":
        from eagle3_assets.operations.status import status_command

        return status_command(args.json)
    dagster = str(Path(sys.executable).with_name("dagster"))
    if args.command == "dev":
        return dev_command(args.port, args.workspace)
    if args.command == "dagster":
        return subprocess.call([dagster, *args.args])
    print(f"export DAGSTER_HOME={home}\nexport EAGLE3_DATA_DIR={default_data_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
