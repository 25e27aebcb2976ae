"""Run plans: compute on the calling thread, I/O on its own thread, truly overlapped (torch kernels and the
pool's reads release the GIL). One mechanism runs one request or a whole batch; it has no policy — the
order of work on each side comes with the plan(s).

    compute thread:  (request, step) items in order (compute.py); a request's fallback, tail + query as soon as
                     its grid is whole (finish.py), LM heads of requests served together in one pass
    I/O thread:      (request, load) items in order, reads running ahead (io.py)
    board:           per request, what the two threads share: claims, pending loads, failures, filled cells
                     (board.py, cells.py); lock, clock, stop flag and deadlines in sync.py

A cell that fails to load (missing, evicted, corrupt — the pool returns None) is never served: its chunk is
recomputed, in chunk order, once every earlier chunk of that request is complete, so the cache stays exact.
Before a query runs, every cell of its grid must have been filled exactly once (an AssertionError names the cell).

A job with a ``StageLink`` (kvflow.pipeline.stage_link) is one pipeline stage: its plan covers model layers
[offset, offset + n), its compute steps take their input hidden states from the link (stored boundary activations,
the previous stage) instead of the embeddings, full-stage outputs go to the link, and the executor restores the
grid only — the tail + query pass through the pipeline belongs to the caller (kvflow.pipeline). Inputs that never
come stop the compute side; its chunks are left to I/O, and a chunk that neither side can fill is reported
(``complete_chunks``), never faked.

Failure: an exception on the compute side stops the I/O thread (between reads; pending reads cancelled) and joins
it before it propagates; an error on the I/O side surfaces on the compute thread. A wait with nothing happening for
``ExecutorConfig.stall_timeout_s`` is a StallError naming what stalled — never a hang.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from kvflow.chunks.keys import ChunkKey
from kvflow.executor.board import Board
from kvflow.executor.compute import ComputeSide
from kvflow.executor.config import ExecutorConfig
from kvflow.executor.finish import Finish
from kvflow.executor.io import IOSide
from kvflow.executor.job import Execution, Job
from kvflow.executor.sync import StallError, Sync
from kvflow.executor.transfer import for_device
from kvflow.model.runner import KVCache, ModelRunner
from kvflow.planner.plan import ComputeStep, LoadStep, Plan
from kvflow.threads import single_threaded_run

if TYPE_CHECKING:
    from kvflow.pipeline.stage_link import StageLink

log = logging.getLogger("kvflow.executor")


class Executor:
    def __init__(self, runner: ModelRunner, pool, config: ExecutorConfig | None = None):
        self.runner, self.pool = runner, pool
        self.config = config or ExecutorConfig.load()
        self.transfer = for_device(runner.device)      # one per executor: its staging buffers are reused

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
            assert job.link is None or not (job.plan.dynamic_meet and job.plan.pipelined_query), \
                "a pipeline stage runs no query: its meet has no last group"
            assert job.plan.layer_offset + job.plan.num_layers <= self.runner.num_layers
            job.cache = job.cache or self.runner.new_cache(job.plan.context_len + job.plan.query_len)
        boards = [Board(job.plan, cell_meet=job.plan.cell_meet and job.link is None) for job in jobs]
        for r, _ in compute_order:
            boards[r].compute_left += 1
        sync = Sync(self.config.stall_timeout_s, time.perf_counter() if origin is None else origin,
                    transfer=self.transfer)
        compute = ComputeSide(self.runner, sync)
        finish = Finish(self.runner, sync, compute)
        io = threading.Thread(target=single_threaded_run(IOSide(self.pool, sync, jobs, boards).run), args=(io_order,),
                              name="kvflow-io", daemon=True)
        io.start()
        try:
            results = self._compute_side(jobs, boards, compute_order, query_order, sync, compute, finish)
        except BaseException:
            self._stop_io(io, sync)
            self.transfer.staging.forget()
            raise
        io.join(2 * sync.stall_s)
        if not io.is_alive():
            self.transfer.staging.forget()
        else:
            self._stop_io(io, sync)
            raise StallError(f"executor stalled: the I/O thread did not end within {2 * sync.stall_s:g} s after "
                             f"every request was served (executor.stall_timeout_s = {sync.stall_s:g})")
        if sync.io_error:
            raise sync.io_error[0]
        for r, event in sync.io_events:
            boards[r].events.append(event)
        out = []
        for r in range(len(jobs)):
            ex = results[r]
            ex.timeline = sorted(boards[r].events, key=lambda e: e.start)
            ex.timings.io_busy_s = sum(e.end - e.start for e in ex.timeline if e.kind == "load")
            out.append(ex)
        return out

    @staticmethod
    def _stop_io(io: threading.Thread, sync: Sync) -> None:
        """The compute side failed: the I/O thread ends at its next read (a read in flight ends within its own
        deadline) and is joined, so no thread of this run is left behind."""
        with sync.cond:
            sync.stop.set()
            sync.notify()
        io.join(2 * sync.stall_s)
        if io.is_alive():
            log.warning("executor: the I/O thread did not stop within %g s; left behind as a daemon", 2 * sync.stall_s)

    @staticmethod
    def _compute_side(jobs: list[Job], boards: list[Board], compute_order, query_order, sync: Sync,
                      compute: ComputeSide, finish: Finish) -> dict[int, Execution]:
        results: dict[int, Execution] = {}
        remaining = list(query_order)

        def serve_ready(wait: bool) -> None:
            """Run the queries of the requests whose grids are whole, then their LM heads in one pass; with
            ``wait``, block until all are served."""
            while remaining:
                with sync.cond:
                    ready = [r for r in remaining if boards[r].grid_whole(sync.io_done.is_set())]
                    if not ready:
                        if not wait:
                            return
                        head = remaining[0]
                        if boards[head].pipelines_query():
                            ready = [head]         # pipelined: start now, layer by layer
                        else:
                            w0 = sync.clock()
                            sync.wait(0.05, lambda: f"request {head}'s grid waiting for "
                                                    f"{boards[head].in_flight} load(s) in flight")
                            boards[remaining[0]].blocked += sync.clock() - w0
                            continue
                for r in ready:
                    remaining.remove(r)
                done = [(r, *finish.request(r, jobs[r], boards[r])) for r in ready]
                finish.heads(done, boards)
                results.update((r, ex) for r, ex, _ in done)

        def tell_link(r: int) -> None:
            if jobs[r].link is not None and boards[r].compute_left == 0 and not boards[r].told_link:
                boards[r].told_link = True
                jobs[r].link.grid_computed()

        for r in range(len(jobs)):
            tell_link(r)
        for r, step in compute_order:
            compute.step(jobs[r], boards[r], step)
            tell_link(r)
            serve_ready(wait=False)
        serve_ready(wait=True)
        return results
