"""The local backend's lanes: worker processes that generate beside this one (`local_lanes.py`).

Two lanes answer every prompt exactly as one lane does (a prompt samples from its own seed); a stopped round kills
what the lanes were generating; a lane process dies with its parent, so a `kill -9` of the run leaves none behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from support import alive

from eagle3_assets.common.registry import DATASETS
from eagle3_assets.stages.completions.run import build_requests, completions_frame, run_completions
from eagle3_assets.stages.raw_prompts.prompts import prompts_frame, read_prompts
from eagle3_resources.completions.local import TransformersBackend
from eagle3_resources.completions.local_generate import Decoding, prompt_seed
from eagle3_resources.completions.local_lanes import LaneModel, lane_shares
from eagle3_resources.completions.types import CompletionRequest, SamplingSettings
from eagle3_resources.tokenizer.chat_format import TemplateVersion

B8_PILOT = [269, 4435, 1205, 198, 1756, 232, 1011, 1280]  # the first command's B8 pilot, prompt tokens


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_lane_shares_deal_every_row_once_by_its_work():
    shares = lane_shares(B8_PILOT, 2, 160)
    assert sorted(i for s in shares for i in s) == list(range(8))
    assert 1 in shares[0] and len(shares[0]) < len(shares[1])  # the 4,435-token prompt's lane takes fewer rows
    assert lane_shares([100] * 8, 2, 160) == [[0, 2, 4, 6], [1, 3, 5, 7]]  # equal work: equal shares
    assert lane_shares([100] * 8, 1, 160) == [list(range(8))]
    assert lane_shares([100], 3, 160) == [[0]]  # no empty share


def test_a_prompts_seed_is_its_own():
    assert prompt_seed(0, "A1-0001") == prompt_seed(0, "A1-0001")
    assert len({prompt_seed(0, f"A1-{i:04d}") for i in range(1000)}) == 1000
    assert prompt_seed(1, "A1-0001") != prompt_seed(0, "A1-0001")
    assert 0 <= prompt_seed(None, "x") < 2**63


@pytest.mark.slow
def test_two_lanes_answer_every_prompt_as_one_lane_does(tok, target_model, tmp_path, ledger):
    df = prompts_frame(read_prompts(DATASETS["B3"]), "B3").head(10)
    reqs = build_requests(df, tok, TemplateVersion.K2_5, True)
    settings = SamplingSettings(max_tokens=24, seed=3)
    assert LaneModel.of(target_model) is not None
    answers = {}
    for lanes in (1, 2):
        backend = TransformersBackend(target_model, tok, batch_size=3, lanes=lanes)
        journal = tmp_path / f"journal-{lanes}.jsonl"
        try:
            run = run_completions("B3", reqs, backend, settings, journal, ledger=ledger, log=print)
            workers = list((backend.processes.pool._processes or {}).keys()) if backend.processes else []
        finally:
            backend.close()
        assert run.sent == 10 and sum(run.results.values()) == 10
        assert len(workers) == lanes - 1  # two lanes: one process beside this one
        frame = completions_frame("B3", reqs, journal, df)
        answers[lanes] = dict(zip(frame["prompt_id"], frame["completion_ids"].to_list(), strict=True))
        assert wait_gone(workers, 10) == []  # closed with the backend
    assert answers[1] == answers[2]
    assert len({tuple(ids) for ids in answers[1].values()}) > 1


@pytest.mark.slow
def test_a_cancelled_round_kills_what_the_lanes_generate(tok, target_model):
    backend = TransformersBackend(target_model, tok, lanes=2)
    # Lane 0 is this process's thread, which no one can stop: asyncio.run would wait out its 4,000 tokens (80 s).
    # It answers at once here; the lane process is what the test stops.
    backend._generate_here = lambda prompts, decoding, seeds, single: [[] for _ in prompts]  # type: ignore[method-assign]
    batch = [CompletionRequest(f"p{i}", [], None, list(range(1000, 1000 + 200 + i))) for i in range(4)]
    decoding = Decoding(max_tokens=4000, temperature=0.0, top_p=None, top_k=None, pad=0, stops=())

    async def cancel_midway() -> list[int]:
        task = asyncio.create_task(backend._generate(batch, decoding, 0, 2))
        while backend.processes is None or not backend.processes.pool._processes:
            await asyncio.sleep(0.05)
        pids = list(backend.processes.pool._processes)
        await asyncio.sleep(8)  # the lane has loaded the model and is generating its 4,000 tokens
        assert task.done() is False
        cancelled = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - cancelled < 10  # killed, not waited out (its 4,000 tokens take a minute or more)
        return pids

    pids = asyncio.run(cancel_midway())
    assert backend.processes is None
    assert wait_gone(pids, 10) == []


LANES_SCRIPT = """
import asyncio
import sys

from transformers import AutoModelForCausalLM

from eagle3_resources.completions.local import TransformersBackend
from eagle3_resources.completions.local_generate import Decoding
from eagle3_resources.completions.types import CompletionRequest


def decoding(max_tokens):
    return Decoding(max_tokens=max_tokens, temperature=0.0, top_p=None, top_k=None, pad=0, stops=())


async def main(folder, moment):
    backend = TransformersBackend(AutoModelForCausalLM.from_pretrained(folder).eval(), None, lanes=3)
    batch = [CompletionRequest(f"p{i}", [], None, list(range(1000, 1200))) for i in range(6)]
    if moment == "generating":  # a first round proves both lanes loaded the model
        await backend._generate(batch, decoding(2), 0, 3)
    task = asyncio.create_task(backend._generate(batch, decoding(6000), 0, 3))
    while backend.processes is None or len(backend.processes.pool._processes) < 2:
        await asyncio.sleep(0.01)
    if moment == "generating":
        await asyncio.sleep(1.0)
    print(" ".join(map(str, backend.processes.pool._processes)), flush=True)
    await task


if __name__ == "__main__":  # spawn imports this script again in each lane, as __mp_main__
    asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["starting", "generating"])
def test_kill_9_of_the_run_leaves_no_lane_process(target_model, tmp_path, moment):
    """Killed while its lanes start (before they could ask to die with it) and while they generate."""
    script = tmp_path / "lanes.py"
    script.write_text(LANES_SCRIPT)
    lane_model = LaneModel.of(target_model)
    assert lane_model is not None
    proc = subprocess.Popen(
        [sys.executable, str(script), lane_model.folder, moment],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # A generating lane dies with its parent (PR_SET_PDEATHSIG); a starting one still imports this script and
        # torch (spawn) before it can ask, then finds its parent gone and exits: its imports took over 10 s on a
        # loaded 2-core machine (a full-suite run), so it gets longer; it must still go by itself.
        assert wait_gone(pids, 10 if moment == "generating" else 90) == []
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
