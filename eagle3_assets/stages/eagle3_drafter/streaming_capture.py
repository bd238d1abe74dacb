"""The capture side of a streaming drafter run (issue 27):
`python -m eagle3_assets.stages.eagle3_drafter.streaming_capture SPEC`, on the GPU host that runs the target.

It builds the backend the `hidden_states` asset builds (the `hidden_states_backend` resource: SGLang on a GPU host,
transformers on the CPU), extracts the eval split into a small offline store (the trainer's held-out scores need it
after the spool's shards are gone) and touches `eval_done`, then captures the training split into its spool lane
(`capture_to_spool`), writing its progress figures as JSON lines to `progress`.

It holds the lane's writer lock (`lane_lock`) for its whole life, so a capture of an earlier run that has not ended
yet is never written beside, and the lane's lease with it (lease.py: where the lock lies, the later capture's lease
fences the earlier's commits), and it watches the orchestrator's heartbeat (`OrphanWatch`): a side whose orchestrator
is gone (kill -9 of the step) or replaced leaves by itself within `orphan_after_s`.
"""

from __future__ import annotations

import json
import socket
import sys
from functools import partial
from pathlib import Path
from typing import Any

import polars as pl

from eagle3_assets.stages.eagle3_drafter.streaming_sides import ORPHAN_AFTER_S, OrphanWatch, last_line


def capture_main(spec_path: Path) -> None:
    """The capture side: the lane's lock, then the eval split into its store, then the training split into the lane."""
    from eagle3_assets.stages.eagle3_drafter.streaming import split_samples
    from eagle3_resources.cpu import apply_torch_threads
    from eagle3_resources.hidden_states.extract import StoreSettings, capture_to_spool, extract_to_store
    from eagle3_resources.hidden_states.lane_lock import exclusive, lane_lock_path
    from eagle3_resources.hidden_states.resource import HiddenStatesResource
    from eagle3_resources.target.resource import TargetModelResource
    from eagle3_resources.tokenizer.resource import TokenizerResource

    spec = json.loads(Path(spec_path).read_text())
    log = partial(print, flush=True)
    orphan_after_s = float(spec.get("orphan_after_s", ORPHAN_AFTER_S))
    watch = OrphanWatch(Path(spec["folder"]), spec["run_id"], orphan_after_s, log).install()
    log(f"capture side of run {spec['run_id']} on {socket.gethostname()}")
    spool, lane = Path(spec["spool"]), spec["lane"]
    wait_s = float(spec.get("lock_wait_s", 3 * orphan_after_s + 60))
    with exclusive(lane_lock_path(spool, lane), f"capture of lane {lane}", wait_s=wait_s, log=log) as lease:
        r = spec["resources"]
        target, tokenizer = TargetModelResource(**r["target"]), TokenizerResource(**r["tokenizer"])
        resource = HiddenStatesResource(**r["hidden_states_backend"])
        train, held, _ = split_samples(pl.read_parquet(spec["merged"]))
        settings = StoreSettings(
            shard_bytes=int(spec["shard_bytes"]), batch_tokens=resource.batch_tokens, writers=int(spec["writers"])
        )
        apply_torch_threads("hidden-state capture (streaming)", log)
        backend = resource.make_backend(target, tokenizer, log)
        try:
            extract_to_store(held, backend, Path(spec["eval_root"]), settings, identity=spec["identity"], log=log)
            Path(spec["eval_done"]).touch()
            with open(spec["progress"], "a") as progress:

                def on_progress(figures: dict[str, Any]) -> None:
                    progress.write(json.dumps(figures) + "\n")
                    progress.flush()

                report = capture_to_spool(
                    train,
                    backend,
                    spool,
                    lane,
                    settings,
                    identity=spec["identity"],
                    log=log,
                    progress_every_s=float(spec["progress_every_s"]),
                    on_progress=on_progress,
                    poll_s=0.05,
                    lease=lease,  # every shard's commit checks it: a capture a later one replaced commits nothing
                )
                final = {"bytes_per_s": report.bytes_per_s, "busy_bytes_per_s": report.busy_bytes_per_s}
                on_progress({**last_line(Path(spec["progress"])), **final, "done": True})
        finally:
            backend.close()
    watch.close()
    log("capture side: done")


def main(argv: list[str]) -> int:
    capture_main(Path(argv[0]))  # a stop or an orphan leaves by SystemExit with its code
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
