"""Run plans: compute on the calling thread, I/O on its own thread, truly overlapped (torch kernels and the
pool's reads release the GIL). One mechanism runs one request or a whole batch; it has no policy — the
order of work on each side comes with the plan(s).

    compute thread:  (request, step) items in order; a request's tail + query as soon as its grid is whole
    I/O thread:      (request, load) items in order
    board (per request):
        dynamic meet: unclaimed chunks [lo, hi) — compute claims from lo forward, I/O from hi backward,
                      each skips what the other side already claimed (Cake's run-time meet)
        static:       cells still to load per layer (a pipelined query runs layer l once layer l is in)

A cell that fails to load (missing, evicted, corrupt — the pool returns None) is never served: its chunk is
recomputed, in chunk order, once every earlier chunk of that request is complete, so the cache stays exact.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from kvflow.chunks.keys import ChunkKey
from kvflow.executor.timeline import Event, Timings
from kvflow.model.runner import KVCache, ModelRunner
from kvflow.planner.plan import ComputeStep, LoadStep, Plan


@dataclass
class Job:
    """One request to run: its plan, its record keys ``keys[i][layer]``, and context + query token ids."""
    plan: Plan
    keys: list[list[ChunkKey]]
    token_ids: torch.Tensor
    cache: KVCache | None = None


@dataclass
class Execution:
    cache: KVCache
    logits: torch.Tensor
    timeline: list[Event]
    timings: Timings
    fallback_chunks: list[int] = field(default_factory=list)


class _Board:
    """Per-request state shared by the two threads; guarded by the executor's condition variable."""

    def __init__(self, plan: Plan):
        self.lo, self.hi = 0, plan.num_chunks          # dynamic meet: unclaimed chunks are [lo, hi)
        self.pending = [0] * plan.num_layers           # static: cells still to load, per layer
        for step in plan.loads:
            for layer in range(*step.layers):
                self.pending[layer] += step.chunks[1] - step.chunks[0]
        self.in_flight = 0                             # dynamic: chunks claimed by I/O, not yet written
        self.compute_left = 0                          # compute-order items not yet run or skipped
        self.failed: dict[int, int] = {}               # chunk -> lowest failed layer
        self.compute_busy = 0.0
        self.grid_compute_end = 0.0
        self.blocked = 0.0
        self.events: list[Event] = []

    def grid_loaded(self, plan: Plan) -> bool:
        """Every load this request will get has landed (its compute items may still be queued)."""
        if plan.dynamic_meet:
            return self.lo >= self.hi and self.in_flight == 0
        return not any(self.pending)

    def grid_whole(self, plan: Plan, io_done: bool) -> bool:
        """Every cell is in (or the I/O thread ended, so failures/errors show). Dynamic: every chunk claimed and
        no load in flight (compute steps finish before this is asked). Static: all compute items run too."""
        if plan.dynamic_meet:
            return (self.lo >= self.hi and self.in_flight == 0) or (io_done and self.compute_left == 0)
        return self.compute_left == 0 and (io_done or self.grid_loaded(plan))

    def failed_at_or_below(self, layer: int) -> bool:
        return any(low <= layer for low in self.failed.values())


class Executor:
    def __init__(self, runner: ModelRunner, pool):
        self.runner, self.pool = runner, pool

    def run(self, plan: Plan, keys: list[list[ChunkKey]], token_ids: torch.Tensor,
            cache: KVCache | None = None) -> Execution:
        """One request: its plan's own compute and load orders."""
        job = Job(plan, keys, token_ids, cache)
        return self.run_batch([job], [(0, s) for s in plan.compute], [(0, s) for s in plan.loads], [0])[0]

    def run_batch(self, jobs: list[Job], compute_order: list[tuple[int, ComputeStep]],
                  io_order: list[tuple[int, LoadStep]], query_order: list[int]) -> list[Execution]:
        """Run every job's grid with the two global orders; each request's tail + query runs on the compute
        thread as soon as its grid is whole (``query_order`` breaks ties). Timings are from the batch start."""
        for job in jobs:
            assert job.token_ids.numel() == job.plan.context_len + job.plan.query_len
            assert len(job.keys) >= job.plan.num_chunks
            job.cache = job.cache or self.runner.new_cache(job.plan.context_len + job.plan.query_len)
        boards = [_Board(job.plan) for job in jobs]
        for r, _ in compute_order:
            boards[r].compute_left += 1
        cond = threading.Condition()
        io_events: list[tuple[int, Event]] = []
        io_error: list[BaseException] = []
        io_done = threading.Event()
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731

        io = threading.Thread(target=self._io_loop, name="kvflow-io", daemon=True,
                              args=(jobs, boards, io_order, cond, io_events, io_error, io_done, clock))
        io.start()
        results: dict[int, Execution] = {}
        remaining = list(query_order)

        def serve_ready(wait: bool) -> None:
            """Run the query of every request whose grid is whole; with ``wait``, block until all are served."""
            while remaining:
                ready = None
                with cond:
                    for r in remaining:
                        if boards[r].grid_whole(jobs[r].plan, io_done.is_set()):
                            ready = r
                            break
                    if ready is None:
                        if not wait:
                            return
                        head = remaining[0]
                        if jobs[head].plan.pipelined_query and not jobs[head].plan.dynamic_meet:
                            ready = head           # static pipelined: start now, layer by layer
                        else:
                            w0 = clock()
                            cond.wait(0.05)
                            boards[remaining[0]].blocked += clock() - w0
                            continue
                remaining.remove(ready)
                results[ready] = self._finish(jobs[ready], boards[ready], cond, io_done, io_error, clock)

        for r, step in compute_order:
            job, board = jobs[r], boards[r]
            (a, b), layers = step.tokens, step.layers
            with cond:
                board.compute_left -= 1
                if job.plan.dynamic_meet:
                    C = job.plan.chunk_tokens
                    assert a // C == board.lo or board.lo >= board.hi, "dynamic compute steps must be contiguous"
                    b = min(b, board.hi * C)
                    if b <= a:
                        cond.notify_all()
                        continue           # the I/O side got here first
                    board.lo = b // C
            start = clock()
            self.runner.run_layers(job.cache, self.runner.embed(job.token_ids[a:b]), a, layers)
            end = clock()
            board.compute_busy += end - start
            board.grid_compute_end = end
            board.events.append(Event("compute", (a, b), layers, start, end))
            with cond:
                cond.notify_all()
            serve_ready(wait=False)
        serve_ready(wait=True)
        io.join()
        if io_error:
            raise io_error[0]
        for r, event in io_events:
            boards[r].events.append(event)
        out = []
        for r in range(len(jobs)):
            ex = results[r]
            ex.timeline = sorted(boards[r].events, key=lambda e: e.start)
            ex.timings.io_busy_s = sum(e.end - e.start for e in ex.timeline if e.kind == "load")
            out.append(ex)
        return out

    def _finish(self, job: Job, board: _Board, cond, io_done, io_error, clock) -> Execution:
        """Recompute failed chunks if any, run tail + query (layer by layer for a static pipelined plan,
        waiting only for each layer's cells), then the LM head."""
        plan, runner, L, C = job.plan, self.runner, job.plan.num_layers, job.plan.chunk_tokens
        s0, s1 = plan.suffix
        pieces = [(a, min(a + plan.step_tokens, s1)) for a in range(s0, s1, plan.step_tokens)]
        hidden = {a: runner.embed(job.token_ids[a:b]) for a, b in pieces}
        first_layer = 0
        if plan.pipelined_query and not plan.dynamic_meet:
            for layer in range(L):
                w0 = clock()
                with cond:
                    cond.wait_for(lambda: board.pending[layer] == 0 or io_done.is_set())
                    failed = board.failed_at_or_below(layer) or bool(io_error)
                board.blocked += clock() - w0
                if failed:
                    break
                self._query(job, board, hidden, pieces, (layer, layer + 1), clock)
                first_layer = layer + 1
        w0 = clock()
        with cond:
            cond.wait_for(lambda: board.grid_loaded(plan) or io_done.is_set())
        board.blocked += clock() - w0
        if io_error:
            raise io_error[0]
        restore_end = clock()
        fallback = sorted(board.failed)
        for i in fallback:  # earlier chunks are complete: recompute the whole chunk, in order
            start = clock()
            runner.run_layers(job.cache, runner.embed(job.token_ids[i * C:(i + 1) * C]), i * C, (0, L))
            end = clock()
            board.compute_busy += end - start
            board.events.append(Event("fallback", (i * C, (i + 1) * C), (0, L), start, end))
            restore_end = end
        if first_layer < L:
            self._query(job, board, hidden, pieces, (first_layer, L), clock)
        start = clock()
        logits = runner.logits(hidden[pieces[-1][0]])
        end = clock()
        board.events.append(Event("head", (s1 - 1, s1), (L, L), start, end))
        timings = Timings(ttft_s=end, restore_s=restore_end, grid_compute_end_s=board.grid_compute_end,
                          compute_busy_s=board.compute_busy, io_busy_s=0.0, blocked_io_s=board.blocked,
                          lower_bound_s=plan.lower_bound_s or 0.0,
                          predicted_ttft_s=plan.predicted.ttft_s if plan.predicted else 0.0)
        return Execution(job.cache, logits, [], timings, fallback)

    def _query(self, job: Job, board: _Board, hidden, pieces, layers, clock) -> None:
        """Tail + query through ``layers``, piece by piece (each piece sees the ones before it)."""
        start = clock()
        for a, _ in pieces:
            hidden[a] = self.runner.run_layers(job.cache, hidden[a], a, layers)
        board.events.append(Event("query", (pieces[0][0], pieces[-1][1]), layers, start, clock()))

    def _io_loop(self, jobs, boards, io_order, cond, io_events, io_error, io_done, clock) -> None:
        try:
            for r, step in io_order:
                job, board = jobs[r], boards[r]
                C = job.plan.chunk_tokens
                (c0, c1), (l0, l1) = step.chunks, step.layers
                if job.plan.dynamic_meet:
                    with cond:
                        if c0 < board.lo:
                            continue       # the compute side got here first
                        assert c1 == board.hi and c1 - c0 == 1, "dynamic loads must walk backward by one chunk"
                        board.hi = c0
                        board.in_flight += 1
                wanted = [job.keys[i][layer] for i in range(c0, c1) for layer in range(l0, l1)]
                start = clock()
                got = self.pool.get_many(wanted)
                failures: dict[int, int] = {}
                for key in wanted:  # hot path: one copy per record into the cache (dtype cast included)
                    tensor = got.get(key)
                    if tensor is None:
                        i, layer = key.tokens[0] // C, key.layers[0]
                        failures[i] = min(failures.get(i, layer), layer)
                    else:
                        job.cache.write_block(tensor, key.tokens, key.layers)
                end = clock()
                io_events.append((r, Event("load", (c0 * C, c1 * C), (l0, l1), start, end)))
                with cond:
                    for i, layer in failures.items():
                        board.failed[i] = min(board.failed.get(i, layer), layer)
                    if job.plan.dynamic_meet:
                        board.in_flight -= 1
                    else:
                        for layer in range(l0, l1):
                            board.pending[layer] -= c1 - c0
                    cond.notify_all()
        except BaseException as err:  # surfaced on the compute thread
            io_error.append(err)
        finally:
            with cond:
                io_done.set()
                cond.notify_all()
