"""The CPU thread count: the rule on fake core counts and loads, the cores a process may
use, the /proc/stat reading, and the runner following the count (no wall clock: a fake
clock and fake counters drive every case)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inlinelm.gpu.cpu_threads import (
    CpuThreads,
    CpuTimes,
    busy_seconds,
    cgroup_quota_cores,
    threads_for_idle_cores,
    usable_cores,
)
from inlinelm.gpu.model_runner import ModelRunner


@pytest.mark.parametrize(
    ("idle", "max_threads", "expected"),
    [
        (2.0, 2, 2),  # an idle 2-core machine: both
        (1.6, 2, 2),  # light background work
        (1.4, 2, 1),  # a busy process on one of two cores: one thread, no spinning team
        (1.0, 2, 1),
        (0.1, 2, 1),  # every core busy elsewhere: still one
        (-0.5, 2, 1),
        (15.0, 16, 15),  # one busy core of sixteen
        (12.5, 16, 13),
        (40.0, 8, 8),  # a quota of 8 on an idle 64-core host
    ],
)
def test_threads_are_the_idle_cores_rounded_between_one_and_the_usable_cores(
    idle: float, max_threads: int, expected: int
) -> None:
    assert threads_for_idle_cores(idle, max_threads) == expected


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("max 100000\n", 16),
        ("200000 100000\n", 2),
        ("150000 100000", 2),  # 1.5 cores of quota: 2 threads may run
        ("50000 100000", 1),
        ("", 16),
        ("garbage", 16),
    ],
)
def test_usable_cores_are_the_affinity_capped_by_a_cgroup_quota(
    cpu_max: str, expected: int
) -> None:
    assert usable_cores(affinity=range(16), cpu_max=cpu_max) == expected


def test_a_quota_text_that_is_not_one_is_no_quota() -> None:
    assert cgroup_quota_cores("max 100000") is None
    assert cgroup_quota_cores("100000 0") is None
    assert cgroup_quota_cores("400000 100000") == 4


PROC_STAT = """\
cpu  9000 0 900 90000 0 0 0 0 0 0
cpu0 100 10 20 5000 7 1 2 3 50 0
cpu1 200 0 30 5000 9 0 0 0 0 0
cpu2 999 0 0 5000 0 0 0 0 0 0
intr 1 2 3
"""


def test_busy_time_counts_the_watched_cpus_busy_columns() -> None:
    # user, nice, system, irq, softirq, steal: idle, iowait and guest (in user) are not busy
    assert busy_seconds(PROC_STAT, [0, 1], 100) == pytest.approx((136 + 230) / 100)
    assert busy_seconds(PROC_STAT, [2], 100) == pytest.approx(9.99)
    assert busy_seconds(PROC_STAT, [7], 100) is None


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="reads Linux's /proc/stat")
def test_the_default_reader_reads_this_machine() -> None:
    threads = CpuThreads(None)
    assert threads._last is not None and threads._last.busy_s > 0
    assert 1 <= threads.current() <= threads.max_threads


class FakeMachine:
    """Counters a test advances: ``run(seconds, others=cores, own=cores)``."""

    def __init__(self) -> None:
        self.now = CpuTimes(0.0, 0.0, 0.0)
        self.reads = 0

    def run(self, seconds: float, *, others: float, own: float) -> None:
        n = self.now
        self.now = CpuTimes(
            n.wall_s + seconds, n.busy_s + (others + own) * seconds, n.own_s + own * seconds
        )

    def read(self) -> CpuTimes | None:
        self.reads += 1
        return self.now

    def clock(self) -> float:
        return self.now.wall_s


def _threads(machine: FakeMachine, fixed: int | None = None) -> CpuThreads:
    return CpuThreads(
        fixed,
        cpus=[0, 1],
        max_threads=2,
        read=machine.read,
        clock=machine.clock,
        interval_s=1.0,
    )


def test_the_count_follows_the_load_other_processes_put_on_the_cores(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="inlinelm.gpu.cpu_threads")
    machine = FakeMachine()
    threads = _threads(machine)
    assert threads.current() == 2 and machine.reads == 1  # before a whole interval: every core
    machine.run(0.5, others=0.0, own=2.0)
    assert threads.current() == 2 and machine.reads == 1  # no read within the interval
    machine.run(0.5, others=0.1, own=1.9)
    assert threads.current() == 2
    machine.run(1.0, others=0.7, own=1.3)  # a burner on one core, our spinning team on both
    assert threads.current() == 1
    machine.run(1.0, others=1.0, own=1.0)  # it gets its core once we leave it
    assert threads.current() == 1
    machine.run(1.0, others=0.0, own=1.0)  # the burner stopped
    assert threads.current() == 2
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [
        "CPU threads: 2 of 2 cores (other processes kept 0.1 of 2 busy; re-checked every 1 s; "
        "num_threads= fixes the count)"
    ]


def test_a_fixed_count_is_kept_and_nothing_is_read() -> None:
    machine = FakeMachine()
    threads = _threads(machine, fixed=3)
    machine.run(5.0, others=2.0, own=0.0)
    assert threads.current() == 3 and machine.reads == 0


def test_unknown_counters_keep_every_usable_core() -> None:
    threads = CpuThreads(None, cpus=[0, 1], max_threads=2, read=lambda: None, clock=lambda: 99.0)
    assert threads.current() == 2


@pytest.fixture
def torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("torch_threads")
def test_the_runner_runs_its_steps_with_the_count(tiny_model_dir: Path) -> None:
    from inlinelm.config import EngineConfig

    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), max_num_seqs=2), tiny_model_dir)
    try:
        assert runner.cpu_threads is not None and runner.cpu_threads.fixed is None
        machine = FakeMachine()
        runner.cpu_threads = _threads(machine)
        machine.run(1.0, others=1.5, own=0.5)
        runner._set_threads()
        assert torch.get_num_threads() == 1
        machine.run(1.0, others=0.0, own=2.0)
        runner._set_threads()
        assert torch.get_num_threads() == 2
    finally:
        runner.close()
