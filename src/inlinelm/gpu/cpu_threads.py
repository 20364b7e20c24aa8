"""How many intra-op threads the model runs with on a CPU, and when that count changes.

torch runs a CPU forward on GNU OpenMP threads. Every op of a decode step (~150 of them
for the default model) splits its work over the team and ends at a barrier that waits for
the slowest thread, and a waiting thread spins on its core (libgomp's default wait policy)
rather than sleep. On cores that other processes also want, the scheduler takes a team
thread away mid-op, and its team-mates spin through their own time slices waiting for it:
a decode step of the default model on 2 cores, with other processes keeping them busy,
took ~1 s with 2 threads and ~0.15 s with one, the 2-thread process burning ~6x the CPU
time of the 1-thread one (benchmarks/threads.py). libgomp reads its wait policy
(``OMP_WAIT_POLICY``) once, when torch loads it, so a library cannot turn the spinning
off; it can choose the number of threads.

So unless ``num_threads`` fixes the count, :class:`CpuThreads` runs the model on the cores
that other processes leave idle: every ``interval_s`` it reads how busy this process's
cores were (``/proc/stat``), takes away this process's own CPU time, and gives the model
the rest, rounded, at least one thread (:func:`threads_for_idle_cores`). On an idle
machine that is every core; beside one busy process on 2 cores, one thread. The cores are
those this process may run on (its affinity), capped by a cgroup's CPU quota
(:func:`usable_cores`). Where ``/proc/stat`` cannot be read, every usable core is used.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
"""How often :class:`CpuThreads` re-reads how busy the cores are."""

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""The /proc/stat columns of a CPU's busy time: user, nice, system, irq, softirq, steal
(idle and iowait are the others; guest time is already counted in user)."""


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Cumulative counters at one moment, in seconds."""

    wall_s: float  # a monotonic clock
    busy_s: float  # busy time of the cores this process may use, every process counted
    own_s: float  # this process's CPU time (all its threads)


def threads_for_idle_cores(idle_cores: float, max_threads: int) -> int:
    """The rule: the cores other processes left idle, rounded half up, between 1 and
    ``max_threads`` (the usable cores). ``idle_cores`` is the watched cores less how many
    cores' worth of time other processes used on them."""
    return max(1, min(max_threads, math.floor(idle_cores + 0.5)))


def usable_cores(affinity: Collection[int] | None = None, cpu_max: str | None = None) -> int:
    """Cores this process may run on: its affinity, capped by a cgroup v2 CPU quota
    (``cpu.max``, rounded up). Both are read when not given."""
    cores = len(affinity if affinity is not None else affinity_cpus())
    text = cpu_max if cpu_max is not None else _read_text(Path("/sys/fs/cgroup/cpu.max"))
    quota = cgroup_quota_cores(text) if text else None
    return max(1, cores if quota is None else min(cores, quota))


def cgroup_quota_cores(cpu_max: str) -> int | None:
    """The cores a cgroup v2 ``cpu.max`` ("QUOTA PERIOD", or "max PERIOD") allows, rounded
    up; None without a quota or for text that is not one."""
    parts = cpu_max.split()
    if len(parts) != 2 or not parts[0].isdigit() or not parts[1].isdigit() or parts[1] == "0":
        return None
    return max(1, -(-int(parts[0]) // int(parts[1])))


def read_cpu_times(cpus: Collection[int]) -> CpuTimes | None:
    """The counters of ``cpus`` from ``/proc/stat`` and this process's CPU time; None where
    ``/proc/stat`` cannot be read (not Linux)."""
    text = _read_text(Path("/proc/stat"))
    if text is None:
        return None
    busy = busy_seconds(text, cpus, os.sysconf("SC_CLK_TCK"))
    if busy is None:
        return None
    return CpuTimes(time.monotonic(), busy, time.process_time())


def busy_seconds(proc_stat: str, cpus: Collection[int], ticks_per_s: int) -> float | None:
    """Busy seconds of ``cpus`` (every process) in ``/proc/stat`` text; None when it lists
    none of them."""
    wanted = {f"cpu{i}" for i in cpus}
    ticks, found = 0, False
    for line in proc_stat.splitlines():
        name, _, rest = line.partition(" ")
        if name not in wanted:
            continue
        values = rest.split()
        ticks += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
        found = True
    return ticks / ticks_per_s if found else None


class CpuThreads:
    """The model's thread count: ``fixed`` when given, else :func:`threads_for_idle_cores`
    over the last ``interval_s`` (see the module docstring). Engine thread only.

    ``cpus`` are the watched cores (this process's affinity), ``max_threads`` the usable
    ones (:func:`usable_cores`). ``read`` returns the counters (None: unknown); it is
    called at most once per ``interval_s`` of ``clock``.
    """

    def __init__(
        self,
        fixed: int | None,
        *,
        cpus: Collection[int] | None = None,
        max_threads: int | None = None,
        read: Callable[[], CpuTimes | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self.fixed = fixed
        self.cpus = sorted(cpus if cpus is not None else affinity_cpus())
        self.max_threads = max_threads if max_threads is not None else usable_cores()
        self.interval_s = interval_s
        self.num_threads = fixed if fixed is not None else self.max_threads
        self._read = read if read is not None else lambda: read_cpu_times(self.cpus)
        self._clock = clock
        self._last = None if fixed is not None else self._read()
        self._next_check = clock() + interval_s
        self._decided = False

    def current(self) -> int:
        """The count to run the next step with (re-decided once an interval has passed)."""
        if self._last is None or self._clock() < self._next_check:
            return self.num_threads
        now = self._read()
        self._next_check = self._clock() + self.interval_s
        if now is None or now.wall_s <= self._last.wall_s:
            return self.num_threads
        others = now.busy_s - self._last.busy_s - (now.own_s - self._last.own_s)
        self._decide(max(others / (now.wall_s - self._last.wall_s), 0.0))
        self._last = now
        return self.num_threads

    def _decide(self, busy_elsewhere: float) -> None:
        chosen = threads_for_idle_cores(len(self.cpus) - busy_elsewhere, self.max_threads)
        if not self._decided:
            self._decided = True
            logger.info(
                "CPU threads: %d of %d cores (other processes kept %.1f of %d busy; "
                "re-checked every %g s; num_threads= fixes the count)",
                chosen,
                self.max_threads,
                busy_elsewhere,
                len(self.cpus),
                self.interval_s,
            )
        elif chosen != self.num_threads:
            logger.debug(
                "CPU threads: %d -> %d (other processes kept %.1f of %d cores busy)",
                self.num_threads,
                chosen,
                busy_elsewhere,
                len(self.cpus),
            )
        self.num_threads = chosen


def affinity_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
