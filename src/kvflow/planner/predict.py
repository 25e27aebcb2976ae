"""Predict a plan's time from the cost model (``CostModel.step_time``, the one formula) and the pool's I/O model;
the cost model's lower bound T*; the step and load layouts static plans share."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.cost.model import CostModel
from kvflow.planner.bound import model_bound
from kvflow.planner.plan import ComputeStep, LoadStep, Plan, Prediction
from kvflow.planner.simulate import simulate_plan


@dataclass(frozen=True, slots=True)
class IOModel:
    """I/O side of the cost model: the pool's aggregate read bandwidth, the bytes of one cell, and what one read
    waits beyond its bytes (a link's per-request latency, divided by the reads the executor keeps in flight)."""
    bandwidth: float        # bytes/s (inf = free)
    cell_bytes: int         # one chunk x one layer record, header included
    step_latency: float = 0.0

    def cells_time(self, cells: int) -> float:
        return cells * self.cell_bytes / self.bandwidth if cells else 0.0

    def read_time(self, cells: int) -> float:
        """One read of ``cells`` cells."""
        return self.cells_time(cells) + self.step_latency if cells else 0.0


def query_time(cost: CostModel, plan: Plan) -> tuple[float, float]:
    """(one query layer as a separate step, the whole query as one step) — head excluded."""
    return cost.step_time(plan.suffix, 1), cost.step_time(plan.suffix, plan.num_layers)


def predict(plan: Plan, cost: CostModel, io: IOModel) -> Prediction:
    """The plan's time on the cost model: a dynamic meet through the one simulator (planner/simulate.py, which also
    prices a pipelined meet's last group), a static plan by adding up each side, its pipelined query layer by layer
    as its layers land."""
    L = plan.num_layers
    if plan.dynamic_meet:
        sim = simulate_plan(plan, cost, io.read_time)
        return Prediction(ttft_s=sim.ttft_s, restore_s=sim.restore_s, compute_s=sim.compute_s, io_s=sim.io_s)
    tc = sum(cost.step_time(s.tokens, s.layers[1] - s.layers[0]) for s in plan.compute)
    tio, ready = 0.0, [0.0] * L
    for s in plan.loads:
        tio += io.read_time((s.chunks[1] - s.chunks[0]) * (s.layers[1] - s.layers[0]))
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


def predicted_meet(plan: Plan, cost: CostModel, io: IOModel) -> int:
    """Chunks the compute side of a dynamic-meet plan is predicted to recompute."""
    return simulate_plan(plan, cost, io.read_time).recomputed


def lower_bound(cost: CostModel, io: IOModel, num_chunks: int, chunk_tokens: int, num_layers: int,
                suffix: tuple[int, int], max_step: int) -> float:
    """T* of one request under the cost model (planner/bound.py)."""
    return model_bound(cost, io.cells_time(1), [(num_chunks, suffix)], chunk_tokens, num_layers, max_step)


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
