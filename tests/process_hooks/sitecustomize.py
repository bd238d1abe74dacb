"""Test-only hooks into the processes a test starts (the asset's sides, torchrun's ranks): Python imports this at
start-up in every process whose PYTHONPATH holds this folder, and each hook acts only where its variable is set. The
product has no such knobs. One file for all of them: mypy checks the tests as one tree, where two modules named
`sitecustomize` would clash.

- `EAGLE3_TEST_BEST_EVAL_DELAY_S` (tests/test_best_checkpoint_ddp.py): each best-checkpoint evaluation's decode
  sleeps that many seconds first, inside the evaluation's timed region, as a decode at real size takes minutes.
- `EAGLE3_TEST_TARGET_LOAD_DELAY_S` (tests/test_best_checkpoint_ddp.py): loading the target
  (`TargetModelResource.load_model`, rank 0's alone when the best checkpoint is kept) sleeps that many seconds first,
  as loading a real target takes minutes while the other ranks go on to their first collective.
- `EAGLE3_TEST_DIE_AFTER_TRAINING` (tests/test_streaming_resume.py), naming a file that does not exist yet: the
  first streaming training side whose training returns (every step trained, the last checkpoint written) creates
  that file and is killed (SIGKILL) before it scores, exports or reports: the state an orphan leaves when it
  finishes its steps just as it notices its orchestrator is gone. A later side, the file being there, runs as the
  product does.
"""

import functools
import os
from pathlib import Path

DELAY_ENV = "EAGLE3_TEST_BEST_EVAL_DELAY_S"
DIE_AFTER_TRAINING_ENV = "EAGLE3_TEST_DIE_AFTER_TRAINING"
LOAD_DELAY_ENV = "EAGLE3_TEST_TARGET_LOAD_DELAY_S"


def _slow_evaluations(seconds: float) -> None:
    import time

    from eagle3_assets.stages.eagle3_drafter import best_checkpoint

    measure = best_checkpoint.measure_by_kind

    @functools.wraps(measure)
    def slow_measure(*args, **kwargs):
        time.sleep(seconds)
        return measure(*args, **kwargs)

    best_checkpoint.measure_by_kind = slow_measure


def _slow_target_loads(seconds: float) -> None:
    import time

    from eagle3_resources.target.resource import TargetModelResource

    load = TargetModelResource.load_model

    @functools.wraps(load)
    def slow_load(*args, **kwargs):
        time.sleep(seconds)
        return load(*args, **kwargs)

    TargetModelResource.load_model = slow_load  # type: ignore[method-assign]


def _die_after_training(marker: Path) -> None:
    import signal

    # spool_data's, not streaming_train's: the side runs that module as __main__ (`python -m`), a module object of
    # its own that imports `train_from_spool` from spool_data when it runs, after this
    from eagle3_assets.stages.eagle3_drafter import spool_data

    train = spool_data.train_from_spool

    @functools.wraps(train)
    def train_then_die(*args, **kwargs):
        result = train(*args, **kwargs)
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return result
        os.kill(os.getpid(), signal.SIGKILL)
        return result  # not reached

    spool_data.train_from_spool = train_then_die


if float(os.environ.get(DELAY_ENV) or 0) > 0:
    _slow_evaluations(float(os.environ[DELAY_ENV]))
if float(os.environ.get(LOAD_DELAY_ENV) or 0) > 0:
    _slow_target_loads(float(os.environ[LOAD_DELAY_ENV]))
if os.environ.get(DIE_AFTER_TRAINING_ENV):
    _die_after_training(Path(os.environ[DIE_AFTER_TRAINING_ENV]))
