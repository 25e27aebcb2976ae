"""The finish of one request, on the compute thread once its grid is whole: fallback recompute of the chunks that
failed, the check that every grid cell was filled exactly once (kvflow.executor.cells), tail + query (layer by
layer for a static pipelined plan and for a meet with a last group, waiting only for each layer's cells), then — for
every request served together — one LM-head pass."""

from __future__ import annotations

import torch

from kvflow.executor.board import Board
from kvflow.executor.compute import ComputeSide
from kvflow.executor.job import Execution, Job
from kvflow.executor.sync import Sync
from kvflow.executor.timeline import Event, Timings
from kvflow.model.runner import ModelRunner


class Finish:
    def __init__(self, runner: ModelRunner, sync: Sync, compute: ComputeSide):
        self.runner, self.sync, self.compute = runner, sync, compute

    def request(self, r: int, job: Job, board: Board) -> tuple[Execution, torch.Tensor | None]:
        """Recompute failed chunks if any, run tail + query. Returns the execution and the query's last hidden
        states (None for a pipeline stage); the LM head runs in :meth:`heads`."""
        plan, runner, sync, L, C = job.plan, self.runner, self.sync, job.plan.num_layers, job.plan.chunk_tokens
        clock = sync.clock
        s0, s1 = plan.suffix
        pieces = [(a, min(a + plan.step_tokens, s1)) for a in range(s0, s1, plan.step_tokens)]
        hidden = {a: runner.embed(job.token_ids[a:b]) for a, b in pieces} if job.link is None else {}
        first_layer = 0
        with sync.cond:
            pipelined = board.pipelines_query() and job.link is None
        if pipelined:
            for layer in range(L):
                w0 = clock()
                with sync.cond:
                    sync.wait_for(lambda: board.layer_in(layer),
                                  lambda: f"request {r}'s query waiting for the loads of layer {layer}")
                    failed = board.failed_at_or_below(layer) or bool(sync.io_error)
                    if not failed:
                        board.cells.check(layers=(layer, layer + 1))
                board.blocked += clock() - w0
                if failed:
                    break
                self.query(job, board, hidden, pieces, (layer, layer + 1))
                first_layer = layer + 1
        w0 = clock()
        with sync.cond:
            sync.wait_for(board.grid_loaded, lambda: f"request {r}'s grid waiting for {board.in_flight or 'its'} "
                                                     f"load{'s' if board.in_flight != 1 else ''} in flight")
        board.blocked += clock() - w0
        if sync.io_error:
            raise sync.io_error[0]
        restore_end = clock()
        fallback = sorted(board.failed)
        complete = plan.num_chunks
        for i in fallback:  # earlier chunks are complete: recompute the whole chunk, in order
            if job.link is None:
                inputs = runner.embed(job.token_ids[i * C:(i + 1) * C])
            else:
                inputs = self.compute.stage_inputs(job, board, i * C, (i + 1) * C)
                if inputs is None or inputs.shape[1] < C:
                    complete = i       # no input for this chunk: the pipeline fills it from the previous stage
                    break
            mark = sync.transfer.mark()
            runner.run_layers(job.cache, inputs, i * C, job.model_layers((0, L)))
            start, end = sync.transfer.span(mark, sync.transfer.mark())
            with sync.cond:
                board.cells.refill_row(i)
            board.compute_busy += end - start
            board.events.append(Event("fallback", (i * C, (i + 1) * C), (0, L), start, end))
            restore_end = end
        with sync.cond:
            board.cells.check(chunks=(0, complete))
        timings = Timings(ttft_s=restore_end if job.link is not None else 0.0, restore_s=restore_end,
                          grid_compute_end_s=board.grid_compute_end, compute_busy_s=board.compute_busy,
                          io_busy_s=0.0, blocked_io_s=board.blocked, lower_bound_s=plan.lower_bound_s or 0.0,
                          predicted_ttft_s=plan.predicted.ttft_s if plan.predicted else 0.0)
        execution = Execution(job.cache, None, [], timings, fallback, complete)
        if job.link is not None:
            return execution, None
        if first_layer < L:
            self.query(job, board, hidden, pieces, (first_layer, L))
        return execution, hidden[pieces[-1][0]]

    def heads(self, done: list[tuple[int, Execution, torch.Tensor | None]], boards: list[Board]) -> None:
        """The LM head of every request just served, in one pass over its weights (memory-bound for one token)."""
        done = [(r, ex, h) for r, ex, h in done if h is not None]
        if not done:
            return
        transfer = self.sync.transfer
        mark = transfer.mark()
        logits = self.runner.logits_many([h for _, _, h in done])     # on the host when it returns
        start, end = transfer.span(mark, transfer.mark())
        end = max(end, self.sync.clock())
        for (r, ex, _), lg in zip(done, logits):
            ex.logits, ex.timings.ttft_s = lg, end
            s1, layers = ex.cache.capacity, ex.cache.num_layers
            boards[r].events.append(Event("head", (s1 - 1, s1), (layers, layers), start, end))

    def query(self, job: Job, board: Board, hidden: dict, pieces: list[tuple[int, int]],
              layers: tuple[int, int]) -> None:
        """Tail + query through ``layers``, piece by piece (each piece sees the ones before it)."""
        transfer = self.sync.transfer
        mark = transfer.mark()
        for a, _ in pieces:
            hidden[a] = self.runner.run_layers(job.cache, hidden[a], a, job.model_layers(layers))
        start, end = transfer.span(mark, transfer.mark())
        board.events.append(Event("query", (pieces[0][0], pieces[-1][1]), layers, start, end))

