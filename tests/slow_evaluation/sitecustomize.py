"""Slow best-checkpoint evaluations, for tests only: Python imports this at start-up in every process whose
PYTHONPATH holds this folder (tests/test_best_checkpoint_ddp.py puts it there for the torchrun ranks it starts, or
that the asset starts). With `EAGLE3_TEST_BEST_EVAL_DELAY_S` set, each evaluation's decode sleeps that many seconds
first, inside the evaluation's timed region, as a decode at real size takes minutes; the product has no such knob."""

import os

DELAY_ENV = "EAGLE3_TEST_BEST_EVAL_DELAY_S"

_seconds = float(os.environ.get(DELAY_ENV) or 0)
if _seconds > 0:
    import functools
    import time

    from eagle3_assets.stages.eagle3_drafter import best_checkpoint

    _measure = best_checkpoint.measure_by_kind

    @functools.wraps(_measure)
    def _slow_measure(*args, **kwargs):
        time.sleep(_seconds)
        return _measure(*args, **kwargs)

    best_checkpoint.measure_by_kind = _slow_measure
