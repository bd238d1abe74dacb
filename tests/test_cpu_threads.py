"""torch's CPU thread count from the CPUs actually free (eagle3_resources.cpu)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from eagle3_resources import cpu
from eagle3_resources.cpu import CpuPicture, choose_threads, parse_override

ROOT = Path(__file__).resolve().parents[1]


# --- the rule, on faked inputs -------------------------------------------------------------------


@pytest.mark.parametrize(
    "affinity, quota, busy, expected",
    [
        (2, None, 0.0, 2),  # idle 2-core box: both cores
        (2, None, 0.2, 2),  # a little background: still 2
        (2, None, 0.3, 1),  # more than a quarter of a core taken: 1
        (2, None, 1.0, 1),
        (2, None, 7.9, 1),  # the loaded box of the finding (busy is capped by the CPUs in practice)
        (2, None, 2.0, 1),  # never below 1
        (16, None, 0.0, 16),
        (16, None, 5.2, 11),
        (16, None, 5.3, 10),
        (16, 4.0, 0.0, 4),  # the cgroup quota caps it...
        (16, 2.5, 0.0, 3),  # ...rounded up (it throttles all threads at once: no stragglers)
        (16, 2.5, 1.0, 3),  # the load is on the host's 16 CPUs, not on the quota
        (16, 2.5, 14.0, 2),
        (16, 0.5, 0.0, 1),
        (1, None, 0.0, 1),
        (4, None, None, 4),  # load unknown: all usable CPUs
    ],
)
def test_rule(affinity, quota, busy, expected):
    choice = choose_threads(CpuPicture(affinity, quota, busy))
    assert choice.threads == expected
    assert f"{affinity} CPU" in choice.reason and "EAGLE3_TORCH_THREADS unset" in choice.reason


@pytest.mark.parametrize(
    "affinity, busy, processes, expected", [(16, 0.0, 4, 4), (16, 4.0, 4, 3), (16, 0.0, 3, 5), (2, 0.0, 4, 1)]
)
def test_torchrun_processes_share_the_cpus(affinity, busy, processes, expected):
    choice = choose_threads(CpuPicture(affinity, None, busy, processes=processes))
    assert choice.threads == expected and f"shared by {processes} processes" in choice.reason


def test_reason_says_what_it_saw():
    choice = choose_threads(CpuPicture(2, None, 1.94, "/proc/stat, 0.5 s"))
    assert choice.reason == "2 CPUs, 1.9 busy with other processes (/proc/stat, 0.5 s); EAGLE3_TORCH_THREADS unset"
    assert "cgroup quota 1.5" in choose_threads(CpuPicture(8, 1.5, 0.0)).reason


@pytest.mark.parametrize(
    "raw, expected", [(None, None), ("", None), ("auto", None), (" AUTO ", None), ("1", 1), (" 12 ", 12)]
)
def test_override_values(raw, expected):
    assert parse_override(raw) == expected


def test_override_wins_over_the_rule():
    choice = choose_threads(CpuPicture(2, None, 2.0), "3")
    assert choice.threads == 3 and choice.reason.startswith("EAGLE3_TORCH_THREADS=3")
    assert choose_threads(CpuPicture(2, None, 2.0), "auto").threads == 1


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5", "4 threads"])
def test_bad_override_is_a_clear_error(bad, monkeypatch):
    with pytest.raises(ValueError, match=r"EAGLE3_TORCH_THREADS=.* is not valid: give a positive integer"):
        parse_override(bad)
    monkeypatch.setenv(cpu.ENV, bad)
    with pytest.raises(ValueError, match="EAGLE3_TORCH_THREADS"):
        cpu.decide()


# --- the measurements, on faked files ------------------------------------------------------------


def test_cgroup_v2_quota_tightest_of_the_path(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "a" / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "a" / "b" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert cpu.cgroup_quota(tmp_path, proc) == 3.0
    proc.write_text("0::/\n")
    assert cpu.cgroup_quota(tmp_path, proc) is None


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu" / "job").mkdir(parents=True)
    (tmp_path / "cpu" / "job" / "cpu.cfs_quota_us").write_text("150000\n")
    (tmp_path / "cpu" / "job" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/job\n1:cpu,cpuacct:/job\n0::/\n")
    assert cpu.cgroup_quota(tmp_path, proc) == 1.5


def test_proc_stat_counts_only_our_cpus_and_not_nice_time(tmp_path):
    stat = tmp_path / "stat"
    #                user nice system idle iowait irq softirq steal
    stat.write_text(
        "cpu  300 100 30 900 0 0 0 0 0 0\n"
        "cpu0 100 50 10 300 0 0 0 0 0 0\n"
        "cpu1 100 50 10 300 0 0 0 5 0 0\n"
        "cpu2 100 0 10 300 0 0 0 0 0 0\n"
    )
    assert cpu._proc_stat([0, 1], count_nice=False, stat=stat) == (225, 925)
    assert cpu._proc_stat([0, 1], count_nice=True, stat=stat) == (325, 925)
    assert cpu._proc_stat([7], count_nice=False, stat=stat) is None


# --- for real: a process under an artificial load ------------------------------------------------

PROBE = """
import json
import torch
from eagle3_resources import cpu
lines = []
n = cpu.apply_torch_threads("probe", lines.append, sample_s=1.0)
print(json.dumps({"threads": n, "torch": torch.get_num_threads(), "log": lines}))
"""


def probe(env: dict[str, str] | None = None) -> dict:
    env = {
        **{k: v for k, v in os.environ.items() if k not in (cpu.ENV, "LOCAL_WORLD_SIZE")},
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_override_applies_in_a_real_process():
    got = probe({cpu.ENV: "3"})
    assert got["threads"] == got["torch"] == 3
    assert got["log"] == [
        f"torch threads for probe: 3 (EAGLE3_TORCH_THREADS=3; {len(cpu.affinity_cpus())} CPUs"
        + got["log"][0].split("CPUs", 1)[1]
    ]


def test_bad_override_fails_a_real_process():
    env = {**os.environ, "PYTHONPATH": str(ROOT), cpu.ENV: "many"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0
    assert "EAGLE3_TORCH_THREADS='many' is not valid" in out.stderr


@contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """`n` Python processes spinning, started (each says when it spins: on a loaded machine an interpreter takes
    longer than any fixed wait to start) and killed with their process group."""
    busy = [sys.executable, "-c", "import sys; sys.stdout.write('x'); sys.stdout.flush()\nwhile True: pass"]
    first = subprocess.Popen(busy, process_group=0, stdout=subprocess.PIPE)  # a process group of its own
    try:
        loops = [first] + [
            subprocess.Popen(busy, process_group=first.pid, stdout=subprocess.PIPE) for _ in range(n - 1)
        ]
        for loop in loops:
            assert loop.stdout is not None
            assert loop.stdout.read(1) == b"x"
        yield
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        try:
            while os.waitpid(-first.pid, 0):
                pass
        except ChildProcessError:
            pass


@pytest.mark.slow
def test_a_loaded_machine_gets_fewer_threads_than_an_idle_one():
    cpus = cpu.affinity_cpus()
    if len(cpus) < 2:
        pytest.skip("one usable CPU: nothing fewer to choose")
    idle = choose_threads(CpuPicture(len(cpus), cpu.cgroup_quota(), 0.0)).threads
    with busy_loops(2 * len(cpus)):
        time.sleep(0.2)
        got = probe()
    # The busy loops (inheriting this process's affinity) fill every CPU the probe may use, so it takes one thread.
    # How busy it saw the CPUs is not this test's to say (other processes on a shared machine add to it, and the
    # probe's own share of the CPUs it competes for is taken out): only that the rule, applied to what it logged,
    # gives the count it chose.
    assert got["threads"] == got["torch"] == 1 < idle, got
    seen = re.search(r"(\d+\.\d) busy with other processes \(/proc/stat", got["log"][0])
    assert seen, got["log"]
    assert choose_threads(CpuPicture(len(cpus), cpu.cgroup_quota(), float(seen[1]))).threads == 1, got


def test_work_in_rounds_takes_fewer_threads_once_other_processes_fill_the_cpus():
    """`rechoose_torch_threads` between rounds: the load since the last look, without waiting for a sample."""
    import torch

    cpus = cpu.affinity_cpus()
    if len(cpus) < 2:
        pytest.skip("one usable CPU: nothing fewer to choose")
    before = torch.get_num_threads()
    logged: list[str] = []
    try:
        torch.set_num_threads(2)
        watch = cpu.LoadWatch()
        with busy_loops(2 * len(cpus)):
            watch.mark = watch._now()  # the interval starts with every CPU busy
            time.sleep(1.0)
            assert cpu.rechoose_torch_threads(watch, "rounds", logged.append) == torch.get_num_threads() == 1
        assert logged and logged[0].startswith("torch threads for rounds: 2 -> 1 ("), logged
        assert cpu.rechoose_torch_threads(watch, "rounds", logged.append) == 1  # a look too soon keeps the count
    finally:
        torch.set_num_threads(before)


def test_worker_threads_take_the_chosen_count():
    code = """
import json, threading
from concurrent.futures import ThreadPoolExecutor
import torch
from eagle3_resources import cpu
pool = ThreadPoolExecutor(1)
def work():
    a = torch.randn(256, 256); (a @ a).sum()  # this worker has now run a parallel op
    return torch.get_num_threads()
before = pool.submit(work).result()
cpu.apply_torch_threads("probe", lambda _: None)
stale = pool.submit(work).result()  # torch keeps the count per thread
fixed = pool.submit(lambda: (cpu.use_torch_threads(), work())[1]).result()
print(json.dumps([before, stale, fixed]))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), cpu.ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=True)
    before, stale, fixed = json.loads(out.stdout.strip().splitlines()[-1])
    assert fixed == 1
    assert stale == before  # why use_torch_threads exists
