"""Helpers for the real-browser UI test: Debian's Chromium under Playwright, and `eagle3 dev` on a free port."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from support import free_port, port_open, stop_group, wait_for

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium keeps calling home, which a closed network turns into stalls.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 900}


def screenshots_dir() -> Path:
    """Where the test's screenshots go: $EAGLE3_SCREENSHOTS, else var/ui-screenshots (git-ignored)."""
    path = Path(os.environ.get("EAGLE3_SCREENSHOTS") or REPO / "var" / "ui-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def require_chromium():
    """The sync Playwright API, or a failure that says what to install: this test runs in CI and must not skip."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"Chromium is not installed at {CHROMIUM}: the UI test drives Debian's Chromium. Install it with "
            "`apt-get install -y chromium` (as root; `.ci/run` does this). Do not run `playwright install`.",
            pytrace=False,
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "the playwright package is missing: install the test extras, `.venv/bin/pip install -e '.[test]'`",
            pytrace=False,
        )
    return sync_playwright


@contextlib.contextmanager
def chromium_page():
    """A fresh Chromium page (1400x900), closed with its browser on exit."""
    sync_playwright = require_chromium()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport=VIEWPORT).new_page()
            yield page
        finally:
            browser.close()


@contextlib.contextmanager
def eagle3_dev(tmp_path: Path, data_dir: Path, **env_vars: str):
    """`eagle3 dev` (webserver and daemon) on 127.0.0.1:<free port> with a fresh DAGSTER_HOME; yields (base url, log
    path).

    The instance is the one `eagle3` writes on first use (its dagster.yaml turns Dagster's community sign-up form off).
    The server runs in its own process group, which is killed on exit.
    """
    home = tmp_path / "dagster_home"  # made by `eagle3 dev`
    env = {k: v for k, v in os.environ.items() if k != "OPENROUTER_API_KEY"}
    env.update(
        {
            "DAGSTER_HOME": str(home),
            "EAGLE3_DATA_DIR": str(data_dir),
            "EAGLE3_COMPLETIONS_BACKEND": "local",
            "PYTHONUNBUFFERED": "1",
            **env_vars,
        }
    )
    port = free_port()
    log = tmp_path / "dev.log"
    with open(log, "w") as out:
        dev = subprocess.Popen(
            [sys.executable, "-m", "eagle3_assets.operations.cli", "dev", "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: port_open(port) or dev.poll() is not None, 180, "eagle3 dev to listen", every=0.5)
        assert dev.poll() is None, f"eagle3 dev exited with {dev.returncode}:\n{log_tail(log)}"
        yield f"http://127.0.0.1:{port}", log
    finally:
        stop_group(dev)


def log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def graphql(base_url: str, query: str, variables: dict | None = None, timeout: float = 60) -> dict:
    """One query against the webserver's GraphQL endpoint (used to know when to look, never instead of looking)."""
    request = urllib.request.Request(
        f"{base_url}/graphql",
        data=json.dumps({"query": query, "variables": variables or {}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = json.load(response)
    assert "errors" not in body, body["errors"]
    return body["data"]


def run_status(base_url: str, run_id: str) -> str:
    data = graphql(base_url, "query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }", {"id": run_id})
    return data["runOrError"].get("status", "UNKNOWN")
