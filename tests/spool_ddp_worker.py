"""The REAL drafter trainer on a spool as several torchrun ranks (gloo, CPU), for tests/test_spool_ddp.py.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 tests/spool_ddp_worker.py \
        ROOT CHECKPOINT_DIR --record PREFIX --stats STATS.jsonl [--slow S] [--checkpoint-every K] [--heartbeat S] \
        [--stop-file F]

Every rank runs `train_from_spool` with the trainer's `Distributed` (rank 0 reads the spool, the others follow it).
The drafter and settings are tests/spool_training_worker.py's (a tiny drafter, fp32, one thread). After each
optimizer step a hook on every rank appends to PREFIX.rank<R>.jsonl the windows THIS rank trained in it (one JSON line
per step: the global step and [sample id, start, end, pass, shard] per window; a rank left without a window records
none), having checked that the trainer counted exactly the step's tokens. Each rank appends one JSON line of its
figures to STATS when it ends. STOP_FILE is the run's `stop` (a watch of the capture side): "stop" in it stops the
run while it waits, "fail" makes the watch raise there. The gloo collectives time out after two minutes (a rank left
waiting in a collective the others never join fails instead of hanging).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
from spool_training_worker import spool_settings, tiny_drafter, worker_arguments

from eagle3_assets.stages.eagle3_drafter.data import Teacher
from eagle3_assets.stages.eagle3_drafter.spool_data import SpoolWindows, train_from_spool
from eagle3_assets.stages.eagle3_drafter.train import Distributed, Every, RunOptions, Trainer


def main() -> None:
    parser = worker_arguments()
    parser.add_argument("--heartbeat", type=float, default=0.05)
    parser.add_argument("--stop-file", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    dist = Distributed(rank, world)
    settings = spool_settings(args.root, args.checkpoint_every)
    model, head = tiny_drafter()
    device = torch.device("cpu")
    teacher = Teacher(head, model.draft_ids, device)
    record = open(f"{args.record}.rank{rank}.jsonl", "a")

    def hooks(data: SpoolWindows) -> list[Every]:
        done = [0]  # the trainer's token count at the last step

        def write(trainer: Trainer) -> None:
            assert data.current is not None
            trained, done[0] = trainer.tokens_done - done[0], trainer.tokens_done
            if trained != (listed := sum(w.tokens for w in data.current.windows)):
                sys.exit(f"step {trainer.global_step}: the trainer trained {trained} tokens of the step's {listed}")
            windows = [[w.sample_id, w.start, w.end, w.pass_index, w.shard] for w in data.mine]
            record.write(json.dumps({"step": trainer.global_step, "windows": windows}) + "\n")
            record.flush()
            time.sleep(args.slow)

        return [Every(1, write)]

    def stop() -> bool:
        """The run's watch while it waits for capture: STOP_FILE saying "stop" stops it, "fail" fails it."""
        said = args.stop_file.read_text().strip() if args.stop_file is not None and args.stop_file.exists() else ""
        if said == "fail":
            raise RuntimeError("the capture side is gone (the test's watch)")
        return said == "stop"

    log = (lambda m: print(m, flush=True)) if dist.main else (lambda _m: None)
    options = RunOptions(device, log, args.checkpoint_dir, dist)
    try:
        trainer, data = train_from_spool(
            model,
            args.root,
            settings,
            options,
            teacher,
            hooks=hooks,
            poll_s=0.02,
            stop=stop,
            heartbeat_s=args.heartbeat,
        )
    finally:
        record.close()
    history = trainer.history
    stats = {
        "rank": rank,
        "steps": len(history.step_loss),
        "waited_s": round(data.waited_s, 3),
        "bytes_read": data.bytes_read,
        "reads": [read.to_json() for read in data.reads],  # this rank's own record of the shards it read
        "resumed_from_step": history.resumed_from_step,
        "tokens": history.tokens,
        "finite": all(x == x for x in history.step_loss),
        "world_size": history.world_size,
        "trained_out": data.trained_out() if dist.main else None,  # rank 0's reader at its end
    }
    with open(args.stats, "a") as f:
        f.write(json.dumps(stats) + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
