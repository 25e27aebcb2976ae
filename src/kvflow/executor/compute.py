"""The compute side: grid compute steps on the calling thread, clipped and claimed on the board for a dynamic meet,
the cell meet's shared chunk bottom-up, and a pipeline stage's inputs (with a deadline: a stage input that does
not come is a StallError, not a hang)."""

from __future__ import annotations

import threading

import torch

from kvflow.executor.board import Board
from kvflow.executor.job import Job
from kvflow.executor.sync import StallError, Sync
from kvflow.executor.timeline import Event
from kvflow.model.runner import ModelRunner
from kvflow.planner.plan import ComputeStep
from kvflow.threads import single_threaded_run


class ComputeSide:
    def __init__(self, runner: ModelRunner, sync: Sync):
        self.runner, self.sync = runner, sync

    def step(self, job: Job, board: Board, step: ComputeStep) -> None:
        """One grid compute step. Dynamic meet: clipped at the I/O pointer and claimed before it runs — for a stage
        only once its inputs are in hand, so a wait never strands claimed chunks."""
        plan, C, sync = job.plan, job.plan.chunk_tokens, self.sync
        if plan.cell_meet and job.link is None:
            return self._cell_meet_step(job, board, step)
        (a, b), layers = step.tokens, step.layers
        last = False                                 # the meet guard shortened this step: the compute side's last
        with sync.cond:
            board.compute_left -= 1
            if plan.dynamic_meet:
                assert a // C == board.lo or board.lo >= board.hi or board.compute_stopped, \
                    "dynamic compute steps must be contiguous"
                b, last = board.guard(a, min(b, board.hi * C), sync.clock())
            if board.compute_stopped or b <= a:      # inputs ran out / the I/O side got here first
                if board.compute_stopped and not plan.dynamic_meet:
                    board.fail_chunks(a // C, b // C, layers[0])
                board.compute_stopped = board.compute_stopped or last
                sync.notify()
                return
            if job.link is None and plan.dynamic_meet:
                board.lo = b // C
        if job.link is None:
            hidden = self.runner.embed(job.token_ids[a:b])
        else:
            hidden = self.stage_inputs(job, board, a, b)
            got = 0 if hidden is None else hidden.shape[1]
            with sync.cond:
                if got < b - a:
                    board.compute_stopped = True
                    if not plan.dynamic_meet:
                        board.fail_chunks((a + got) // C, b // C, layers[0])
                b = a + got
                if plan.dynamic_meet:
                    b, cut = board.guard(a, min(b, board.hi * C), sync.clock())
                    last = last or cut
                    if b > a:
                        board.lo = b // C
                if b <= a:
                    board.compute_stopped = board.compute_stopped or last
                    sync.notify()
                    return
            hidden = hidden[:, :b - a]
        out = self.grid_step(job, board, (a, b), layers, hidden)
        if job.link is not None and layers == (0, plan.num_layers):
            job.link.output(a, out)
        with sync.cond:
            board.compute_stopped = board.compute_stopped or last
            sync.notify()

    def _cell_meet_step(self, job: Job, board: Board, step: ComputeStep) -> None:
        """Dynamic meet that never claims the last unclaimed chunk whole: once one chunk is left, it is shared
        (compute bottom-up, I/O top-down). Chunks below it were all recomputed here, so each of its layers can
        be; the I/O side needs nothing. In a pipelined meet the claim may stop short for good (the board's stop
        point): the I/O side then loads every chunk left as the last group, and nothing is shared."""
        C, sync = job.plan.chunk_tokens, self.sync
        (a, b), layers = step.tokens, step.layers
        end = 0
        with sync.cond:
            board.compute_left -= 1
            if a // C == board.lo and board.shared is None:
                c1 = board.compute_claim(min(b // C, board.hi - (1 if board.sharing() else 0)), sync.clock())
                end = c1 * C if c1 > a // C else 0
        if end:
            self.grid_step(job, board, (a, end), layers, self.runner.embed(job.token_ids[a:end]))
        with sync.cond:
            if board.sharing() and board.shared is None and board.hi - board.lo == 1:
                board.shared = board.lo
            mine = board.shared is not None and not board.shared_visited[0]
            board.shared_visited[0] = board.shared_visited[0] or mine
            sync.notify()
        if not mine:
            return
        s = board.shared
        hidden = self.runner.embed(job.token_ids[s * C:(s + 1) * C])
        while True:
            with sync.cond:
                if board.sl >= board.sh:
                    sync.notify()
                    return
                layer = board.sl
                board.sl += 1
            hidden = self.grid_step(job, board, (s * C, (s + 1) * C), (layer, layer + 1), hidden)

    def grid_step(self, job: Job, board: Board, tokens: tuple[int, int], layers: tuple[int, int],
                  hidden: torch.Tensor) -> torch.Tensor:
        transfer = self.sync.transfer
        mark = transfer.mark()
        out = self.runner.run_layers(job.cache, hidden, tokens[0], job.model_layers(layers))
        start, end = transfer.span(mark, transfer.mark())     # device time on CUDA (executor/transfer.py)
        with self.sync.cond:
            board.computed(tokens, layers, start, end)
        return out

    def stage_inputs(self, job: Job, board: Board, a: int, b: int) -> torch.Tensor | None:
        """The link's inputs for tokens [a, b), asked on a helper thread so the wait has a deadline."""
        clock = self.sync.clock
        w0 = clock()
        hidden = self._within(lambda: job.link.inputs(a, b),
                              f"the stage input (hidden states of tokens {a}-{b} entering model layer "
                              f"{job.plan.layer_offset})")
        w1 = clock()
        if w1 - w0 > 1e-3:
            board.blocked += w1 - w0
            board.events.append(Event("wait", (a, b), (0, 0), w0, w1))
        return hidden

    def _within(self, call, what: str):
        box: list = []

        def run() -> None:
            try:
                box.append((True, call()))
            except BaseException as err:  # re-raised on the compute thread
                box.append((False, err))

        helper = threading.Thread(target=single_threaded_run(run), name="kvflow-inputs", daemon=True)
        helper.start()
        helper.join(self.sync.stall_s)
        if helper.is_alive():
            raise StallError(f"executor stalled: {what} did not come within {self.sync.stall_s:g} s "
                             f"(executor.stall_timeout_s)")
        ok, value = box[0]
        if not ok:
            raise value
        return value
