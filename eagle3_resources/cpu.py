"""How many CPU threads torch may use: the CPUs actually free, decided at the start of each stage.

torch starts as many intra-op threads as the machine has cores. Every parallel op then waits for
its slowest thread, so when other processes keep those cores busy each op waits for a thread the
kernel has descheduled (and OpenMP's waiting threads spin, taking CPU from the one still working):
on a shared 2-core machine (load 7-10) the stand-in target's fit ran 40 times slower than idle.
`benchmarks/cpu_threads_under_load.py` (the fit's own code, stand-in config) on a 2-core machine
whose 2 CPUs other processes kept busy: 8.5 s a step with torch's default 2 threads, 1.1 s with 1
(7.7x); with 6 more busy loops, 50.5 s against 6.0 s (8.5x); idle, 0.27 s with 2 threads against
0.40 s with 1; beside one loop busy 30% of the time, 0.44 s against 0.43 s (the gain is gone);
that loop on a busy machine, 13-20 s against 0.6 s. A thread too few costs at most the parallel
gain (1.45x idle), a thread too many 7-20x, hence the rule:

    usable  = CPUs in this process's affinity mask, capped by the cgroup CPU quota (rounded up:
              a quota throttles all threads together, so it causes no stragglers)
    free    = affinity CPUs - CPUs kept busy by other processes (a short /proc/stat sample over
              the affinity CPUs, this process's own CPU time taken out, niced processes not
              counted; without /proc/stat the 1-minute load average)
    threads = clamp(floor(free + 0.25), 1, usable): a thread per CPU at least 3/4 free
              (free and usable divided first among torchrun's LOCAL_WORLD_SIZE processes)

`EAGLE3_TORCH_THREADS=N` (a positive integer) overrides it; `auto` or unset keeps the rule.

Work that runs in rounds (the local completions backend's batches) chooses again before each round from the load seen
since the last one (`LoadWatch`, no waiting): a count chosen while idle and kept while other work arrives made a
partition's batches take 88 s instead of 7 on the shared 2-core machine.

torch's thread count belongs to the thread that sets it (OpenMP keeps it per thread, and a thread
that has already run a parallel op keeps its count when another thread changes it), so
`apply_torch_threads` sets it in the calling thread and `use_torch_threads` repeats the choice in
a worker thread (the local completions backend generates in `asyncio.to_thread`'s pool).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ENV = "EAGLE3_TORCH_THREADS"
SAMPLE_S = 0.5  # how long /proc/stat is watched before a stage starts
# A CPU counts for a thread when at least 3/4 of it is free: a thread too many costs far more
# (7-20x slower, measured) than a thread too few (the parallel gain: 1.45x on an idle 2-core box).
FREE_ENOUGH = 0.25

_lock = threading.Lock()
_chosen: int | None = None  # the last count applied in this process
_interop_done = False


@dataclass(frozen=True)
class CpuPicture:
    """What the rule looks at: all inputs of `choose_threads`, measured or faked."""

    affinity: int  # CPUs this process may run on
    quota: float | None  # cgroup CPU quota in CPUs (None: no quota)
    others_busy: float | None  # CPUs kept busy by other processes (None: not measured)
    how: str = "/proc/stat"  # where others_busy came from
    processes: int = 1  # processes of this job sharing these CPUs (torchrun's LOCAL_WORLD_SIZE)


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str


def parse_override(raw: str | None) -> int | None:
    """`EAGLE3_TORCH_THREADS`: a positive integer, or unset / empty / `auto` for the automatic rule."""
    if raw is None or raw.strip() == "" or raw.strip().lower() == "auto":
        return None
    try:
        n = int(raw.strip())
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"{ENV}={raw!r} is not valid: give a positive integer number of torch CPU threads, "
            "or `auto` (or leave it unset) for the count chosen from the free CPUs"
        )
    return n


def choose_threads(picture: CpuPicture, override: str | None = None) -> ThreadChoice:
    """The rule, as a pure function of what was measured and `EAGLE3_TORCH_THREADS`'s raw value."""
    usable = max(1, picture.affinity)
    where = f"{picture.affinity} CPU{'s' if picture.affinity != 1 else ''}"
    if picture.quota is not None:
        usable = max(1, min(usable, math.ceil(picture.quota - 1e-9)))
        where += f", cgroup quota {picture.quota:g}"
    n = parse_override(override)
    if n is not None:
        return ThreadChoice(n, f"{ENV}={n}; {where}")
    free = float(picture.affinity)
    if picture.others_busy is None:
        load = "load of other processes unknown"
    else:
        free -= picture.others_busy
        load = f"{picture.others_busy:.1f} busy with other processes ({picture.how})"
    shared = ""
    if picture.processes > 1:  # torchrun's processes start together: none sees the others' load yet
        free /= picture.processes
        usable = max(1, usable // picture.processes)
        shared = f", shared by {picture.processes} processes (LOCAL_WORLD_SIZE)"
    threads = max(1, min(usable, math.floor(free + FREE_ENOUGH)))
    return ThreadChoice(threads, f"{where}, {load}{shared}; {ENV} unset")


# --- measuring -----------------------------------------------------------------------------


def affinity_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _quota_of(cgroup_dir: Path) -> float | None:
    try:  # cgroup v2: "max 100000" or "200000 100000"
        quota, period = (cgroup_dir / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int((cgroup_dir / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup_dir / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def cgroup_quota(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup and its parents; None without one."""
    dirs: list[Path] = []
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2 unified
                bases = [root, root / "unified"]
            elif "cpu" in controllers.split(","):
                bases = [root / "cpu", root / controllers]
            else:
                continue
            rel = Path(path.lstrip("/"))
            for base in bases:
                for p in [rel, *rel.parents]:
                    dirs.append(base / p)
    except (OSError, ValueError):
        pass
    dirs += [root, root / "cpu"]
    quotas = [q for q in (_quota_of(d) for d in dict.fromkeys(dirs)) if q is not None]
    return min(quotas) if quotas else None


def _proc_stat(cpus: Sequence[int], count_nice: bool, stat: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(busy, total) jiffies summed over `cpus`; None when /proc/stat does not list them."""
    wanted = {f"cpu{c}" for c in cpus}
    busy = total = 0
    seen = 0
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, rest = line.partition(" ")
        if name not in wanted:
            continue
        f = [int(x) for x in rest.split()[:8]] + [0] * 8
        user, nice, system, idle, iowait, irq, softirq, steal = f[:8]
        # Niced processes yield to this one (weight 15 against 1024 at nice 19): not counted unless
        # this process is niced itself. Steal is time the hypervisor gave to someone else.
        b = user + system + irq + softirq + steal + (nice if count_nice else 0)
        busy += b
        total += user + nice + system + idle + iowait + irq + softirq + steal
        seen += 1
    return (busy, total) if seen else None


def others_busy(cpus: Sequence[int], sample_s: float = SAMPLE_S) -> tuple[float | None, str]:
    """CPUs (of `cpus`) kept busy by other processes over a `sample_s` look, and how it was measured."""
    try:
        count_nice = os.nice(0) > 0
    except OSError:
        count_nice = True
    before = _proc_stat(cpus, count_nice)
    if before is not None:
        own0, wall0 = time.process_time(), time.monotonic()
        time.sleep(sample_s)
        after = _proc_stat(cpus, count_nice)
        own = (time.process_time() - own0) / max(1e-6, time.monotonic() - wall0)
        if after is not None and after[1] > before[1]:
            busy = (after[0] - before[0]) / (after[1] - before[1]) * len(cpus)
            return max(0.0, busy - own), f"/proc/stat, {sample_s:g} s"
    try:
        return max(0.0, os.getloadavg()[0]), "1-min load average"
    except (AttributeError, OSError):
        return None, "unmeasured"


def local_processes() -> int:
    """This job's processes on this machine: torchrun's LOCAL_WORLD_SIZE, else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def measure(sample_s: float = SAMPLE_S) -> CpuPicture:
    cpus = affinity_cpus()
    busy, how = others_busy(cpus, sample_s)
    return CpuPicture(affinity=len(cpus), quota=cgroup_quota(), others_busy=busy, how=how, processes=local_processes())


def decide(sample_s: float = SAMPLE_S) -> ThreadChoice:
    """The count for now; no sampling when `EAGLE3_TORCH_THREADS` is set (a bad value raises here)."""
    override = os.environ.get(ENV)
    if parse_override(override) is not None:
        cpus = affinity_cpus()
        return choose_threads(CpuPicture(len(cpus), cgroup_quota(), None, "not measured"), override)
    return choose_threads(measure(sample_s), override)


# --- applying ------------------------------------------------------------------------------


def apply_torch_threads(stage: str, log: Callable[[str], None] = print, sample_s: float = SAMPLE_S) -> int:
    """Decide torch's CPU thread count now (the load changes between stages), set it in this thread
    and log the choice; inter-op threads are set once per process, while torch still allows it."""
    return set_torch_threads(decide(sample_s), stage, log)


def set_torch_threads(choice: ThreadChoice, stage: str, log: Callable[[str], None] = print) -> int:
    """Apply a choice in this thread (and inter-op threads once per process, while torch allows it) and log it."""
    global _chosen, _interop_done
    import torch

    with _lock:
        torch.set_num_threads(choice.threads)
        _chosen = choice.threads
        interop = ""
        if not _interop_done:
            _interop_done = True
            try:
                torch.set_num_interop_threads(choice.threads)
            except RuntimeError:  # inter-op work already started (or set elsewhere): torch refuses
                interop = f"; inter-op threads stay {torch.get_num_interop_threads()}"
    log(f"torch threads for {stage}: {choice.threads} ({choice.reason}{interop})")
    return choice.threads


class LoadWatch:
    """CPUs kept busy by other processes since the last look, without waiting: the interval between two looks is
    the sample (`others_busy`'s rule otherwise: this process's own CPU time taken out, niced processes not counted).
    """

    MIN_INTERVAL_S = 0.25  # shorter looks are noise at /proc/stat's 10 ms resolution: the interval goes on

    def __init__(self, helpers_cpu_s: Callable[[], float] | None = None) -> None:
        """`helpers_cpu_s`: the CPU seconds so far of this job's own helper processes (the local backend's lanes),
        counted with this process's own time rather than as other work."""
        self.helpers_cpu_s = helpers_cpu_s or (lambda: 0.0)
        self.cpus = affinity_cpus()
        try:
            self.count_nice = os.nice(0) > 0
        except OSError:
            self.count_nice = True
        self.quota = cgroup_quota()
        self.mark = self._now()

    def _now(self) -> tuple[tuple[int, int] | None, float, float]:
        return _proc_stat(self.cpus, self.count_nice), time.process_time() + self.helpers_cpu_s(), time.monotonic()

    def others_busy(self) -> float | None:
        """Since the last look (None: too soon to tell, or no /proc/stat)."""
        (stat0, own0, wall0), now = self.mark, self._now()
        if now[2] - wall0 < self.MIN_INTERVAL_S:
            return None
        self.mark = now
        if stat0 is None or now[0] is None or now[0][1] <= stat0[1]:
            return None
        busy = (now[0][0] - stat0[0]) / (now[0][1] - stat0[1]) * len(self.cpus)
        own = (now[1] - own0) / max(1e-6, now[2] - wall0)
        return max(0.0, busy - own)


def choose_since(watch: LoadWatch) -> ThreadChoice | None:
    """The count for the load since `watch`'s last look, without waiting (None: too soon to tell, unmeasured, or
    `EAGLE3_TORCH_THREADS` set: `decide` then)."""
    if parse_override(os.environ.get(ENV)) is not None:
        return None
    busy = watch.others_busy()
    if busy is None:
        return None
    return choose_threads(CpuPicture(len(watch.cpus), watch.quota, busy, "since the last look", local_processes()))


def rechoose_torch_threads(watch: LoadWatch, stage: str, log: Callable[[str], None] = print) -> int:
    """In the thread about to run a round of work: the count for the load since `watch`'s last look, set (and
    logged) when it differs from this thread's; kept when the look is too short to tell or the count is fixed."""
    global _chosen
    import torch

    current = torch.get_num_threads()
    choice = choose_since(watch)
    if choice is None:
        return current
    if choice.threads != current:
        torch.set_num_threads(choice.threads)
        with _lock:
            _chosen = choice.threads
        log(f"torch threads for {stage}: {current} -> {choice.threads} ({choice.reason})")
    return choice.threads


def use_torch_threads() -> int:
    """In a worker thread: the count `apply_torch_threads` last chose (decided now if it never ran)."""
    global _chosen
    import torch

    with _lock:
        if _chosen is None:
            _chosen = decide().threads
        n = _chosen
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
