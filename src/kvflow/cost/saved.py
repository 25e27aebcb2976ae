"""The cost profile for this model on this machine: the saved one while it still fits, else profiled now and saved.

One staleness rule for every caller (restorer, CLI, benchmarks). A profile is saved per model fingerprint, device
and torch thread count (``default_profile_path``), so weights, device and threads never mix. Within one such file
the saved fit is used when its grid reached at least half the positions the caller will plan at
(``fit.max_position >= max_position // 2``): the fitted terms are linear in position and hold a little beyond the
grid; further out the file is measured again at ``max_position`` and replaced.

Profiling now (a server's start-up, a benchmark's first run) is proportionate: a step's time is linear in the layers
it runs, so it measures 1 and 4 layers (``ON_DEMAND``: the per-layer terms apart from the per-step one; the fit
prices the model's every layer), at 3 chunk sizes x 2 positions (0 and ``max_position``: the terms are linear in
position) + 4 held-out points, the fastest of two timings per point — seconds, not the whole model over the whole
grid (smollm2-135m, 30 layers: ~18 min before). ``kvflow profile`` measures up to
every layer at 5 x 6 points, the fastest of three, and is the way to refresh a profile on purpose; both write the
same file, which this rule reads whichever wrote it.

    cost = cost_profile(runner, 8192, profiling=bar)     # bar(title): a context giving progress(done, total), entered
                                                         # only while a profile is measured now (the CLI's bar)
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, ContextManager

import torch

from kvflow.cost.model import CostModel, default_profile_path

log = logging.getLogger("kvflow.cost")
MAX_POSITION = 8192          # positions a caller that does not know its contexts plans at
REPEATS = 2                  # timings per point when profiling on demand
Progress = Callable[[int, int], None]
Profiling = Callable[[str], ContextManager[Progress | None]]
ON_DEMAND = dict(layers=4, chunks=(64, 256, 1024), fractions=(1.0,), held_out_points=4)   # profiler.profile's grid


def saved_profile(runner, max_position: int = MAX_POSITION, threads: int | None = None) -> CostModel | None:
    """The saved profile of ``runner`` with ``threads`` torch threads (default: the current count) if the rule above
    says it still fits ``max_position``; None otherwise. A damaged file is a ConfigError naming it."""
    path = default_profile_path(runner.name, runner.fingerprint, threads or torch.get_num_threads(),
                                str(runner.device))
    if not path.exists():
        return None
    cost = CostModel.load(path)
    return cost if cost.fit.get("max_position", 0) >= max_position // 2 else None


def cost_profile(runner, max_position: int = MAX_POSITION, *, threads: int | None = None,
                 profiling: Profiling | None = None) -> CostModel:
    """:func:`saved_profile`, else a profile measured now (up to ``max_position``, with ``threads`` torch threads)
    and saved where the next call finds it; the measurement runs inside ``profiling(title)``, which gives its
    ``progress(done, total)`` callback (or None)."""
    cost = saved_profile(runner, max_position, threads)
    if cost is not None:
        return cost
    from kvflow.cost.profiler import profile

    before = torch.get_num_threads()
    title = f"profiling {runner.name}{f' with {threads} thread(s)' if threads else ''} (once per machine)"
    threads = threads or before
    path = default_profile_path(runner.name, runner.fingerprint, threads, str(runner.device))
    log.warning("no cost profile of %s up to %d positions here: profiling %d of its %d layers now (saved to %s)",
                runner.name, max_position, min(ON_DEMAND["layers"], runner.num_layers), runner.num_layers, path)
    torch.set_num_threads(threads)
    try:
        with (profiling or _quiet)(title) as progress:
            cost = profile(runner, max_position=max_position, repeats=REPEATS,
                           progress=progress or _log_progress(runner), **ON_DEMAND)
    finally:
        torch.set_num_threads(before)
    cost.save(path)
    log.info("cost profile of %s: %d points up to %d layers x %d positions in %.1f s, held-out median error %.1f%%",
             runner.name, cost.fit["train_points"], cost.fit["layers_measured"], max_position, cost.fit["seconds"],
             100 * cost.fit["held_out_median_rel_error"])
    return cost


def _quiet(title: str) -> ContextManager[None]:
    return contextlib.nullcontext()


def noting(note: Callable[[str], None]) -> Profiling:
    """A ``profiling`` that says ``title ...`` once, through ``note``, before the measurement."""
    def profiling(title: str) -> ContextManager[None]:
        note(f"{title} ...")
        return contextlib.nullcontext()
    return profiling


def _log_progress(runner, every: float = 0.25) -> Callable[[int, int], None]:
    """Progress as log lines (a server's start-up has no terminal of its own): at each quarter of the points."""
    shown = [0.0]

    def progress(done: int, total: int) -> None:
        if done == total or done / total >= shown[0] + every:
            shown[0] = done / total
            log.info("profiling %s: %d%% (%d/%d points)", runner.name, 100 * done // total, done, total)
    return progress
