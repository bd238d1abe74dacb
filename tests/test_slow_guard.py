"""The slow guard (tests/slow_guard.py) in a pytest run of its own: an unmarked test over the limit fails the run and
is named; marked, it passes; a session fixture's setup is not charged to the test that first asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SUITE = """
import time
import pytest

@pytest.fixture(scope="session")
def built_once():
    time.sleep(2.5)  # like the stand-ins: built once per run

def test_uses_the_session_fixture(built_once):
    pass

MARK
def test_takes_a_while():
    time.sleep(2.5)

def test_quick():
    pass
"""


def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, mark: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_suite=SUITE.replace("MARK", mark))
    # A limit far under the sleeps: the guard scales it by the machine's load above its cores, and a busy machine must
    # not make it pass.
    monkeypatch.setenv("EAGLE3_SLOW_TEST_S", "0.2")
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    return pytester.runpytest_subprocess("-p", "slow_guard", "-p", "no:cacheprovider", *args)


# Under xdist (the README's command runs two workers) the session fixture is set up in a worker and the run judged in
# the controller: the worker's fixture time must reach the controller with the report.
IN_ONE_PROCESS_AND_UNDER_XDIST = pytest.mark.parametrize("args", [(), ("-n", "2")], ids=["one process", "xdist"])


@pytest.mark.slow
@IN_ONE_PROCESS_AND_UNDER_XDIST
def test_an_unmarked_slow_test_fails_the_run(pytester, monkeypatch, args):
    result = run(pytester, monkeypatch, "", *args)
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*tests over the slow limit without @pytest.mark.slow*", "*::test_takes_a_while: 2.*"])
    assert "test_uses_the_session_fixture:" not in result.stdout.str()  # the session fixture is not its time


@IN_ONE_PROCESS_AND_UNDER_XDIST
def test_a_marked_slow_test_passes(pytester, monkeypatch, args):
    result = run(pytester, monkeypatch, "@pytest.mark.slow", *args)
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.OK
    assert "slow limit" not in result.stdout.str()
