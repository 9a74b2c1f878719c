"""The machine a benchmark ran on, described the same way by every benchmark.

A 2-core VM shared with other work is noisy: the other processes on the cores, and the other
guests of the VM's host (CPU steal time), slow every run. A benchmark records `describe()`
when it starts and `at_end(start)` when it is done, so a reader can tell a quiet run from a
contended one. The copy bandwidth is the memory-bound floor of a decode step (the native
engine's roofline); it varies from hour to hour on a VM, so it is timed in the same run.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def describe() -> dict:
    """CPU model, cores, memory, load average, the processes using a fifth of a core or more
    (sampled over one second), and the CPU time counters `at_end` measures steal time from."""
    import psutil

    procs = list(psutil.process_iter(["pid", "name", "cpu_percent", "nice", "cmdline"]))  # asking starts the interval
    time.sleep(1.0)
    busy = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
            if pct >= 20:
                busy.append(f"{pct:.0f}% nice {p.info['nice']} {' '.join(p.info['cmdline'] or [p.info['name']])[:120]}")
        except Exception:  # noqa: BLE001 - processes come and go
            continue
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "loadavg_1_5_15": os.getloadavg(), "busy_processes": busy,
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "cpu_times": cpu_times()}


def at_end(start: dict) -> dict:
    """What changed since `start` (a describe()): load, busy processes, the share of CPU time stolen."""
    end = describe()
    return {"loadavg_at_end": end["loadavg_1_5_15"], "busy_processes_at_end": end["busy_processes"],
            "cpu_steal_fraction": steal_fraction(start["cpu_times"], end["cpu_times"])}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def cpu_times() -> list[int]:
    """The machine's cumulative CPU time counters (/proc/stat's `cpu` line; [] where absent)."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return []


def steal_fraction(start: list[int], end: list[int]) -> float | None:
    """Share of CPU time the hypervisor gave to other guests between two cpu_times() (field 8:
    steal). A shared cloud VM's neighbours slow every run; this says how much."""
    if len(start) < 8 or len(end) < 8:
        return None
    delta = [b - a for a, b in zip(start, end)]
    return delta[7] / sum(delta) if sum(delta) else None


def memory_bandwidth_gbs(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Best-of copy bandwidth (read + write bytes per second) of a large float32 tensor."""
    import torch  # here, not at the top: describing the machine must not need torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), repeats) / 1e9


def read_bandwidth_gbs(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Best-of read bandwidth (bytes read per second): a sum over a large float32 tensor. A
    decode step mostly reads weights, so this is its floor; a copy also writes."""
    import torch

    src = torch.ones(nbytes // 4)
    return nbytes / _best_seconds(src.sum, repeats) / 1e9


def bandwidth_beside(run):
    """`run()`, its result (a dict) given the copy and read bandwidth (GB/s) timed just before
    and just after it: on one AMD EPYC VM the copy bandwidth moved from 23.5 to 35.7 GB/s
    between hours of one day, so a run's roofline fraction needs the bandwidth of its own
    minutes, not the one timed when the benchmark started."""
    before = memory_bandwidth_gbs(), read_bandwidth_gbs()
    result = run()
    after = memory_bandwidth_gbs(), read_bandwidth_gbs()
    result["copy_bandwidth_gbs"] = (before[0] + after[0]) / 2
    result["read_bandwidth_gbs"] = (before[1] + after[1]) / 2
    result["copy_bandwidth_before_after_gbs"] = [before[0], after[0]]
    return result


def _best_seconds(run, repeats: int) -> float:
    """Shortest of `repeats` timed calls of `run`, after one untimed call (seconds)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best
