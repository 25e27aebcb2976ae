"""The physical limit of a restoration: the balance point of compute and I/O over the grid's cells.

Any plan fills every cell once, by recomputing it (compute side) or loading it (I/O side), then runs the query.
Given what each cell costs to recompute and what one cell costs to load, no plan finishes sooner than::

    T = min over x of max( recompute(every cell but the x dearest) + compute_after,      compute side
                           x * io_per_cell + io_extra(x)             + io_after )        I/O side

with x real (a cell may be shared: the sides meet inside a chunk), the dearest cells loaded first — loading
is uniform per cell, so taking the most expensive recompute off the compute side is always best. After the last
load at least ``io_after`` (the query's last layer + LM head) remains; the compute side still runs the whole
query (``compute_after``).

One function, two uses: :func:`model_bound` feeds it the cost model's cell times (T*, a diagnostic — a bound from
the planner's own model cannot judge the planner), and the benchmarks feed it cell times *measured* in the same
run (``kvflow.bench.bound``) — the headline.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvflow.cost.model import CostModel


def balance_point(cells: Sequence[float], io_per_cell: float, compute_after: float, io_after: float,
                  io_extra: Callable[[int], float] = lambda k: 0.0, min_loaded: int = 0) -> float:
    """``cells``: seconds to recompute each cell, in the order worth loading (dearest first). ``io_extra(k)``:
    more I/O-side seconds while k cells are loaded (a pipeline stage's activations); at least ``min_loaded``
    cells must be loaded (chunks with no compute inputs)."""
    n = len(cells)
    compute = sum(cells) + compute_after
    best = float("inf")
    for k, c_k in enumerate(cells):
        if k >= min_loaded:   # x in [k, k+1]: the sides meet inside cell k where their lines cross
            io_k = k * io_per_cell + io_extra(k) + io_after
            slope = c_k + io_per_cell
            t = min(max((compute - io_k) / slope, 0.0), 1.0) if slope > 0 else 0.0
            best = min(best, max(compute - t * c_k, io_k + t * io_per_cell))
        compute -= c_k
    return min(best, max(compute, n * io_per_cell + io_extra(n) + io_after))


def model_cells(cost: CostModel, num_chunks: int, chunk_tokens: int, max_step: int) -> list[float]:
    """The cost model's seconds per cell (one chunk, one layer), chunk order. The per-call overhead is charged as
    if every step had ``max_step`` tokens and the per-step overhead not at all, so no plan can do better."""
    C = chunk_tokens
    per_call = cost.d * min(1.0, C / max_step)
    return [cost.layer_time(C, i * C, per_call=per_call) for i in range(num_chunks)]


def model_bound(cost: CostModel, io_per_cell: float, requests: list[tuple[int, tuple[int, int]]],
                chunk_tokens: int, num_layers: int, max_step: int) -> float:
    """T* under the cost model of one request or a whole batch: ``requests`` = (stored chunks, suffix tokens) each.
    Cells of every request compete for the one I/O side; every query runs on the compute side, and after the last
    load at least the cheapest query's last layer + head remain."""
    cells = sorted((c for n, _ in requests for c in model_cells(cost, n, chunk_tokens, max_step)
                    for _ in range(num_layers)), reverse=True)
    queries = sum(cost.step_time(suffix, num_layers) + cost.head for _, suffix in requests)
    q_last = min(cost.step_time(suffix, 1) + cost.head for _, suffix in requests)
    return balance_point(cells, io_per_cell, queries, q_last)
