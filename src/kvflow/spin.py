"""SpinGovernor: torch's OpenMP workers spin at barriers while the cores are free and sleep while others want them.

libgomp decides at every barrier how long an idle worker spins before it sleeps on a futex: ``GOMP_SPINCOUNT``
rounds, or at most 100 while the process holds more OpenMP threads than it may use CPUs (the throttle the libgomp
manual documents under ``GOMP_SPINCOUNT``). The count is read once, when torch loads libgomp (kvflow/__init__.py sets
``threads.SPIN_COUNT`` before that, unless the caller chose a policy: kvflow/threads.py); the throttle is re-checked
at every barrier. So spinning is switched off by holding a second, idle team — a thread that ran one parallel region
with more threads than CPUs and then waits — and on again by letting that thread end, which ends its team.

Why switch at all (docs/ENGINE.md, "Threads"): on a VM whose idle vCPUs halt at once, every wake of a sleeping worker
goes through the hypervisor, and a served step of smollm2-135m has hundreds of parallel regions: spinning made a
served step 1.1-1.25x faster on the idle 2-vCPU box, and 1.25-1.45x slower beside one busy process, where a spinning
worker holds a core that its partner (or anyone else) is waiting for.

The signal is the CPU time the *other* processes use on the CPUs this process may run on (:func:`others_cpu_seconds`:
``/proc/stat``'s per-CPU busy time less this process's own, ``/proc/self/stat``), in cores over the last
:data:`WINDOW_S`. Above the governor's allowance — :data:`OTHERS_CORES`, plus the cores the computing team leaves free
— it throttles; it lets spinning resume after :data:`CALM_S` at or below it. The allowance is what a client beside
the server takes (the matrix's load generator: 0.03-0.09 of a core); one busy process takes 0.67 of a core or more
beside a spinning team (the scheduler's fair share). Not the kernel's CPU pressure (PSI), which the first version
used: PSI counts the server's own threads waiting behind its spinning workers (the event loop streaming tokens, the
governor itself), so a governed server on an idle box read 0.3 during batch-8 decode bursts and throttled itself 30
times in 20 s of requests. It starts throttled; where ``/proc/stat`` cannot be read it stays throttled (workers sleep
after 100 rounds, close to ``OMP_WAIT_POLICY=PASSIVE``). One governor per process (:func:`govern`, started by
``load_model``); none where the caller chose a policy or torch was loaded before kvflow (``threads.SPIN_GOVERNED``).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Callable, Iterable

from kvflow.threads import allowed_cpus

PERIOD_S = 0.1             # one sample
WINDOW_S = 0.2             # the others' CPU use is averaged over this long
OTHERS_CORES = 0.25        # cores the other processes may use (beyond those the team leaves free) while workers spin
CALM_S = 0.2               # ... and within that for this long before workers spin again
THROTTLE_THREAD = "kvflow-spin-throttle"     # the thread that holds the idle team while throttled
_BUSY_FIELDS = (0, 1, 2, 5, 6)               # /proc/stat cpuN: user nice system [idle iowait] irq softirq (not steal)


def others_cpu_seconds(cpus: Iterable[int], stat: str = "/proc/stat", own: str = "/proc/self/stat") -> float | None:
    """CPU seconds the CPUs ``cpus`` have been busy since boot, less this process's own CPU time: what every other
    process (and the kernel's interrupts) used there. None where either file cannot be read."""
    wanted = {f"cpu{c}" for c in cpus}
    try:
        ticks = 0
        with open(stat) as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name in wanted:
                    fields = rest.split()
                    ticks += sum(int(fields[i]) for i in _BUSY_FIELDS)
        with open(own) as f:
            mine = f.read().rsplit(")", 1)[1].split()          # after the command name, which may hold spaces
        ticks -= int(mine[11]) + int(mine[12])                  # utime, stime: fields 14 and 15 of stat(5)
    except (OSError, ValueError, IndexError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


class SpinGovernor:
    """One per process (:func:`govern`): a daemon thread samples the others' CPU use and holds or releases the idle
    team.

    ``threads`` is the size of the held team: more than libgomp's CPUs, so that the process holds more OpenMP threads
    than CPUs whatever the computing thread's team (:func:`govern`: the CPUs this process may use, plus one);
    ``others`` reads the other processes' cumulative CPU seconds (default: :func:`others_cpu_seconds` on the CPUs
    this process may use; injectable for tests); ``allowance`` is the cores they may use while workers spin;
    ``clock`` is monotonic seconds."""

    def __init__(self, threads: int, others: Callable[[], float | None] | None = None,
                 clock: Callable[[], float] = time.monotonic, period_s: float = PERIOD_S,
                 allowance: float = OTHERS_CORES, window_s: float = WINDOW_S, calm_s: float = CALM_S):
        if others is None:
            cpus = frozenset(allowed_cpus())
            others = lambda: others_cpu_seconds(cpus)     # noqa: E731
        self.threads, self.others, self.clock = threads, others, clock
        self.period_s, self.allowance, self.window_s, self.calm_s = period_s, allowance, window_s, calm_s
        self.switches = 0
        self.seconds = {True: 0.0, False: 0.0}          # spinning / throttled, up to the last switch
        self._mark: float | None = None
        self._release: threading.Event | None = None
        self._holder: threading.Thread | None = None
        self._stop = threading.Event()
        self._samples: collections.deque = collections.deque()   # (clock, others' seconds) over the last window
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
        """One decision from the others' CPU use over the last window (called every period by the monitor)."""
        now, total = self.clock(), self.others()
        if total is None:                    # no signal: sleep, as the safe policy does
            self._samples.clear()
            self.throttle()
            return
        samples = self._samples
        samples.append((now, total))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()                # keep one sample at or beyond the window's start
        first = samples[0]
        if now <= first[0]:
            return
        cores = (total - first[1]) / (now - first[0])
        if cores > self.allowance:
            self._calm_since = None
            self.throttle()
        elif self._calm_since is None:
            self._calm_since = now
        elif now - self._calm_since >= self.calm_s:
            self.release()

    def start(self) -> SpinGovernor:
        """Throttled until the others' CPU use has been within the allowance for ``calm_s``; then the monitor
        decides."""
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
    thread runs a team (``compute_threads`` >= 2); None otherwise. Others may use OTHERS_CORES plus the cores the
    team leaves free (none where it takes every CPU this process may use)."""
    global _governor
    from kvflow.threads import SPIN_GOVERNED

    if not SPIN_GOVERNED or compute_threads < 2:
        return None
    with _lock:
        if _governor is None:
            cpus = len(allowed_cpus())
            _governor = SpinGovernor(max(cpus, compute_threads) + 1,
                                     allowance=max(0, cpus - compute_threads) + OTHERS_CORES).start()
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
