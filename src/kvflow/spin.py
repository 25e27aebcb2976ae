"""SpinGovernor: torch's OpenMP workers spin at barriers while the cores are free and sleep while others want them.

libgomp decides at every barrier how long an idle worker spins before it sleeps on a futex: ``GOMP_SPINCOUNT``
rounds, or at most 100 while the process holds more OpenMP threads than it may use CPUs (the throttle the libgomp
manual documents under ``GOMP_SPINCOUNT``). The count is read once, when torch loads libgomp (kvflow/__init__.py sets
``threads.SPIN_COUNT`` before that, unless the caller chose a policy: kvflow/threads.py); the throttle is re-checked
at every barrier. So spinning is switched off by holding a second, idle team — a thread that ran one parallel region
with more threads than CPUs and then waits — and on again by letting that thread end, which ends its team.

Why switch at all (docs/ENGINE.md, "Threads"): on a VM whose idle vCPUs halt at once, every wake of a sleeping worker
goes through the hypervisor, and a served step of smollm2-135m has hundreds of parallel regions: spinning 3,000
rounds made served decode 1.1-1.2x faster on the idle 2-vCPU box, and 1.25-1.45x slower beside one busy process,
where a spinning worker holds a core that its partner (or anyone else) is waiting for.

The signal is Linux's CPU pressure (PSI, ``/proc/pressure/cpu``, line ``some``): the share of wall time in which at
least one runnable task waited for a CPU. Measured during served decode bursts (smollm2-135m, 2 vCPUs): 0.03 on the
idle box with the client beside the server, whatever the policy; 0.25-0.38 beside one busy process; 0.75-0.87
beside three. Sampled every :data:`PERIOD_S`; above :data:`PRESSURE` the governor throttles at once, and it lets
spinning resume only after :data:`CALM_S` without pressure. It starts throttled. Where PSI cannot be read (an older
kernel, ``psi=0``) it stays throttled: workers sleep after 100 rounds, close to ``OMP_WAIT_POLICY=PASSIVE``.
One governor per process (:func:`govern`, started by ``load_model``); none where the caller chose a policy or torch
was loaded before kvflow (``threads.SPIN_GOVERNED``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

PERIOD_S = 0.1
PRESSURE = 0.1             # share of wall time some task waited for a CPU, over one period
CALM_S = 1.0
PSI_CPU = "/proc/pressure/cpu"
THROTTLE_THREAD = "kvflow-spin-throttle"     # the thread that holds the idle team while throttled


def psi_some_seconds(path: str = PSI_CPU) -> float | None:
    """Total seconds some task waited for a CPU since boot (PSI ``some total``), or None where unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("some"):
                    return int(line.rsplit("total=", 1)[1]) / 1e6
    except (OSError, ValueError, IndexError):
        return None
    return None


class SpinGovernor:
    """One per process (:func:`govern`): a daemon thread samples the pressure and holds or releases the idle team.

    ``threads`` is the size of the held team: more than libgomp's CPUs, so that the process holds more OpenMP threads
    than CPUs whatever the computing thread's team (:func:`govern`: the CPUs this process may use, plus one);
    ``pressure`` reads PSI's cumulative seconds (injectable for tests); ``clock`` is monotonic seconds."""

    def __init__(self, threads: int, pressure: Callable[[], float | None] = psi_some_seconds,
                 clock: Callable[[], float] = time.monotonic, period_s: float = PERIOD_S,
                 threshold: float = PRESSURE, calm_s: float = CALM_S):
        self.threads, self.pressure, self.clock = threads, pressure, clock
        self.period_s, self.threshold, self.calm_s = period_s, threshold, calm_s
        self.switches = 0
        self.seconds = {True: 0.0, False: 0.0}          # spinning / throttled, up to the last switch
        self._mark: float | None = None
        self._release: threading.Event | None = None
        self._holder: threading.Thread | None = None
        self._stop = threading.Event()
        self._last: tuple[float, float] | None = None     # (clock, pressure seconds) at the last sample
        self._calm_since: float | None = None
        self._monitor: threading.Thread | None = None

    @property
    def spinning(self) -> bool:
        return self._holder is None

    def _switched(self) -> None:
        now = self.clock()
        if self._mark is not None:
            self.seconds[not self.spinning] += now - self._mark     # the state that just ended
        self._mark = now
        self.switches += 1

    def stats(self) -> dict:
        """Switches so far and the share of the governed time spent spinning."""
        seconds = dict(self.seconds)
        if self._mark is not None:
            seconds[self.spinning] += self.clock() - self._mark
        total = seconds[True] + seconds[False]
        return {"switches": self.switches, "spinning_share": seconds[True] / total if total > 0 else 0.0}

    # ------------------------------------------------------------------------------------------- the held team
    def _hold(self, ready: threading.Event, release: threading.Event) -> None:
        import torch

        from kvflow.threads import set_own_threads

        before = torch.get_num_threads()     # torch's process-wide count, which later threads start from
        set_own_threads(self.threads)
        torch.ones(1 << 17).add_(1)          # over aten's grain (32,768): one parallel region, a team of `threads`
        torch.set_num_threads(before)        # the team stays (its pool lives with this thread); the count goes back
        ready.set()
        release.wait()                       # the team lives until this thread ends

    def throttle(self) -> None:
        """Hold the idle team (workers sleep after <= 100 spins); a no-op while held."""
        if self._holder is not None:
            return
        ready, self._release = threading.Event(), threading.Event()
        self._holder = threading.Thread(target=self._hold, args=(ready, self._release), name=THROTTLE_THREAD,
                                        daemon=True)
        self._holder.start()
        ready.wait()
        self._switched()

    def release(self) -> None:
        """End the idle team (workers spin SPIN_COUNT rounds again); a no-op while not held."""
        if self._holder is None:
            return
        self._release.set()
        self._holder.join()
        self._holder = self._release = None
        self._switched()

    # ------------------------------------------------------------------------------------------- the decision
    def sample(self) -> None:
        """One decision from the pressure since the last sample (called every period by the monitor)."""
        now, total = self.clock(), self.pressure()
        if total is None:                    # no signal: sleep, as the safe policy does
            self._last = None
            self.throttle()
            return
        last, self._last = self._last, (now, total)
        if last is None or now <= last[0]:
            return
        share = (total - last[1]) / (now - last[0])
        if share > self.threshold:
            self._calm_since = None
            self.throttle()
        elif self._calm_since is None:
            self._calm_since = now
        elif now - self._calm_since >= self.calm_s:
            self.release()

    def start(self) -> SpinGovernor:
        """Throttled until the pressure has been low for ``calm_s``; then the monitor decides."""
        self.throttle()
        self._monitor = threading.Thread(target=self._run, name="kvflow-spin-governor", daemon=True)
        self._monitor.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def close(self) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join()
        self.release()


_governor: SpinGovernor | None = None
_lock = threading.Lock()


def govern(compute_threads: int) -> SpinGovernor | None:
    """This process's governor, started on the first call where kvflow's spin count is in effect and the computing
    thread runs a team (``compute_threads`` >= 2); None otherwise."""
    global _governor
    from kvflow.threads import SPIN_GOVERNED

    if not SPIN_GOVERNED or compute_threads < 2:
        return None
    with _lock:
        if _governor is None:
            try:
                cpus = len(os.sched_getaffinity(0))
            except (AttributeError, OSError):
                cpus = os.cpu_count() or 1
            _governor = SpinGovernor(max(cpus, compute_threads) + 1).start()
        return _governor


def current() -> SpinGovernor | None:
    """This process's governor, if one runs."""
    return _governor


def _forget() -> None:
    """In a forked child the governor's threads do not exist: let the child start its own."""
    global _governor, _lock
    _governor, _lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
