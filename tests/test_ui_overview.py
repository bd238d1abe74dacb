"""What `eagle3 dev` shows first after runs executed in-process, in a real browser (Debian's Chromium, Playwright).

Before the UI starts, two runs finish in a fresh instance through `eagle3 prompts`, which executes its job in-process
through the same code as `eagle3 run` (`cli._execute`; the whole pipeline would take many minutes): one over B5...B6
from the real-source fixtures, where B5's blocking `reject_rate` fails (2 of 4 rows rejected) and fails the run, then
one of B6 from the sample prompts, which passes. Then, as a user would after the first command:

- the landing page (Overview > Timeline) shows the runs, not "No runs or scheduled ticks": their job's row, and the
  successful run in the popover of its bar (a run without the workspace's job origin was left out);
- `raw_prompts`' overview shows a failed check although the check's latest evaluation (B6's) passed: `all_datasets`,
  whose page names B5 and `reject_rate`.

Screenshots in var/ui-screenshots/ (or $EAGLE3_SCREENSHOTS): `landing.png`, `raw_prompts_overview.png`,
`raw_prompts_all_datasets.png`; `overview_failure.png` is the page at a failed step.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from browser_support import REPO, chromium_page, eagle3_dev, log_tail, require_chromium, screenshots_dir
from support import build_source_tree

LOAD_MS = 180_000  # the first page of a cold webserver on a shared 2-core machine
UI_MS = 60_000
EMPTY_TIMELINE = "No runs or scheduled ticks in this time period."
LOCATION = "eagle3_assets.definitions"


@pytest.fixture(scope="module", autouse=True)
def chromium_installed():
    require_chromium()


def eagle3_prompts(args: list[str], home: Path, data: Path) -> tuple[int, str]:
    """`eagle3 prompts ARGS` in its own process against this home and data root: (exit code, its run's id)."""
    env = {k: v for k, v in os.environ.items() if k not in ("EAGLE3_PROMPTS", "EAGLE3_SOURCES_DIR", "DAGSTER_HOME")}
    env.update({"DAGSTER_HOME": str(home), "EAGLE3_DATA_DIR": str(data), "HF_HUB_OFFLINE": "1"})
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3_assets.operations.cli", "prompts", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    found = re.search(r"^run ([0-9a-f-]{36}): ", proc.stdout, re.M)
    assert found, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, found.group(1)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_landing_page_shows_in_process_runs_and_the_overview_a_failed_partitions_check(tmp_path, standin_dir):
    started = time.monotonic()
    data = tmp_path / "data"
    shutil.copytree(standin_dir, data / "standin")  # the tokenizer raw_prompts counts tokens with
    home = tmp_path / "dagster_home"  # the home eagle3_dev starts the UI on
    sources = build_source_tree(tmp_path / "sources")
    code, failed_run = eagle3_prompts(["--real", "--sources", str(sources), "--datasets", "B5...B6"], home, data)
    assert code == 1  # B5's reject_rate failed it
    code, passed_run = eagle3_prompts(["--datasets", "B6"], home, data)
    assert code == 0
    print(f"two runs in-process: {time.monotonic() - started:.0f} s")

    shots = screenshots_dir()
    with eagle3_dev(tmp_path, data) as (base, log), chromium_page() as page:
        page.set_default_timeout(UI_MS)
        try:
            landing_page_shows_the_runs(page, base, shots, [failed_run, passed_run])
            overview_shows_the_failed_partition(page, base, shots)
        except BaseException:
            page.screenshot(path=shots / "overview_failure.png")
            print(f"page at failure: {page.url}\n-- eagle3 dev log --\n{log_tail(log)}")
            raise
    print(f"UI overview test: {time.monotonic() - started:.0f} s; screenshots in {shots}")


def landing_page_shows_the_runs(page, base: str, shots: Path, run_ids: list[str]) -> None:
    """The first page the UI opens is the Overview timeline; the runs' job has its row there, the runs in its bar."""
    page.goto(f"{base}/", timeout=LOAD_MS)
    page.wait_for_url(re.compile(r"/overview/.*timeline"), timeout=LOAD_MS)
    job = page.locator(f'a[href="/locations/{LOCATION}/jobs/import_prompts"]')
    try:
        job.first.wait_for(timeout=LOAD_MS)
    except Exception:  # noqa: BLE001 - Playwright's timeout: say what the page shows instead
        empty = page.get_by_text(EMPTY_TIMELINE).is_visible()
        raise AssertionError(
            f"the timeline has no row for import_prompts (it says {EMPTY_TIMELINE!r}: {empty})"
        ) from None
    assert not page.get_by_text(EMPTY_TIMELINE).is_visible()
    page.get_by_text(LOCATION, exact=True).first.wait_for()  # the runs are grouped under the code location
    row = job.first.locator("xpath=ancestor::div[.//div[contains(@class,'RunTimeline_runChunks')]][1]")
    chunks = row.locator(".chunk-popover-target")
    assert chunks.count() >= 1, "the job's row has no run bar"
    page.screenshot(path=shots / "landing.png")
    shown: set[str] = set()
    for i in range(chunks.count()):  # the two runs, a second apart, are one bar or two
        chunks.nth(i).hover()
        popover = page.locator(".bp5-popover-content").filter(has_text="import_prompts").last
        popover.wait_for()
        hrefs = popover.locator("a").evaluate_all("links => links.map(a => a.getAttribute('href'))")
        shown |= {h.split("/runs/")[1] for h in hrefs if h and h.startswith("/runs/")}
        page.mouse.move(5, 5)
    assert set(run_ids) <= shown, f"the timeline's bars show runs {sorted(shown)}, not {run_ids}"


def overview_shows_the_failed_partition(page, base: str, shots: Path) -> None:
    """raw_prompts' overview: the latest materialization is B6's, its reject_rate passed, and still a failed check is
    shown, `all_datasets`, whose page names B5's `reject_rate`."""
    page.goto(f"{base}/assets/raw_prompts", timeout=LOAD_MS)
    page.get_by_text("Latest check results").wait_for(timeout=LOAD_MS)
    status = page.get_by_text("Latest materialization").locator("xpath=..")
    status.get_by_text("B6", exact=True).wait_for()  # the latest is the passing partition's
    checks = page.get_by_text("Latest check results").locator("xpath=..")
    failing_icon = page.locator('[aria-label="cancel"], [aria-label="warning_outline"]')  # ERROR, WARN
    failed = checks.locator(".chunk-popover-target").filter(has=failing_icon)
    failed.first.wait_for()
    assert failed.first.inner_text().strip() == "1", failed.first.inner_text()
    page.screenshot(path=shots / "raw_prompts_overview.png")
    failed.first.hover()
    popover = page.locator(".bp5-popover-content").filter(has_text="Failed checks").last
    popover.get_by_text("all_datasets").wait_for()
    popover.get_by_text("all_datasets").click()
    page.wait_for_url(re.compile(r"checkDetail=all_datasets"))
    page.get_by_text(re.compile(r"^1 check failing on B5")).first.wait_for()
    page.get_by_text("reject_rate", exact=True).first.wait_for()
    page.screenshot(path=shots / "raw_prompts_all_datasets.png")
