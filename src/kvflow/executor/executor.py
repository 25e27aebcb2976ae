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

A job with a ``StageLink`` is one pipeline stage: its plan covers model layers [offset, offset + n), its compute
steps take their input hidden states from the link (stored boundary activations, the previous stage) instead of
the embeddings, full-stage outputs go to the link, and the executor restores the grid only — the tail + query
pass through the pipeline belongs to the caller (kvflow.pipeline). Inputs that never come stop the compute side;
its chunks are left to I/O, and a chunk that neither side can fill is reported (``complete_chunks``), never faked.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvflow.chunks.keys import ChunkKey
from kvflow.executor.timeline import Event, Timings
from kvflow.model.runner import KVCache, ModelRunner
from kvflow.planner.plan import ComputeStep, LoadStep, Plan


class StageLink:
    """Where a pipeline stage's hidden states come from and go to (the executor calls these on its compute thread).
    Subclasses implement ``inputs``; the others are optional."""

    def inputs(self, a: int, b: int) -> torch.Tensor | None:
        """Hidden states entering the stage's first layer for tokens [a, a + t), 0 < t <= b - a; may wait for them.
        A shorter answer (or None) means nothing beyond it will come: the compute side stops there."""
        raise NotImplementedError

    def output(self, a: int, hidden: torch.Tensor) -> None:
        """Hidden states leaving the stage's last layer for tokens [a, a + T) (grid steps through every layer)."""

    def grid_computed(self) -> None:
        """The compute side will run no more grid steps for this job."""


@dataclass
class Job:
    """One request to run: its plan, its record keys ``keys[i][plan layer]``, and context + query token ids.
    With ``link`` the job is a pipeline stage (see StageLink): grid only, no query."""
    plan: Plan
    keys: list[list[ChunkKey]]
    token_ids: torch.Tensor
    cache: KVCache | None = None
    link: StageLink | None = None


@dataclass
class Execution:
    cache: KVCache
    logits: torch.Tensor | None           # None for a pipeline stage (its caller runs the query)
    timeline: list[Event]
    timings: Timings
    fallback_chunks: list[int] = field(default_factory=list)
    complete_chunks: int | None = None    # grid chunks [0, n) filled; < num_chunks only when a stage lacked inputs


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
        self.compute_stopped = False                   # inputs ran out / the meet guard ended the compute side
        self.compute_actual = self.compute_predicted = 0.0   # meet guard: measured vs predicted compute seconds
        self.io_chunk_s = 0.0                          # meet guard: I/O seconds per chunk so far
        self.io_loaded, self.io_loaded_s = 0, 0.0      # ... chunks landed, I/O busy seconds for them
        self.io_started = None                         # meet guard: when the load in flight began
        self.told_link = False
        self.shared: int | None = None                 # cell meet: the chunk both sides share, layer by layer ...
        self.sl, self.sh = 0, plan.num_layers          # ... compute owns layers [0, sl), I/O owns [sh, L)
        self.shared_visited = [False, False]           # ... compute / I/O side has worked on it
        self.failed: dict[int, int] = {}               # chunk -> lowest failed (plan) layer
        self.compute_busy = 0.0
        self.grid_compute_end = 0.0
        self.blocked = 0.0
        self.events: list[Event] = []

    def grid_loaded(self, plan: Plan) -> bool:
        """Every load this request will get has landed (its compute items may still be queued)."""
        if plan.dynamic_meet:
            return self.in_flight == 0 and (self.lo >= self.hi or (self.shared is not None and self.sl >= self.sh))
        return not any(self.pending)

    def grid_whole(self, plan: Plan, io_done: bool) -> bool:
        """Every cell is in (or the I/O thread ended, so failures/errors show). Dynamic: every chunk claimed and
        no load in flight (compute steps finish before this is asked). Static: all compute items run too."""
        if plan.dynamic_meet:
            return self.grid_loaded(plan) or (io_done and self.compute_left == 0)
        return self.compute_left == 0 and (io_done or self.grid_loaded(plan))

    def failed_at_or_below(self, layer: int) -> bool:
        return any(low <= layer for low in self.failed.values())


class Executor:
    def __init__(self, runner: ModelRunner, pool):
        self.runner, self.pool = runner, pool

    def run(self, plan: Plan, keys: list[list[ChunkKey]], token_ids: torch.Tensor,
            cache: KVCache | None = None, link: StageLink | None = None, origin: float | None = None) -> Execution:
        """One request: its plan's own compute and load orders."""
        job = Job(plan, keys, token_ids, cache, link)
        return self.run_batch([job], [(0, s) for s in plan.compute], [(0, s) for s in plan.loads], [0], origin)[0]

    def run_batch(self, jobs: list[Job], compute_order: list[tuple[int, ComputeStep]],
                  io_order: list[tuple[int, LoadStep]], query_order: list[int],
                  origin: float | None = None) -> list[Execution]:
        """Run every job's grid with the two global orders; each request's tail + query runs on the compute
        thread as soon as its grid is whole (``query_order`` breaks ties). Timings are from the batch start, or
        from ``origin`` (a ``time.perf_counter()`` value; a pipeline's stages share one)."""
        for job in jobs:
            assert job.token_ids.numel() == job.plan.context_len + job.plan.query_len
            assert len(job.keys) >= job.plan.num_chunks
            assert job.link is not None or job.plan.layer_offset == 0, "a layer range needs a StageLink for inputs"
            assert job.plan.layer_offset + job.plan.num_layers <= self.runner.num_layers
            job.cache = job.cache or self.runner.new_cache(job.plan.context_len + job.plan.query_len)
        boards = [_Board(job.plan) for job in jobs]
        for r, _ in compute_order:
            boards[r].compute_left += 1
        cond = threading.Condition()
        io_events: list[tuple[int, Event]] = []
        io_error: list[BaseException] = []
        io_done = threading.Event()
        t0 = time.perf_counter() if origin is None else origin
        clock = lambda: time.perf_counter() - t0  # noqa: E731

        io = threading.Thread(target=self._io_loop, name="kvflow-io", daemon=True,
                              args=(jobs, boards, io_order, cond, io_events, io_error, io_done, clock))
        io.start()
        results: dict[int, Execution] = {}
        remaining = list(query_order)

        def serve_ready(wait: bool) -> None:
            """Run the queries of the requests whose grids are whole, then their LM heads in one pass; with
            ``wait``, block until all are served."""
            while remaining:
                with cond:
                    ready = [r for r in remaining if boards[r].grid_whole(jobs[r].plan, io_done.is_set())]
                    if not ready:
                        if not wait:
                            return
                        head = remaining[0]
                        if jobs[head].plan.pipelined_query and not jobs[head].plan.dynamic_meet:
                            ready = [head]         # static pipelined: start now, layer by layer
                        else:
                            w0 = clock()
                            cond.wait(0.05)
                            boards[remaining[0]].blocked += clock() - w0
                            continue
                for r in ready:
                    remaining.remove(r)
                done = [(r, *self._finish(jobs[r], boards[r], cond, io_done, io_error, clock)) for r in ready]
                self._heads(done, boards, clock)
                results.update((r, ex) for r, ex, _ in done)

        def tell_link(r: int) -> None:
            if jobs[r].link is not None and boards[r].compute_left == 0 and not boards[r].told_link:
                boards[r].told_link = True
                jobs[r].link.grid_computed()

        for r in range(len(jobs)):
            tell_link(r)
        for r, step in compute_order:
            self._compute(jobs[r], boards[r], step, cond, clock)
            tell_link(r)
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

    def _compute(self, job: Job, board: _Board, step: ComputeStep, cond, clock) -> None:
        """One grid compute step on the calling thread. Dynamic meet: clipped at the I/O pointer and claimed
        before it runs — for a stage only once its inputs are in hand, so a wait never strands claimed chunks."""
        plan, C = job.plan, job.plan.chunk_tokens
        if plan.cell_meet and job.link is None:
            return self._compute_cell_meet(job, board, step, cond, clock)
        (a, b), layers = step.tokens, step.layers
        last = False                                 # the meet guard shortened this step: the compute side's last
        with cond:
            board.compute_left -= 1
            if plan.dynamic_meet:
                assert a // C == board.lo or board.lo >= board.hi or board.compute_stopped, \
                    "dynamic compute steps must be contiguous"
                b, last = self._guard(plan, board, a, min(b, board.hi * C), clock)
            if board.compute_stopped or b <= a:      # inputs ran out / the I/O side got here first
                if board.compute_stopped and not plan.dynamic_meet:
                    self._fail_chunks(board, a // C, b // C, layers[0])
                board.compute_stopped = board.compute_stopped or last
                cond.notify_all()
                return
            if job.link is None and plan.dynamic_meet:
                board.lo = b // C
        if job.link is None:
            hidden = self.runner.embed(job.token_ids[a:b])
        else:
            hidden = self._stage_inputs(job, board, a, b, clock)
            got = 0 if hidden is None else hidden.shape[1]
            with cond:
                if got < b - a:
                    board.compute_stopped = True
                    if not plan.dynamic_meet:
                        self._fail_chunks(board, (a + got) // C, b // C, layers[0])
                b = a + got
                if plan.dynamic_meet:
                    b, cut = self._guard(plan, board, a, min(b, board.hi * C), clock)
                    last = last or cut
                    if b > a:
                        board.lo = b // C
                if b <= a:
                    board.compute_stopped = board.compute_stopped or last
                    cond.notify_all()
                    return
            hidden = hidden[:, :b - a]
        start = clock()
        out = self.runner.run_layers(job.cache, hidden, a, self._model_layers(plan, layers))
        end = clock()
        board.compute_busy += end - start
        board.grid_compute_end = end
        board.events.append(Event("compute", (a, b), layers, start, end))
        if plan.chunk_compute_s:
            board.compute_actual += end - start
            board.compute_predicted += sum(plan.chunk_compute_s[a // C:b // C])
        if job.link is not None and layers == (0, plan.num_layers):
            job.link.output(a, out)
        with cond:
            board.compute_stopped = board.compute_stopped or last
            cond.notify_all()

    def _compute_cell_meet(self, job: Job, board: _Board, step: ComputeStep, cond, clock) -> None:
        """Dynamic meet that never claims the last unclaimed chunk whole: once one chunk is left, it is shared
        (compute bottom-up, I/O top-down). Chunks below it were all recomputed here, so each of its layers can
        be; the I/O side needs nothing."""
        C = job.plan.chunk_tokens
        (a, b), layers = step.tokens, step.layers
        end = 0
        with cond:
            board.compute_left -= 1
            if a // C == board.lo and board.shared is None:
                c1 = min(b // C, board.hi - 1)
                if c1 > board.lo:
                    board.lo, end = c1, c1 * C
        if end:
            self._grid_step(job, board, (a, end), layers, self.runner.embed(job.token_ids[a:end]), clock)
        with cond:
            if board.shared is None and board.hi - board.lo == 1:
                board.shared = board.lo
            mine = board.shared is not None and not board.shared_visited[0]
            board.shared_visited[0] = board.shared_visited[0] or mine
            cond.notify_all()
        if not mine:
            return
        s = board.shared
        hidden = self.runner.embed(job.token_ids[s * C:(s + 1) * C])
        while True:
            with cond:
                if board.sl >= board.sh:
                    cond.notify_all()
                    return
                layer = board.sl
                board.sl += 1
            hidden = self._grid_step(job, board, (s * C, (s + 1) * C), (layer, layer + 1), hidden, clock)

    def _grid_step(self, job: Job, board: _Board, tokens, layers, hidden, clock) -> torch.Tensor:
        start = clock()
        out = self.runner.run_layers(job.cache, hidden, tokens[0], self._model_layers(job.plan, layers))
        end = clock()
        board.compute_busy += end - start
        board.grid_compute_end = end
        board.events.append(Event("compute", tokens, layers, start, end))
        return out

    @staticmethod
    def _guard(plan: Plan, board: _Board, a: int, b: int, clock) -> tuple[int, bool]:
        """Lock held. Dynamic meet with the plan's guard: shorten the step [a, b) while its last chunk would be
        recomputed later than the I/O side could load it (after the chunks above it and the load in flight).
        Predictions are scaled by the compute speed measured so far; the I/O side's pace is its mean per chunk.
        Until a load has landed the plan stands. Returns (end, shortened: the compute side's last step)."""
        if not (plan.chunk_compute_s and plan.chunk_io_s and board.io_chunk_s) or b <= a:
            return b, False
        C, now = plan.chunk_tokens, clock()
        speed = board.compute_actual / board.compute_predicted if board.compute_predicted else 1.0
        io = board.io_chunk_s
        in_flight = (max(0.0, io - (now - board.io_started)) + io * (board.in_flight - 1)
                     if board.io_started is not None and board.in_flight else 0.0)
        c0, c1 = a // C, b // C
        end = c1
        while end > c0 and speed * sum(plan.chunk_compute_s[c0:end]) > in_flight + io * (board.hi - end + 1):
            end -= 1
        return end * C, end < c1

    @staticmethod
    def _model_layers(plan: Plan, layers: tuple[int, int]) -> tuple[int, int]:
        return layers[0] + plan.layer_offset, layers[1] + plan.layer_offset

    @staticmethod
    def _fail_chunks(board: _Board, c0: int, c1: int, layer: int) -> None:
        """Lock held. Chunks whose cells from ``layer`` up will not be computed: the fallback must fill them."""
        for i in range(c0, c1):
            board.failed[i] = min(board.failed.get(i, layer), layer)

    def _stage_inputs(self, job: Job, board: _Board, a: int, b: int, clock) -> torch.Tensor | None:
        w0 = clock()
        hidden = job.link.inputs(a, b)
        w1 = clock()
        if w1 - w0 > 1e-3:
            board.blocked += w1 - w0
            board.events.append(Event("wait", (a, b), (0, 0), w0, w1))
        return hidden

    def _finish(self, job: Job, board: _Board, cond, io_done, io_error,
                clock) -> tuple[Execution, torch.Tensor | None]:
        """Recompute failed chunks if any, run tail + query (layer by layer for a static pipelined plan,
        waiting only for each layer's cells). Returns the execution and the query's last hidden states (None for a
        pipeline stage); the LM head runs in :meth:`_heads`."""
        plan, runner, L, C = job.plan, self.runner, job.plan.num_layers, job.plan.chunk_tokens
        s0, s1 = plan.suffix
        pieces = [(a, min(a + plan.step_tokens, s1)) for a in range(s0, s1, plan.step_tokens)]
        hidden = {a: runner.embed(job.token_ids[a:b]) for a, b in pieces} if job.link is None else {}
        first_layer = 0
        if plan.pipelined_query and not plan.dynamic_meet and job.link is None:
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
        complete = plan.num_chunks
        for i in fallback:  # earlier chunks are complete: recompute the whole chunk, in order
            if job.link is None:
                inputs = runner.embed(job.token_ids[i * C:(i + 1) * C])
            else:
                inputs = self._stage_inputs(job, board, i * C, (i + 1) * C, clock)
                if inputs is None or inputs.shape[1] < C:
                    complete = i       # no input for this chunk: the pipeline fills it from the previous stage
                    break
            start = clock()
            runner.run_layers(job.cache, inputs, i * C, self._model_layers(plan, (0, L)))
            end = clock()
            board.compute_busy += end - start
            board.events.append(Event("fallback", (i * C, (i + 1) * C), (0, L), start, end))
            restore_end = end
        if job.link is not None:
            timings = Timings(ttft_s=restore_end, restore_s=restore_end, grid_compute_end_s=board.grid_compute_end,
                              compute_busy_s=board.compute_busy, io_busy_s=0.0, blocked_io_s=board.blocked,
                              lower_bound_s=plan.lower_bound_s or 0.0,
                              predicted_ttft_s=plan.predicted.ttft_s if plan.predicted else 0.0)
            return Execution(job.cache, None, [], timings, fallback, complete), None
        if first_layer < L:
            self._query(job, board, hidden, pieces, (first_layer, L), clock)
        timings = Timings(ttft_s=0.0, restore_s=restore_end, grid_compute_end_s=board.grid_compute_end,
                          compute_busy_s=board.compute_busy, io_busy_s=0.0, blocked_io_s=board.blocked,
                          lower_bound_s=plan.lower_bound_s or 0.0,
                          predicted_ttft_s=plan.predicted.ttft_s if plan.predicted else 0.0)
        return Execution(job.cache, None, [], timings, fallback, complete), hidden[pieces[-1][0]]

    def _heads(self, done, boards, clock) -> None:
        """The LM head of every request just served, in one pass over its weights (memory-bound for one token)."""
        done = [(r, ex, h) for r, ex, h in done if h is not None]
        if not done:
            return
        start = clock()
        logits = self.runner.logits_many([h for _, _, h in done])
        end = clock()
        for (r, ex, _), lg in zip(done, logits):
            ex.logits, ex.timings.ttft_s = lg, end
            s1, layers = ex.cache.capacity, ex.cache.num_layers
            boards[r].events.append(Event("head", (s1 - 1, s1), (layers, layers), start, end))

    def _query(self, job: Job, board: _Board, hidden, pieces, layers, clock) -> None:
        """Tail + query through ``layers``, piece by piece (each piece sees the ones before it)."""
        start = clock()
        for a, _ in pieces:
            hidden[a] = self.runner.run_layers(job.cache, hidden[a], a, self._model_layers(job.plan, layers))
        board.events.append(Event("query", (pieces[0][0], pieces[-1][1]), layers, start, clock()))

    def _load_shared(self, job: Job, board: _Board, chunk: int, cond, io_events, r: int, clock) -> None:
        """Cell meet, I/O side: load the shared chunk's layers top-down until the compute side's layer is next,
        as many layers per read as the pool has devices (one layer alone would leave the others idle)."""
        C, width = job.plan.chunk_tokens, getattr(self.pool, "parallelism", 1)
        while True:
            with cond:
                top = board.sh
                board.sh = max(board.sl, board.sh - width)
                if board.sh >= top:
                    return
                layers = (board.sh, top)
                board.in_flight += 1
            keys = [job.keys[chunk][layer] for layer in range(*layers)]
            start = clock()
            got = self.pool.get_many(keys)
            failed = [k.layers[0] for k in keys if got.get(k) is None]
            for key in keys:
                if got.get(key) is not None:
                    job.cache.write_block(got[key], key.tokens, key.layers)
            io_events.append((r, Event("load", (chunk * C, (chunk + 1) * C), layers, start, clock())))
            with cond:
                if failed:
                    board.failed[chunk] = min([board.failed.get(chunk, layers[1])] + failed)
                board.in_flight -= 1
                cond.notify_all()

    @staticmethod
    def _claim(job: Job, board: _Board, r: int, chunks: tuple[int, int], flight, clock) -> str | None:
        """Lock held. The I/O side's claim of dynamic-meet chunk ``chunks[0]``: "load" (claimed), "shared" (the
        cell meet's chunk, first visit), "skip" (the compute side got there first, or the shared chunk was
        visited), or None: near the meet with a read of this request still in flight — land it, then decide."""
        c0, c1 = chunks
        if (board.hi - board.lo <= 2 or board.shared is not None) and any(f[0] == r for f in flight):
            return None
        if job.plan.cell_meet and job.link is None and (
                board.shared == c0 or (board.shared is None and c0 == board.lo == board.hi - 1)):
            board.shared = c0
            first = not board.shared_visited[1]
            board.shared_visited[1] = True
            return "shared" if first else "skip"
        if c0 < board.lo or board.shared is not None:
            return "skip"
        assert c1 == board.hi and c1 - c0 == 1, "dynamic loads must walk backward by one chunk"
        board.hi = c0
        board.in_flight += 1
        if board.io_started is None:
            board.io_started = clock()
        return "load"

    def _io_loop(self, jobs, boards, io_order, cond, io_events, io_error, io_done, clock) -> None:
        """Reads run ahead: up to ``depth`` loads are in the pool at once (``depth`` = its devices, at least 2), so a
        device that finished its share of one read starts on the next instead of idling while another finishes
        (a read of one layer's records, or of an odd number of them, is never spread evenly). Loads land — are
        written into the cache and become visible — in order. A dynamic-meet load is claimed when it is issued;
        near the meet (two unclaimed chunks or fewer) claims wait until nothing is in flight, so running ahead
        never takes a chunk from the compute side."""
        depth = max(2, getattr(self.pool, "parallelism", 1))
        flight: deque = deque()          # (r, chunks, layers, keys, future, issued)
        landed = [0.0]                   # when the last load landed: the next one's busy time starts there

        def land() -> None:
            r, (c0, c1), (l0, l1), wanted, fut, issued = flight.popleft()
            job, board = jobs[r], boards[r]
            C = job.plan.chunk_tokens
            got = fut.result()
            failures: dict[int, int] = {}
            for key in wanted:  # hot path: one copy per record into the cache (dtype cast included)
                tensor = got.get(key)
                if tensor is None:
                    i, layer = key.tokens[0] // C, key.layers[0] - job.plan.layer_offset
                    failures[i] = min(failures.get(i, layer), layer)
                else:
                    job.cache.write_block(tensor, key.tokens, key.layers)
            end = clock()
            start, landed[0] = max(issued, landed[0]), end
            io_events.append((r, Event("load", (c0 * C, c1 * C), (l0, l1), start, end)))
            with cond:
                for i, layer in failures.items():
                    board.failed[i] = min(board.failed.get(i, layer), layer)
                if job.plan.dynamic_meet:
                    board.in_flight -= 1
                    board.io_loaded += 1       # reads in flight together land together: pace = mean busy / chunk
                    board.io_loaded_s += end - start
                    board.io_chunk_s = board.io_loaded_s / board.io_loaded
                    board.io_started = end if board.in_flight else None
                else:
                    for layer in range(l0, l1):
                        board.pending[layer] -= c1 - c0
                cond.notify_all()

        def drain() -> None:
            while flight:
                land()

        fetcher = ThreadPoolExecutor(depth, thread_name_prefix="kvflow-fetch")
        try:
            for r, step in io_order:
                job, board = jobs[r], boards[r]
                (c0, c1), (l0, l1) = step.chunks, step.layers
                if job.plan.dynamic_meet:
                    while True:
                        with cond:
                            claim = self._claim(job, board, r, (c0, c1), flight, clock)
                        if claim is not None:
                            break
                        land()                       # near the meet: let what is in flight land, then decide
                    if claim == "skip":
                        continue
                    if claim == "shared":
                        drain()
                        self._load_shared(job, board, c0, cond, io_events, r, clock)
                        landed[0] = clock()
                        continue
                wanted = [job.keys[i][layer] for i in range(c0, c1) for layer in range(l0, l1)]
                flight.append((r, (c0, c1), (l0, l1), wanted, fetcher.submit(self.pool.get_many, wanted), clock()))
                while len(flight) >= depth:
                    land()
            drain()
        except BaseException as err:  # surfaced on the compute thread
            io_error.append(err)
        finally:
            fetcher.shutdown(wait=True)      # no read outlives the run (the pool unpins when each ends)
            with cond:
                io_done.set()
                cond.notify_all()
