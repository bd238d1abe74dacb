"""The `slow` marker's guard: a run fails when a test took over a minute and is not marked `slow`.

Contributors run `pytest -m "not slow" -n 2` as their fast loop; a test that grows past a minute
unmarked would quietly make that loop slow, so the full run (CI's) fails and names it.

A test's time is its setup, call and teardown, less the setup of session-scoped fixtures (the
stand-ins, a PostgreSQL server: built once per run and charged to whichever test asks first). Under
pytest-xdist the fixtures are set up in a worker and the reports judged in the controller, so the
worker writes each setup's session-fixture seconds into the report (`user_properties`), which
xdist carries across.
On a machine busier than its cores (the 1-minute load average above the CPU count) the limit
grows in proportion, so other work slowing every test down does not fail the run; an idle or
normally loaded machine keeps the minute. `EAGLE3_SLOW_TEST_S` sets the limit (default 60).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

LIMIT_ENV = "EAGLE3_SLOW_TEST_S"
SESSION_FIXTURE_S = "slow_guard_session_fixture_s"
DEFAULT_LIMIT_S = 60.0


def limit_s() -> float:
    raw = os.environ.get(LIMIT_ENV, "").strip()
    return float(raw) if raw else DEFAULT_LIMIT_S


def load_factor() -> float:
    """How much busier than its cores the machine has been over the last minute (at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        return max(1.0, os.getloadavg()[0] / cpus)
    except OSError:
        return 1.0


class SlowGuard:
    def __init__(self) -> None:
        self.session_fixture_s = 0.0  # session-scoped fixture setup so far, all tests together
        self.charged = 0.0  # how much of it has been taken out of a test's setup already
        self.seconds: dict[str, float] = {}
        self.slow: set[str] = set()
        self.over: list[tuple[str, float, float]] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        started = time.monotonic()
        yield
        if fixturedef.scope == "session":
            self.session_fixture_s += time.monotonic() - started

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Any:
        """Runs where the test ran (an xdist worker, or the only process): the session fixtures set up since the
        last setup report go into this one."""
        outcome = yield
        if call.when == "setup":
            outcome.get_result().user_properties.append((SESSION_FIXTURE_S, self.session_fixture_s - self.charged))
            self.charged = self.session_fixture_s

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Runs where the run is judged (xdist's controller, or the only process)."""
        seconds = report.duration
        if report.when == "setup":
            for key, value in report.user_properties:
                if key == SESSION_FIXTURE_S and isinstance(value, float):
                    seconds -= value
            if "slow" in report.keywords:
                self.slow.add(report.nodeid)
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + max(0.0, seconds)
        if report.when == "teardown" and report.nodeid not in self.slow:
            limit = limit_s() * load_factor()
            if self.seconds[report.nodeid] > limit:
                self.over.append((report.nodeid, self.seconds[report.nodeid], limit))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.over:
            return
        terminalreporter.section("tests over the slow limit without @pytest.mark.slow", red=True)
        for nodeid, seconds, limit in self.over:
            terminalreporter.line(f"{nodeid}: {seconds:.1f} s (limit {limit:.0f} s): mark it slow or make it faster")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.over and exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes over a minute on a 2-core machine (the fast loop skips it)")
    config.pluginmanager.register(SlowGuard(), "slow_guard_instance")
