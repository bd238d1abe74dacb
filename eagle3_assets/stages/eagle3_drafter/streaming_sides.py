"""The two sides of a streaming drafter run, as the orchestrating step starts and watches them (issue 27).

The step that materializes `eagle3_drafter` in streaming mode runs neither side itself: it plans, creates the spool,
writes each side's spec into the run's folder, starts the capture side and the training side through a
`SidesLauncher`, and then watches them only through that shared folder (their progress files, the spool's own
files) and their handles. So where a side runs is the launcher's business alone:

- `LocalSides`: each side a process group on this machine (training under torchrun when it has several ranks);
- `KubernetesSides` (streaming_k8s.py): each side a Kubernetes Job built with dagster-k8s, the capture on one GPU
  node, the training an Indexed Job over `nodes` GPU nodes, the spool on a ReadWriteMany volume all of them mount.

The sides' entry points are modules, run as `python -m <module> SPEC` (the training one under torchrun when it has
several ranks); their spec is a JSON file in the shared folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

CAPTURE_MODULE = "eagle3_assets.stages.eagle3_drafter.streaming_capture"
TRAINING_MODULE = "eagle3_assets.stages.eagle3_drafter.streaming_train"


class SideHandle(Protocol):
    """One started side, wherever it runs."""

    name: str  # "capture" or "training"

    def poll(self) -> int | None:
        """None while the side runs; its exit code once it ended (0: it finished its work)."""
        ...

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask it to stop (SIGTERM or its equivalent), then end it for good after `grace_s`; idempotent."""
        ...

    def describe(self) -> str:
        """Where it runs, for the log: a process group, or a Job and its pods."""
        ...

    def tail(self) -> str:
        """The last lines of its output, for an error message."""
        ...


class SidesLauncher(Protocol):
    """Starts the sides of one streaming run; `log_path` is where a launcher that can keep a side's output keeps it."""

    def start_capture(self, spec_path: Path, log_path: Path) -> SideHandle: ...

    def start_training(self, spec_path: Path, log_path: Path, *, nodes: int, processes_per_node: int) -> SideHandle: ...
