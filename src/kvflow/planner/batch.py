"""Batch-aware two pointers: one compute pointer and one I/O pointer managed over a whole batch.

    1. Order: requests by restoration work, shortest first, so short requests are not stuck behind long ones.
    2. Split: the first k requests (in that order) each get their own balanced meet — both sides work on them
       together and they finish early; the rest are split globally: the I/O side takes the chunks whose
       recompute is most expensive (late chunks of long contexts — the largest marginal saving) until compute
       and I/O balance, the compute side keeps the cheap early chunks. Loaded chunks are always a suffix, so
       every request keeps one meet point. k = 0 is pure global balance (best makespan), k = N is shortest-
       first per-request two pointers (best for the first requests); every k is simulated on the cost model
       and the one with the lowest predicted mean + P99 TTFT is run.
    3. Each side walks its planned items in request order, then continues into the other side's chunks
       (compute forward, I/O backward); per-request claims let whichever side is ahead take over. A request's
       query runs as soon as its grid is whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvflow.planner.plan import ComputeStep, LoadStep, Plan, Prediction
from kvflow.planner.bound import model_bound
from kvflow.planner.simulate import SimJob, simulate
from kvflow.planner.strategies import Planner, Request


@dataclass(frozen=True, slots=True)
class BatchPlan:
    plans: tuple[Plan, ...]
    compute_order: tuple[tuple[int, ComputeStep], ...]
    io_order: tuple[tuple[int, LoadStep], ...]
    query_order: tuple[int, ...]
    predicted_ttft: tuple[float, ...]
    lower_bound_s: float       # no schedule can finish the whole batch sooner (cost model + bandwidth)


def plan_batch(planner: Planner, requests: list[Request]) -> BatchPlan:
    cost, io, L, C = planner.cost, planner.io, planner.L, planner.C
    chunk_cost = [[cost.step_time((i * C, (i + 1) * C), L) for i in range(req.stored_chunks)] for req in requests]
    queries = [cost.step_time((req.stored_chunks * C, req.context_len + req.query_len), L) + cost.head
               for req in requests]
    order = sorted(range(len(requests)), key=lambda r: (sum(chunk_cost[r]) + queries[r], r))
    own = [planner.plan("token", req).split.count(L) for req in requests]   # per-request balanced meet
    bound = model_bound(cost, io.cells_time(1), [(req.stored_chunks, (req.stored_chunks * C,
                                                                       req.context_len + req.query_len))
                                                  for req in requests], C, L, planner.config.max_step)
    best = None
    for k in range(len(requests) + 1):
        meet = _global_meets(planner, requests, chunk_cost, queries, order[k:])
        for r in order[:k]:
            meet[r] = own[r]
        compute_order, io_order = _orders(planner, requests, meet, order)
        plans = [_request_plan(planner, req, r, meet[r], compute_order, io_order) for r, req in enumerate(requests)]
        predicted = [res.ttft_s for res in simulate([SimJob(p) for p in plans], compute_order, io_order, order,
                                                     cost, io.read_time)]
        score = sum(predicted) / len(predicted) + max(predicted, default=0.0)
        if best is None or score < best[0]:
            best = (score, plans, compute_order, io_order, predicted, k)
    _, plans, compute_order, io_order, predicted, k = best
    plans = [replace(p, predicted=Prediction(t, t, 0.0, 0.0), lower_bound_s=bound,
                     notes={"sequential_first": k}) for p, t in zip(plans, predicted)]
    return BatchPlan(tuple(plans), tuple(compute_order), tuple(io_order), tuple(order), tuple(predicted), bound)


def _global_meets(planner: Planner, requests, chunk_cost, queries, among: list[int]) -> list[int]:
    """Move the most expensive chunks of the ``among`` requests to I/O while that lowers max(compute, io)."""
    chunk_io = planner.io.read_time(planner.L)
    meet = [req.stored_chunks for req in requests]
    cells = sorted(((chunk_cost[r][i], r, i) for r in among for i in range(requests[r].stored_chunks)),
                   reverse=True)
    compute, io_total = sum(sum(chunk_cost[r]) + queries[r] for r in among), 0.0
    for c, r, i in cells:
        if max(compute - c, io_total + chunk_io) >= max(compute, io_total) or i != meet[r] - 1:
            break
        compute, io_total, meet[r] = compute - c, io_total + chunk_io, i
    return meet


def _orders(planner: Planner, requests, meet, order):
    """Planned items in request order (big compute steps far from the meet), then each side's extension."""
    L, C = planner.L, planner.C
    per = max(1, planner.config.max_step // C)
    compute_order, io_order = [], []
    for r in order:
        i = 0
        while i < meet[r]:
            size = per if i + per <= meet[r] - planner.config.near_meet_chunks else 1
            compute_order.append((r, ComputeStep((i * C, min(i + size, meet[r]) * C), (0, L))))
            i += size
        io_order += [(r, LoadStep((i, i + 1), (0, L))) for i in reversed(range(meet[r], requests[r].stored_chunks))]
    for r in order:
        compute_order += [(r, ComputeStep((i * C, (i + 1) * C), (0, L)))
                          for i in range(meet[r], requests[r].stored_chunks)]
        io_order += [(r, LoadStep((i, i + 1), (0, L))) for i in reversed(range(meet[r]))]
    return compute_order, io_order


def _request_plan(planner: Planner, req: Request, r: int, meet: int, compute_order, io_order) -> Plan:
    L = planner.L
    return planner.make_plan("cacheflow-batch", req, [L] * meet + [0] * (req.stored_chunks - meet),
                         compute=tuple(s for q, s in compute_order if q == r),
                         loads=tuple(s for q, s in io_order if q == r), dynamic_meet=True, cell_meet=True)
