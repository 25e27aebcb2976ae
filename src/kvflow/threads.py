"""Which threads may run torch with several OpenMP threads: one long-lived thread per process.

torch's CPU thread pool is libgomp's. A thread that runs a parallel region keeps its own team of worker threads
until the thread exits. Once the process holds more OpenMP threads than it has CPUs, libgomp throttles: its
workers stop spinning at barriers almost at once (100 spins instead of GOMP_SPINCOUNT: kvflow's 30,000, libgomp's
default 300,000) and sleep on a futex, so every parallel region pays a wake-up. Measured on the 2-vCPU box with
torch 2.13: a small elementwise op went from 11 us to 104 us, and a served prefill step of the ``tiny`` preset
took about twice its in-process time, when a second team existed beside the engine thread's, even while that team
sat idle. A second team exists as soon as the main thread has loaded a model, or an I/O thread has copied a large
tensor.

Hence three rules:

- the thread that computes (the serving engine's thread; the main thread of a benchmark or of a pipeline stage)
  runs with :func:`compute_threads` threads;
- every other long-lived thread that may touch tensors (restore worker, executor I/O, pool writer, connector
  loads) calls :func:`single_threaded` first, so its ops run in that thread and form no team;
- set-up on a thread that is not the computing one (model load, profiling, engine build before serving) runs in
  :func:`in_fresh_thread`: its team ends with that thread.

The one deliberate second team is kvflow/spin.py's: it uses this throttle to stop the workers spinning while other
processes use the cores.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, TypeVar

# libgomp's idle workers spin GOMP_SPINCOUNT rounds at a barrier before they sleep on a futex (read once, when torch
# loads libgomp: kvflow/__init__.py sets it before that). kvflow's count is 30,000 rounds, ~0.8 ms of a core on the
# Zen 4 box — long enough to span the gaps between a step's parallel regions, a tenth of libgomp's default — and
# kvflow/spin.py's governor throttles it to libgomp's 100 whenever other processes use the cores. Why: on a VM whose
# idle vCPUs halt at once, waking a sleeping worker goes through the hypervisor, and a served step has hundreds of
# parallel regions (a served 56-token step on a cached 512, in one run: 177 ms sleeping, 163 spinning 3,000 rounds,
# 144 spinning 30,000 or 300,000, on the idle 2-vCPU box); but a spinning worker holds a core that its partner or anyone
# else needs (1.25-1.5x slower beside busy processes at 3,000 rounds; with libgomp's default 300,000 rounds under
# load 5-13, 5-14x). docs/ENGINE.md, "Threads".
# A caller who sets OMP_WAIT_POLICY or GOMP_SPINCOUNT keeps that policy, ungoverned; OMP_WAIT_POLICY=PASSIVE is
# kvflow's earlier default (sleep at once). A child of a kvflow process inherits kvflow's count and the marker that
# says it is kvflow's, so it is governed too; the vLLM peer gets neither (integrations/vllm_server.py).
SPIN_COUNT = "30000"
SPIN_MARKER = "KVFLOW_OMP_SPIN"          # = the GOMP_SPINCOUNT kvflow set, for children to recognise it
OMP_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", SPIN_MARKER)
WAIT_POLICY_OURS = "OMP_WAIT_POLICY" not in os.environ and \
    os.environ.get("GOMP_SPINCOUNT") in (None, os.environ.get(SPIN_MARKER))     # unset, or set by kvflow
# Governed only where our count is the one libgomp reads: kvflow imported before torch (not inside vLLM's worker).
SPIN_GOVERNED = WAIT_POLICY_OURS and "torch" not in sys.modules


def our_omp_wait() -> None:
    """GOMP_SPINCOUNT=SPIN_COUNT (and its marker) for this process and its children, unless the caller chose a
    policy (see SPIN_COUNT); call before torch loads."""
    if WAIT_POLICY_OURS:
        os.environ["GOMP_SPINCOUNT"] = os.environ[SPIN_MARKER] = SPIN_COUNT

T = TypeVar("T")

_compute: int | None = None


def set_compute_threads(n: int) -> None:
    """Record how many threads the computing thread uses (load_model: $KVFLOW_TORCH_THREADS or torch's default)."""
    global _compute
    _compute = max(1, int(n))


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity; every CPU where the platform cannot say)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def compute_threads() -> int:
    """Threads for the computing thread: what load_model resolved (torch's default from the import of
    kvflow.model.runner on), else the CPUs this process may run on."""
    if _compute is not None:
        return _compute
    return len(allowed_cpus())


def set_own_threads(n: int) -> None:
    """``torch.set_num_threads(n)`` for this thread only, for good. torch keeps the last count any thread set in one
    process-wide value and applies it to a thread at that thread's first op (its lazy init), after which the
    count is the thread's own (OpenMP's and MKL's per-thread settings). A thread that sets its count before its
    first op is therefore reset to whatever another thread set in between: the serving engine's thread set 2, a
    pool reader then set 1, and the engine's first step made every op of the server single-threaded (one core
    busy; served decode at batch 1 ~60 ms a token against ~47 ms in process). Reading the count first runs the lazy
    init, so the count set next stays this thread's."""
    import torch

    torch.get_num_threads()
    torch.set_num_threads(n)


def use_compute_threads() -> None:
    """Call at the start of the thread that computes when it is not the main thread (the engine loop)."""
    set_own_threads(compute_threads())


def single_threaded() -> None:
    """Call at the start of a helper thread: torch ops in it run without an OpenMP team. Leaves other threads'
    counts alone (torch's count is per thread for OpenMP and MKL); a no-op where torch was never imported."""
    if "torch" in sys.modules:
        set_own_threads(1)


def single_threaded_run(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` as a helper thread's target: :func:`single_threaded`, then ``fn``."""
    def run(*args, **kwargs) -> T:
        single_threaded()
        return fn(*args, **kwargs)
    return run


def in_fresh_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a new thread, with the computing thread's count, that ends when it returns (its
    result, or its exception re-raised here): the OpenMP team its torch ops formed ends with it."""
    box: list = []

    def run() -> None:
        try:
            use_compute_threads()
            box.append((True, fn(*args, **kwargs)))
        except BaseException as err:  # re-raised on the caller's thread
            box.append((False, err))

    thread = threading.Thread(target=run, name="kvflow-setup")
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value
