"""Profile a model's restoration compute cost on this machine and fit :class:`CostModel`.

KV contents do not change the time of a step, so no prefill is needed: each point runs ``run_layers``
on random hidden states at position p over an uninitialised cache of length p + c.

A step's time is linear in the layers it runs (``n * t_layer + e``), so the layer counts measured need not reach
the model's: two of them separate the per-layer terms from the per-step one. ``layers`` caps the deepest count
(grid and held-out points); ``kvflow profile`` measures up to every layer, a profile measured on demand at start-up
(cost/saved.py) up to a few, with fewer chunks and positions.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kvflow.cost.model import CostModel
from kvflow.model.device import synchronize
from kvflow.model.runner import ModelRunner


@dataclass(frozen=True, slots=True)
class Point:
    c: int
    p: int
    n: int
    t: float


def _time_step(runner: ModelRunner, cache, c: int, p: int, n: int, repeats: int) -> float:
    hidden = torch.randn(1, c, runner.hidden_size, dtype=runner.dtype, device=runner.device) * 0.02
    samples = []
    for _ in range(repeats):
        synchronize(runner.device)                      # timings of the device's work, not of its queue
        t0 = time.perf_counter()
        runner.run_layers(cache, hidden, p, (0, n))
        synchronize(runner.device)
        samples.append(time.perf_counter() - t0)
    return min(samples)   # the least-interfered run: a busy machine inflates the median, and the per-call term most


def h2d_rate(device: torch.device, nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Pinned host-to-device copy bytes/s (the fastest of ``repeats``); 0 on the host, which copies nothing."""
    if device.type != "cuda":
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _features(c, p, n):
    return [n * c, n * c * (p + (c + 1) / 2), n, 1.0]


def fit(points: list[Point]) -> tuple[float, float, float, float]:
    """Least squares on relative error (rows weighted by 1/t), coefficients kept non-negative."""
    X = np.array([_features(pt.c, pt.p, pt.n) for pt in points])
    y = np.array([pt.t for pt in points])
    w = 1.0 / y
    active = list(range(X.shape[1]))
    while True:  # tiny active-set NNLS: drop negative coefficients and refit
        coef = np.zeros(X.shape[1])
        sol, *_ = np.linalg.lstsq(X[:, active] * w[:, None], y * w, rcond=None)
        coef[active] = sol
        neg = [i for i in active if coef[i] < 0]
        if not neg:
            return tuple(float(v) for v in coef)
        active = [i for i in active if i not in neg]


CHUNKS = (64, 128, 256, 512, 1024)
FRACTIONS = (0.125, 0.25, 0.5, 0.75, 1.0)    # of max_position (0 is always measured)


def grid(max_position: int, num_layers: int, chunks=CHUNKS, fractions=FRACTIONS) -> list[tuple[int, int, int]]:
    positions = sorted({0, *[int(max_position * f) for f in fractions]})
    layers = sorted({1, num_layers})
    return [(c, p, n) for c in chunks for p in positions for n in layers]


def held_out(max_position: int, num_layers: int, count: int, seed: int = 1) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    return [(rng.choice([96, 192, 384, 768]), rng.randrange(0, max_position), rng.randint(1, num_layers))
            for _ in range(count)]


def profile(runner: ModelRunner, *, max_position: int = 8192, repeats: int = 3, held_out_points: int = 12,
            layers: int | None = None, chunks=CHUNKS, fractions=FRACTIONS,
            progress: Callable[[int, int], None] | None = None) -> CostModel:
    """Measure the grid + held-out points (fastest of ``repeats``), fit, report the held-out median relative error.
    ``layers``: the deepest layer count measured (default: the model's; the fit prices all of them)."""
    L = runner.num_layers
    deepest = min(L, layers or L)
    train = grid(max_position, deepest, chunks, fractions)
    test = held_out(max_position, deepest, held_out_points)
    total = len(train) + len(test) + 1
    began = time.perf_counter()
    cache = runner.new_cache(max_position + 1024)
    _time_step(runner, cache, 64, 0, 1, 2)  # warm-up (allocator, kernels)
    order = list(range(len(train) + len(test)))
    random.Random(0).shuffle(order)  # interleave train and held-out points so drift in load biases neither
    points = train + test
    measured: list[Point | None] = [None] * len(points)
    for done, i in enumerate(order, 1):
        c, p, n = points[i]
        measured[i] = Point(c, p, n, _time_step(runner, cache, c, p, n, repeats))
        if progress:
            progress(done, total)
    hidden = torch.randn(1, 1, runner.hidden_size, dtype=runner.dtype, device=runner.device)
    t0 = time.perf_counter()
    for _ in range(5):
        runner.logits(hidden)                           # returns on the host: synchronised
    head = (time.perf_counter() - t0) / 5
    if progress:
        progress(total, total)
    train_pts, test_pts = measured[:len(train)], measured[len(train):]
    a, b, d, e = fit(train_pts)
    model = CostModel(model=runner.name, fingerprint=runner.fingerprint, threads=torch.get_num_threads(),
                      a=a, b=b, d=d, e=e, head=head, kv_bytes_per_token_layer=runner.shape.kv_bytes_per_token_layer(),
                      num_layers=L, device=str(runner.device), h2d_bytes_per_s=h2d_rate(runner.device))
    errors = [abs(model.compute_time(pt.c, pt.p, pt.n) - pt.t) / pt.t for pt in test_pts]
    train_errors = [abs(model.compute_time(pt.c, pt.p, pt.n) - pt.t) / pt.t for pt in train_pts]
    model.fit = {
        "max_position": max_position,
        "layers_measured": deepest,
        "train_points": len(train_pts),
        "train_median_rel_error": statistics.median(train_errors),
        "held_out_points": [[pt.c, pt.p, pt.n, pt.t, model.compute_time(pt.c, pt.p, pt.n)] for pt in test_pts],
        "held_out_median_rel_error": statistics.median(errors),
        "seconds": time.perf_counter() - began,
    }
    return model
