"""kvflow/spin.py: holding an idle OpenMP team stops libgomp's workers spinning and ending it lets them spin again
(the mechanism, by the workers' CPU time); the governor throttles when other processes use the cores (over a
window: a client's burst does not), lets spinning resume only after a calm spell, and stays throttled without a
signal (the decisions, on a fake clock and CPU time); the others' CPU time is read from /proc."""

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


def _step(g, fake, cores: float, periods: int = 1) -> None:
    for _ in range(periods):
        fake.advance(0.1, cores)
        g.sample()


def test_the_governor_throttles_when_others_use_the_cores_and_spins_again_only_after_a_calm_spell():
    fake = Fake()
    g = spin.SpinGovernor(3, others=lambda: fake.total, clock=lambda: fake.now, allowance=0.25, window_s=0.5,
                          calm_s=1.0)
    g.throttle()                                   # as start() begins
    base = _holders()
    g.sample()
    _step(g, fake, 0.05, 9)                        # a client's 0.05 of a core for 0.9 s: not yet
    assert not g.spinning
    _step(g, fake, 0.05, 3)                        # 1.0-1.2 s within the allowance (the clock's float sums)
    assert g.spinning and _holders() == base - 1   # the held team's thread has ended
    _step(g, fake, 1.0)                            # a 0.1 s burst: 0.24 of a core over the window, still spinning
    _step(g, fake, 0.05, 5)
    assert g.spinning
    _step(g, fake, 1.0, 2)                         # a busy neighbour: throttled within two samples
    assert not g.spinning and _holders() == base
    _step(g, fake, 0.7, 20)                        # its fair share beside the spinning team is still too much
    assert not g.spinning
    _step(g, fake, 0.0, 12)                        # gone: the window empties, then the calm spell
    assert not g.spinning
    _step(g, fake, 0.0, 3)
    assert g.spinning
    stats = g.stats()
    assert stats["switches"] == 4 and 0.1 < stats["spinning_share"] < 0.2      # ~0.8 of ~5.5 s
    g.close()
    assert g.spinning and _holders() == base - 1


def test_without_a_signal_the_governor_stays_throttled():
    clock = iter(range(100))
    g = spin.SpinGovernor(3, others=lambda: None, clock=lambda: float(next(clock)), calm_s=0.5)
    for _ in range(10):
        g.sample()
    assert not g.spinning
    g.close()


def test_the_others_cpu_time_is_the_busy_time_of_the_given_cpus_less_this_process(tmp_path):
    tck = os.sysconf("SC_CLK_TCK")
    stat, own = tmp_path / "stat", tmp_path / "own"
    stat.write_text(f"cpu  {9 * tck} 0 0 0 0 0 0 0 0 0\n"
                    f"cpu0 {2 * tck} {tck} {tck} {50 * tck} {7 * tck} 0 0 {3 * tck} 0 0\n"    # idle, iowait, steal: no
                    f"cpu1 {tck} 0 0 {50 * tck} 0 {tck} {tck} 0 0 0\n"
                    f"cpu2 {40 * tck} 0 0 0 0 0 0 0 0 0\n"                                     # not ours
                    "intr 12345\n")
    fields = ["S"] + ["0"] * 10 + [str(2 * tck), str(tck)] + ["0"] * 30            # utime 2 s, stime 1 s
    own.write_text(f"42 (python3 serve x) {' '.join(fields)}\n")
    assert spin.others_cpu_seconds({0, 1}, str(stat), str(own)) == (4 + 3) - 3
    assert spin.others_cpu_seconds({0, 1}, str(tmp_path / "missing"), str(own)) is None
    own.write_text("garbage")
    assert spin.others_cpu_seconds({0, 1}, str(stat), str(own)) is None


def test_no_governor_where_the_caller_chose_the_policy_or_one_thread_computes(monkeypatch):
    monkeypatch.setattr(spin, "_governor", None)
    monkeypatch.setattr(threads, "SPIN_GOVERNED", False)
    assert spin.govern(2) is None
    monkeypatch.setattr(threads, "SPIN_GOVERNED", True)
    assert spin.govern(1) is None
