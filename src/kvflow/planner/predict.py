"""Predict a plan's time from the cost model and the pool's bandwidth, and the lower bound T*.

Compute time is additive over tokens: a step of c tokens at positions [p, p+c) through n layers costs
``n * (a*c + b*sum(x+1 for x in [p, p+c)) + d) + e`` — so runs of chunks are priced in O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.cost.model import CostModel
from kvflow.planner.plan import ComputeStep, LoadStep, Plan, Prediction


@dataclass(frozen=True, slots=True)
class IOModel:
    """I/O side of the cost model: the pool's aggregate read bandwidth and the bytes of one cell."""
    bandwidth: float        # bytes/s (inf = free)
    cell_bytes: int         # one chunk x one layer record, header included
    step_latency: float = 0.0

    def cells_time(self, cells: int) -> float:
        return cells * self.cell_bytes / self.bandwidth if cells else 0.0


def _keys_seen(p: int, c: int) -> float:
    """sum over tokens at positions [p, p+c) of the keys each attends to (x + 1)."""
    return c * p + c * (c + 1) / 2


def step_time(cost: CostModel, tokens: tuple[int, int], layers: int) -> float:
    a, b = tokens
    c = b - a
    if c <= 0 or layers <= 0:
        return 0.0
    return layers * (cost.a * c + cost.b * _keys_seen(a, c) + cost.d) + cost.e


def query_time(cost: CostModel, plan: Plan) -> tuple[float, float]:
    """(one query layer as a separate step, the whole query as one step) — head excluded."""
    a, b = plan.suffix
    return step_time(cost, (a, b), 1), step_time(cost, (a, b), plan.num_layers)


def predict(plan: Plan, cost: CostModel, io: IOModel) -> Prediction:
    """Simulate the compute thread and the I/O thread running ``plan`` (see executor for the real thing)."""
    L = plan.num_layers
    if plan.dynamic_meet:
        restore, tc, tio, _ = simulate_meet(plan, cost, io)
        ready = [restore] * L
    else:
        tc = sum(step_time(cost, s.tokens, s.layers[1] - s.layers[0]) for s in plan.compute)
        tio, ready = 0.0, [0.0] * L
        for s in plan.loads:
            tio += io.cells_time((s.chunks[1] - s.chunks[0]) * (s.layers[1] - s.layers[0])) + io.step_latency
            for layer in range(*s.layers):
                ready[layer] = tio
        restore = max(tc, tio)
    q_layer, q_all = query_time(cost, plan)
    if plan.pipelined_query:
        t = tc
        for layer in range(L):
            t = max(t, ready[layer]) + q_layer
    else:
        t = restore + q_all
    return Prediction(ttft_s=t + cost.head, restore_s=restore, compute_s=tc, io_s=tio)


def simulate_meet(plan: Plan, cost: CostModel, io: IOModel) -> tuple[float, float, float, int]:
    """Two pointers over chunks: compute claims its next step (clipped at the I/O pointer), I/O claims the
    last unclaimed chunk; whoever is free earlier claims next.
    Returns (restore, compute busy, io busy, chunks recomputed)."""
    L, C = plan.num_layers, plan.chunk_tokens
    lo, hi, tc, tio, busy_c = 0, plan.num_chunks, 0.0, 0.0, 0.0
    steps = iter(plan.compute)
    chunk_io = io.cells_time(L) + io.step_latency
    while lo < hi:
        if tc <= tio:
            step = next(steps)
            c1 = min(step.tokens[1] // C, hi)
            dt = step_time(cost, (lo * C, c1 * C), L)
            tc, busy_c, lo = tc + dt, busy_c + dt, c1
        else:
            hi -= 1
            tio += chunk_io
    return max(tc, tio), busy_c, tio, lo


def lower_bound(cost: CostModel, io: IOModel, num_chunks: int, chunk_tokens: int, num_layers: int,
                suffix: tuple[int, int], max_step: int) -> float:
    """T* of one request (see :func:`lower_bound_many`)."""
    return lower_bound_many(cost, io, [(num_chunks, suffix)], chunk_tokens, num_layers, max_step)


def lower_bound_many(cost: CostModel, io: IOModel, requests: list[tuple[int, tuple[int, int]]], chunk_tokens: int,
                     num_layers: int, max_step: int) -> float:
    """T*: the best any split of the grid(s) can do under the cost model — compute and I/O perfectly overlapped,
    the cells whose recompute costs most loaded first (latest chunks, any request), and after the last load only
    one query's last layer + head remain. ``requests``: (stored chunks, suffix token range) each.
    min over K loaded cells of max(C(K) + queries, IO(K) + q_last). Per-call overheads are charged as if every
    step had ``max_step`` tokens, so no plan can beat it."""
    L, C = num_layers, chunk_tokens
    per_call = cost.d * min(1.0, C / max_step)
    cells = sorted((cost.a * C + cost.b * _keys_seen(i * C, C) + per_call  # one chunk, one layer
                    for n, _ in requests for i in range(n)), reverse=True)
    queries = sum(step_time(cost, suffix, L) + cost.head for _, suffix in requests)
    q_last = min(step_time(cost, suffix, 1) + cost.head for _, suffix in requests)
    compute = sum(cells) * L + queries
    best, loaded = compute, 0
    for cell in cells:
        for _ in range(L):
            compute -= cell
            loaded += 1
            best = min(best, max(compute, io.cells_time(loaded) + q_last))
    return best


def compute_steps(split: tuple[int, ...], chunk_tokens: int, max_step: int) -> tuple[ComputeStep, ...]:
    """Grid compute steps for a staircase: each run of chunks with equal split, cut into steps of at most
    ``max_step`` tokens (whole chunks), forward order."""
    C = chunk_tokens
    per = max(1, max_step // C)
    steps, i, n = [], 0, len(split)
    while i < n:
        s = split[i]
        j = i
        while j < n and split[j] == s:
            j += 1
        if s:
            for k in range(i, j, per):
                steps.append(ComputeStep((k * C, min(k + per, j) * C), (0, s)))
        i = j
    return tuple(steps)


def layer_major_loads(split: tuple[int, ...], num_layers: int) -> tuple[LoadStep, ...]:
    """For each layer (ascending), one read of every chunk whose cell at that layer is loaded — a suffix of
    the chunks, because split never increases. Lets the query run layer l as soon as layer l is in."""
    n = len(split)
    loads = []
    for layer in range(num_layers):
        first = next((i for i in range(n) if split[i] <= layer), n)
        if first < n:
            loads.append(LoadStep((first, n), (layer, layer + 1)))
    return tuple(loads)
