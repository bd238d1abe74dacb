"""More generation lanes for the local backend: worker processes, each with its own copy of the target on one thread.

Decoding the stand-in on a CPU is bound by one core: a step is a few dozen small ops and a pass over a 163,840-id
head, issued from Python. A second torch thread buys ~10 % (A1 10.9 s on one thread, 9.6 s on two, idle 2-core
machine), and two Python threads, one generate call each, are no faster (the GIL: A1 11.7 s). Two processes each
decode half of a round's prompts on a core of their own. Lane 0 is the backend's own thread and model; every further
lane is a process started once per backend (spawned: a fork would copy torch's thread pools) that loads the same
model folder in the same dtype, runs one torch thread, and dies with its parent (`PR_SET_PDEATHSIG`), so a `kill -9`
of the run leaves no generator behind. A prompt samples from its own seed (`prompt_seed`), so its completion is the
same on any lane and with any number of lanes.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_resources.completions.local_generate import Decoding, generate_rows
from eagle3_resources.completions.prompt_groups import GenerationCost

PR_SET_PDEATHSIG = 1  # linux/prctl.h
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class LaneModel:
    """The model a lane process loads: a Hugging Face folder in a torch dtype, on the CPU."""

    folder: str
    dtype: str

    @classmethod
    def of(cls, model: Any) -> LaneModel | None:
        """The folder `model` was loaded from, when a worker can load it the same way: on the CPU, from a local
        folder (None otherwise: on a GPU one process generates)."""
        folder = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
        if str(model.device) != "cpu" or not folder or not (Path(folder) / "config.json").exists():
            return None
        return cls(str(folder), str(model.dtype).removeprefix("torch."))


_model: Any = None  # the lane process's model (set by `_start`)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` dies; exit now if it already has (it died before the request was made)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:
        os._exit(1)


def _start(spec: LaneModel, parent: int) -> None:
    """A lane process's initializer: tied to its parent's life, one torch thread, the model loaded once."""
    global _model
    _die_with_parent(parent)
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    _model = AutoModelForCausalLM.from_pretrained(spec.folder, dtype=getattr(torch, spec.dtype)).eval()


def _generate(prompts: list[list[int]], decoding: Decoding, seeds: list[int]) -> list[list[int]]:
    return generate_rows(_model, prompts, decoding, seeds)


class LaneProcesses:
    """`workers` lane processes; `generate` hands one share to whichever is free."""

    def __init__(self, spec: LaneModel, workers: int):
        self.spec, self.workers = spec, workers
        self.pool = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start, initargs=(spec, os.getpid())
        )

    async def generate(self, prompts: list[list[int]], decoding: Decoding, seeds: list[int]) -> list[list[int]]:
        return await asyncio.wrap_future(self.pool.submit(_generate, prompts, decoding, seeds))

    def _processes(self) -> dict[int, Any]:
        # ProcessPoolExecutor has no public handle on its processes: a running call cannot be cancelled otherwise
        return dict(getattr(self.pool, "_processes", None) or {})

    def cpu_seconds(self) -> float:
        """CPU time the running lane processes have used (/proc/PID/stat), for the load watch's own share."""
        total = 0.0
        for pid in self._processes():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15 of stat)
        return total

    def close(self, kill: bool = False) -> None:
        """Stop the lanes; `kill`: now, whatever they are generating (a stop, a cancelled round)."""
        if kill:
            for proc in self._processes().values():
                proc.kill()
        self.pool.shutdown(wait=True, cancel_futures=True)


def lane_shares(lengths: Sequence[int], lanes: int, steps: int, cost: GenerationCost | None = None) -> list[list[int]]:
    """The rows (indices into `lengths`) each lane generates, longest prompts first, each to the lane with the least
    work so far (a row's work: its prefill and its attention over its prompt, `cost` without the per-step fixed cost
    every lane pays anyway); each share's rows in their original order, empty shares dropped."""
    cost = cost or GenerationCost()
    load = [0.0] * lanes
    shares: list[list[int]] = [[] for _ in range(lanes)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        lane = min(range(lanes), key=lambda k: (load[k], len(shares[k])))
        shares[lane].append(i)
        load[lane] += cost.batch(1, lengths[i], steps) - steps * cost.step_s
    return [sorted(s) for s in shares if s]
