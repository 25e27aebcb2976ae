"""The one two-pointer simulator: the executor's dynamic-meet mechanism replayed on the cost model.

Every prediction of a run-time meet goes through :func:`simulate` — one request (``predict``), a batch
(``planner/batch.py``), a pipeline stage fed by activations or a hand-off (``planner/pipeline.py``):

    compute side   walks its (request, step) items in order; a step is clipped at the I/O pointer (and at the
                   last chunk with inputs) and claims chunks [lo, end) before it runs
    I/O side       walks its (request, load) items in order; a load of chunk c claims it if still unclaimed
    whoever is free earlier claims next; a request's tail + query runs on the compute side once its grid is whole
    cell meet      (``plan.cell_meet``) the compute side never claims the last unclaimed chunk whole; once one is
                   left both sides share it layer by layer — compute bottom-up, I/O top-down, whoever is free first
                   takes the next layer — as the executor does (executor/compute.py, executor/io.py)
    last group     (``plan.pipelined_query`` with ``chunk_compute_s`` and ``query_s``) at each claim on either side the
                   compute side's boundary may become final (kvflow.planner.group, the executor's own decision); the
                   I/O side then claims every chunk left as one group, one read per layer, the query runs layer l
                   once layer l is in, and nothing is shared

Static plans (every cell's side fixed in advance) need no meet and are priced in ``predict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from kvflow.cost.model import CostModel
from kvflow.planner.group import MeetState, stop_point
from kvflow.planner.plan import ComputeStep, LoadStep, Plan


@dataclass(frozen=True, slots=True)
class SimJob:
    plan: Plan
    start_s: float = 0.0            # compute may not begin before (a sequential stage waits for its hand-off)
    usable: int | None = None       # compute may not pass this chunk (a stage's inputs end there)
    act_s: float = 0.0              # I/O-side seconds per chunk the compute side claims (a stage's activations)
    query: bool = True              # run tail + query + head when the grid is whole (a stage leaves it to the pipe)
    cell_meet: bool = True          # the plan's cell meet applies (a pipeline stage never shares a chunk)


@dataclass(frozen=True, slots=True)
class SimResult:
    restore_s: float                # every grid cell filled
    compute_end_s: float            # the compute side's last grid step ended (``start_s`` if it ran none)
    compute_s: float                # compute-side grid seconds
    io_s: float                     # I/O-side seconds for this request (loads + activations)
    recomputed: int                 # chunks recomputed: the meet
    ttft_s: float                   # query + head done (``restore_s`` when ``query`` is false)


def simulate(jobs: list[SimJob], compute_order: list[tuple[int, ComputeStep]], io_order: list[tuple[int, LoadStep]],
             query_order: list[int], cost: CostModel, read_s) -> list[SimResult]:
    """``read_s(cells)``: seconds the I/O side needs for one read of that many cells (latency included)."""
    n = len(jobs)
    lo, hi = [0] * n, [j.plan.num_chunks for j in jobs]
    limit = [j.plan.num_chunks if j.usable is None else min(j.usable, j.plan.num_chunks) for j in jobs]
    left = [0] * n
    for r, _ in compute_order:
        left[r] += 1
    busy_c, busy_io, c_end, loaded_at, ttft = [0.0] * n, [0.0] * n, [j.start_s for j in jobs], [0.0] * n, [0.0] * n
    fetched = [(0, 0.0)] * n                       # activations fetched ahead: (chunks, when they are in)
    following: list[int | None] = [None] * len(compute_order)   # the next compute item of the same request
    last: dict[int, int] = {}
    for k in reversed(range(len(compute_order))):
        following[k] = last.get(compute_order[k][0])
        last[compute_order[k][0]] = k
    tc, tio, ci, ii = min((j.start_s for j in jobs), default=0.0), 0.0, 0, 0
    waiting = list(query_order)
    grouping = [j.query and j.plan.dynamic_meet and j.plan.pipelined_query and bool(j.plan.chunk_compute_s)
                and bool(j.plan.query_s) for j in jobs]
    group: list[list[float] | None] = [None] * n    # per request with a last group: when each of its layers is in
    final = [False] * n                              # the compute side's boundary is final
    whole_at = [0.0] * n                             # when the last whole-chunk load landed

    priced: dict[int, tuple] = {}      # per request: (chunk-recompute prefix sums, one chunk's load, query 1 / L layers)

    def decide(r: int, compute_free: float, io_free: float) -> int | None:
        """The executor's decision (kvflow.planner.group) at a claim, on this cost model."""
        if r not in priced:
            plan, C, L = jobs[r].plan, jobs[r].plan.chunk_tokens, jobs[r].plan.num_layers
            priced[r] = (list(accumulate((cost.step_time((i * C, (i + 1) * C), L) for i in range(plan.num_chunks)),
                                         initial=0.0)),
                         read_s(L), cost.step_time(plan.suffix, 1), cost.step_time(plan.suffix, L))
        prefix, chunk_io, query_layer, query = priced[r]
        return stop_point(MeetState(prefix, 1.0, lo[r], hi[r], compute_free, io_free, chunk_io, query_layer, query,
                                    jobs[r].plan.num_layers))

    def share(r: int, tc: float, tio: float, joins: bool) -> tuple[float, float]:
        """Cell meet: the last unclaimed chunk of request r, layer by layer from both ends (``joins``: the I/O side
        takes part — false when its next load is another request's, in a batch)."""
        plan, s = jobs[r].plan, lo[r]
        layer = cost.step_time((s * plan.chunk_tokens, (s + 1) * plan.chunk_tokens), 1)
        low, high = 0, plan.num_layers
        while low < high:
            if tc <= tio or not joins:
                tc, low = tc + layer, low + 1
                busy_c[r] += layer
                c_end[r] = tc
            else:
                dt = read_s(1)
                tio, high = tio + dt, high - 1
                busy_io[r] += dt
                loaded_at[r] = tio
        lo[r] = hi[r] = s + 1 if high == plan.num_layers else s    # recomputed: only if the I/O side got no layer
        return tc, tio

    sharing = [j.cell_meet and j.plan.cell_meet for j in jobs]     # the cell meet applies to this job

    def last_one(r: int) -> bool:
        return sharing[r] and not final[r] and hi[r] - lo[r] == 1 and lo[r] < limit[r]

    def serve(now: float, final: bool) -> float:
        for r in list(waiting):
            if lo[r] >= hi[r] or (final and left[r] == 0):
                done = max(now, loaded_at[r])
                if group[r] is not None:               # layer by layer behind the group's reads
                    now = max(now, whole_at[r])
                    for ready in group[r]:
                        now = max(now, ready) + cost.step_time(jobs[r].plan.suffix, 1)
                    now += cost.head
                    ttft[r] = now
                elif jobs[r].query:
                    now = done + cost.step_time(jobs[r].plan.suffix, jobs[r].plan.num_layers) + cost.head
                    ttft[r] = now
                else:
                    ttft[r] = done
                waiting.remove(r)
        return now

    while ci < len(compute_order) or ii < len(io_order):
        if ci < len(compute_order) and (tc <= tio or ii >= len(io_order)):
            r, step = compute_order[ci]
            ci += 1
            left[r] -= 1
            job, C = jobs[r], jobs[r].plan.chunk_tokens
            a, b = max(step.tokens[0], lo[r] * C), min(step.tokens[1], hi[r] * C, limit[r] * C)
            if sharing[r] and not final[r]:
                b = min(b, (hi[r] - 1) * C)
            if final[r]:
                b = a
            elif grouping[r] and b > a and a // C == lo[r]:
                m = decide(r, max(tc, job.start_s), tio)
                if m is not None and m <= b // C:
                    b, final[r] = max(m, lo[r]) * C, True
            if b > a and a // C == lo[r]:
                tc = max(tc, job.start_s)
                if job.act_s:   # the step's activations cross the link first: fetched while the previous step ran
                    have, ready = fetched[r]
                    if (b - a) // C > have:
                        tio = max(tio, tc) + ((b - a) // C - have) * job.act_s
                        busy_io[r] += ((b - a) // C - have) * job.act_s
                        ready = tio
                    tc = max(tc, ready)
                    nxt = following[ci - 1]
                    if nxt is not None:     # ... and the next step's are fetched now, while this one computes
                        na, nb = compute_order[nxt][1].tokens
                        k = max(0, (min(nb, hi[r] * C, limit[r] * C) - max(na, b)) // C)
                        tio = max(tio, tc) + k * job.act_s
                        busy_io[r] += k * job.act_s
                        fetched[r] = (k, tio)
                    else:
                        fetched[r] = (0, 0.0)
                dt = cost.step_time((a, b), step.layers[1] - step.layers[0])
                tc, busy_c[r], lo[r], c_end[r] = tc + dt, busy_c[r] + dt, b // C, tc + dt
            if last_one(r):
                tc, tio = share(r, max(tc, job.start_s), tio, ii < len(io_order) and io_order[ii][0] == r)
            tc = serve(tc, False)
        else:
            r, step = io_order[ii]
            ii += 1
            c0 = step.chunks[0]
            if last_one(r) and c0 == lo[r]:
                tc, tio = share(r, tc, tio, True)
                tc = serve(tc, False)
            elif lo[r] <= c0 < hi[r]:
                if grouping[r] and not final[r]:
                    m = decide(r, max(tc, tio), tio)
                    final[r] = m is not None and m <= lo[r]
                if final[r]:
                    group[r], g = [], hi[r] - lo[r]
                    for _ in range(jobs[r].plan.num_layers):
                        dt = read_s(g)
                        tio, busy_io[r] = tio + dt, busy_io[r] + dt
                        group[r].append(tio)
                    hi[r], loaded_at[r] = hi[r] - g, tio
                else:
                    dt = read_s((step.chunks[1] - c0) * (step.layers[1] - step.layers[0]))
                    tio, busy_io[r], hi[r], loaded_at[r] = tio + dt, busy_io[r] + dt, c0, tio + dt
                    whole_at[r] = tio
    serve(tc, True)
    return [SimResult(max(c_end[r], loaded_at[r]), c_end[r], busy_c[r], busy_io[r], lo[r],
                      ttft[r] if jobs[r].query else max(c_end[r], loaded_at[r])) for r in range(n)]


def simulate_plan(plan: Plan, cost: CostModel, read_s, **job) -> SimResult:
    """One dynamic-meet plan with its own step and load orders."""
    (res,) = simulate([SimJob(plan, **job)], [(0, s) for s in plan.compute], [(0, s) for s in plan.loads], [0],
                      cost, read_s)
    return res
