"""One owner for every cap: a run's caps are its config's limits and the environment's, whichever is tighter.

The run config is the `completions` asset's (CompletionsConfig); the environment is the spend policy
(EAGLE3_MAX_RUN_USD, EAGLE3_MAX_DAY_USD, EAGLE3_MAX_TOTAL_USD); `money.caps.run_caps` is the one function where
they meet.
"""

import pytest

from eagle3_assets.money import SpendPolicy
from eagle3_assets.money.caps import Caps, Limits, run_caps
from eagle3_assets.stages.completions.asset import CompletionsConfig

ENV = ("EAGLE3_MAX_RUN_USD", "EAGLE3_MAX_DAY_USD", "EAGLE3_MAX_TOTAL_USD")


@pytest.fixture
def environment(monkeypatch):
    """The environment's limits as the spend policy reads them (a fresh SpendPolicy: every field unset)."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)

    def limits(**env: str) -> Limits:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return SpendPolicy().limits()

    return limits


def test_the_run_config_is_tighter(environment):
    env = environment(EAGLE3_MAX_RUN_USD="5", EAGLE3_MAX_TOTAL_USD="100")
    caps = CompletionsConfig(max_run_usd=2.0, max_total_usd=40.0).caps(1000, env)
    assert caps == Caps(token_budget=1000, run_usd=2.0, total_usd=40.0, day_usd=None, on_cap="finish")


def test_the_environment_is_tighter(environment):
    env = environment(EAGLE3_MAX_RUN_USD="5", EAGLE3_MAX_DAY_USD="7", EAGLE3_MAX_TOTAL_USD="100")
    caps = CompletionsConfig(max_run_usd=9.0, max_total_usd=250.0, on_cap="cancel").caps(None, env)
    assert caps == Caps(token_budget=None, run_usd=5.0, total_usd=100.0, day_usd=7.0, on_cap="cancel")


def test_one_side_unset_leaves_the_other(environment):
    env = environment(EAGLE3_MAX_RUN_USD="5")  # no total in the environment
    caps = CompletionsConfig(max_total_usd=30.0).caps(None, env)  # no run limit in the config
    assert (caps.run_usd, caps.total_usd, caps.day_usd) == (5.0, 30.0, None)


def test_neither_side_sets_a_limit(environment):
    assert CompletionsConfig().caps(None, environment()) == Caps()  # no dollar cap at all


def test_run_caps_merges_every_dollar_limit():
    caps = run_caps(Limits(run_usd=1.0, day_usd=None, total_usd=8.0), Limits(run_usd=3.0, day_usd=2.0, total_usd=6.0))
    assert (caps.run_usd, caps.day_usd, caps.total_usd) == (1.0, 2.0, 6.0)
