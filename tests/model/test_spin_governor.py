"""kvflow/spin.py: holding an idle OpenMP team stops libgomp's workers spinning and ending it lets them spin again
(the mechanism, by the workers' CPU time); the governor throttles on CPU pressure at once, lets spinning resume only
after a calm spell, and stays throttled without a signal (the decisions, on a fake clock and pressure)."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvflow import spin, threads

SRC = str(Path(__file__).resolve().parents[2] / "src")

# A computing thread runs one small parallel region every 3 ms; the other threads' CPU time per region is what the
# team's worker spends spinning (GOMP_SPINCOUNT=100000: ~2.6 ms on the Zen 4 box; throttled to 100: ~15 us).
PROBE = r"""
import os, threading, time
import torch
from kvflow.spin import SpinGovernor

def others_cpu():
    me = threading.get_native_id()
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            try:
                total += int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0])
            except OSError:
                pass
    return total / 1e9

def per_region(n=100):
    x = torch.ones(1 << 17)
    x.add_(1)
    c0 = others_cpu()
    for _ in range(n):
        x.add_(1)
        time.sleep(0.003)
    return (others_cpu() - c0) / n

out = {}
def compute():
    torch.get_num_threads(); torch.set_num_threads(2)
    governor = SpinGovernor(len(os.sched_getaffinity(0)) + 1)
    out["free"] = per_region()
    governor.throttle()
    out["held"] = per_region()
    governor.release()
    out["after"] = per_region()
t = threading.Thread(target=compute); t.start(); t.join()
print(out["free"], out["held"], out["after"])
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not Path("/proc/self/task").is_dir(),
                    reason="needs two CPUs and /proc")
def test_a_held_team_stops_the_workers_spinning_and_its_end_lets_them_spin_again():
    env = {k: v for k, v in os.environ.items() if k not in threads.OMP_POLICY_VARS} | {
        "GOMP_SPINCOUNT": "100000", "PYTHONPATH": SRC}       # the caller's count: no governor of its own
    got = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True,
                         timeout=300)
    free, held, after = map(float, got.stdout.split())
    assert held * 5 < free and held * 5 < after, (free, held, after)


class Fake:
    def __init__(self):
        self.now, self.total = 0.0, 0.0

    def advance(self, seconds: float, share: float) -> None:
        self.now += seconds
        self.total += seconds * share


def _holders() -> int:
    return sum(t.name == spin.THROTTLE_THREAD and t.is_alive() for t in threading.enumerate())


def test_the_governor_throttles_on_pressure_at_once_and_spins_again_only_after_a_calm_spell():
    fake = Fake()
    g = spin.SpinGovernor(3, pressure=lambda: fake.total, clock=lambda: fake.now, threshold=0.1, calm_s=1.0)
    g.throttle()                                   # as start() begins
    base = _holders()
    g.sample()
    for _ in range(9):                             # 0.9 s calm: not yet
        fake.advance(0.1, 0.02)
        g.sample()
        assert not g.spinning
    for _ in range(3):                             # 1.0-1.2 s calm (the clock's float sums)
        fake.advance(0.1, 0.02)
        g.sample()
    assert g.spinning and _holders() == base - 1   # the held team's thread has ended
    fake.advance(0.1, 0.3)                         # someone waits for a CPU: throttled at the next sample
    g.sample()
    assert not g.spinning and _holders() == base
    fake.advance(0.1, 0.0)
    g.sample()
    fake.advance(0.1, 0.5)                         # pressure inside the calm spell starts it again
    g.sample()
    for _ in range(5):
        fake.advance(0.1, 0.0)
        g.sample()
    assert not g.spinning
    stats = g.stats()
    assert stats["switches"] == 3 and 0.0 < stats["spinning_share"] < 0.5
    g.close()
    assert g.spinning and _holders() == base - 1


def test_without_a_pressure_signal_the_governor_stays_throttled():
    clock = iter(range(100))
    g = spin.SpinGovernor(3, pressure=lambda: None, clock=lambda: float(next(clock)), calm_s=0.5)
    for _ in range(10):
        g.sample()
    assert not g.spinning
    g.close()


def test_a_psi_line_is_read_in_seconds_and_an_unreadable_one_is_none(tmp_path):
    path = tmp_path / "cpu"
    path.write_text("some avg10=1.00 avg60=0.50 avg300=0.10 total=2500000\nfull avg10=0.00 avg60=0.00 avg300=0.00 "
                    "total=0\n")
    assert spin.psi_some_seconds(str(path)) == 2.5
    path.write_text("garbage\n")
    assert spin.psi_some_seconds(str(path)) is None
    assert spin.psi_some_seconds(str(tmp_path / "missing")) is None


def test_no_governor_where_the_caller_chose_the_policy_or_one_thread_computes(monkeypatch):
    monkeypatch.setattr(spin, "_governor", None)
    monkeypatch.setattr(threads, "SPIN_GOVERNED", False)
    assert spin.govern(2) is None
    monkeypatch.setattr(threads, "SPIN_GOVERNED", True)
    assert spin.govern(1) is None
