"""The claims board: one request's state shared by the compute and I/O threads (every method: lock held).

    dynamic meet   unclaimed chunks [lo, hi) — compute claims from lo forward, I/O from hi backward, each skips
                   what the other side already claimed (Cake's run-time meet)
    cell meet      the last unclaimed chunk is shared layer by layer: compute owns [0, sl), I/O owns [sh, L)
    last group     (a pipelined meet) once the compute side's boundary is final, every unclaimed chunk claimed by the
                   I/O side at once and loaded layer by layer bottom up; the query runs layer l once layer l is in
                   (kvflow.planner.group decides when)
    pending        cells claimed by or planned for the I/O side still to land, per layer (a pipelined query runs
                   layer l once layer l is in)
    failed         chunk -> lowest plan layer that neither side filled: the fallback recomputes the chunk
    cells          how often each grid cell was filled (kvflow.executor.cells), checked before the query
"""

from __future__ import annotations

from itertools import accumulate

from kvflow.executor.cells import Cells
from kvflow.executor.timeline import Event
from kvflow.planner.group import MeetState, stop_point
from kvflow.planner.plan import Plan


class Board:
    def __init__(self, plan: Plan, cell_meet: bool | None = None):
        self.plan = plan
        self.cell_meet = plan.cell_meet if cell_meet is None else cell_meet   # a stage never shares a chunk
        self.lo, self.hi = 0, plan.num_chunks          # dynamic meet: unclaimed chunks are [lo, hi)
        self.pending = [0] * plan.num_layers           # cells still to land, per layer: static as planned, dynamic
        for step in () if plan.dynamic_meet else plan.loads:     # as claimed
            for layer in range(*step.layers):
                self.pending[layer] += step.chunks[1] - step.chunks[0]
        self.in_flight = 0                             # dynamic: loads claimed by I/O, not yet written ...
        self.in_flight_chunks = 0.0                    # ... and what they hold, in whole chunks
        self.compute_left = 0                          # compute-order items not yet run or skipped
        self.compute_stopped = False                   # inputs ran out / the meet guard ended the compute side
        self.compute_actual = self.compute_predicted = 0.0   # meet guard: measured vs predicted compute seconds
        self.io_chunk_s = 0.0                          # meet guard: I/O seconds per chunk so far
        self.io_loaded, self.io_loaded_s = 0, 0.0      # ... chunks landed, I/O busy seconds for them
        self.io_started: float | None = None           # meet guard: when the load in flight began
        self.compute_free = 0.0                        # last group: when the compute side's claimed step should end
        self.prefix = list(accumulate(plan.chunk_compute_s, initial=0.0))
        self.final = False                             # last group: the compute side claims no more chunks ...
        self.group: tuple[int, int] | None = None     # ... and the I/O side claimed the rest as this group
        self.told_link = False
        self.shared: int | None = None                 # cell meet: the chunk both sides share, layer by layer ...
        self.sl, self.sh = 0, plan.num_layers          # ... compute owns layers [0, sl), I/O owns [sh, L)
        self.shared_visited = [False, False]           # ... compute / I/O side has worked on it
        self.failed: dict[int, int] = {}               # chunk -> lowest failed (plan) layer
        self.cells = Cells(plan.num_chunks, plan.num_layers)
        self.compute_busy = 0.0
        self.grid_compute_end = 0.0
        self.blocked = 0.0
        self.events: list[Event] = []

    # -- state --------------------------------------------------------------------------------------------------
    def grid_loaded(self) -> bool:
        """Every load this request will get has landed (its compute items may still be queued)."""
        if self.plan.dynamic_meet:
            return self.in_flight == 0 and (self.lo >= self.hi or (self.shared is not None and self.sl >= self.sh))
        return not any(self.pending)

    def grid_whole(self, io_done: bool) -> bool:
        """Every cell is in (or the I/O thread ended, so failures/errors show). Dynamic: every chunk claimed and
        no load in flight (compute steps finish before this is asked). Static: all compute items run too."""
        if self.plan.dynamic_meet:
            return self.grid_loaded() or (io_done and self.compute_left == 0) or self.pipelines_query()
        return self.compute_left == 0 and (io_done or self.grid_loaded())

    def pipelines_query(self) -> bool:
        """The query may start now and run layer by layer, each layer waiting for its cells (``layer_in``): a static
        pipelined plan, or a meet whose last group is claimed and whose every chunk is claimed."""
        if self.plan.dynamic_meet:
            return self.group is not None and self.lo >= self.hi
        return self.plan.pipelined_query

    def layer_in(self, layer: int) -> bool:
        return self.pending[layer] == 0

    def sharing(self) -> bool:
        """The cell meet applies: the last unclaimed chunk will be shared (the boundary did not become final)."""
        return self.cell_meet and not self.final

    def stop_point(self, now: float, compute_free: float) -> int | None:
        """Where the compute side's claims should end (kvflow.planner.group), None: keep meeting."""
        plan = self.plan
        if self.final or not (plan.pipelined_query and plan.chunk_compute_s and plan.query_s):
            return None
        return stop_point(MeetState(self.prefix, self.speed(), self.lo, self.hi, compute_free, now + self.io_ahead(now),
                                    self.io_chunk_s or plan.chunk_io_s, *plan.query_s, plan.num_layers))

    def failed_at_or_below(self, layer: int) -> bool:
        return any(low <= layer for low in self.failed.values())

    def fail_chunks(self, c0: int, c1: int, layer: int) -> None:
        """Chunks whose cells from ``layer`` up will not be computed: the fallback must fill them."""
        for i in range(c0, c1):
            self.fail_cell(i, layer)

    def fail_cell(self, chunk: int, layer: int) -> None:
        self.failed[chunk] = min(self.failed.get(chunk, layer), layer)

    # -- compute side -------------------------------------------------------------------------------------------
    def guard(self, a: int, b: int, now: float) -> tuple[int, bool]:
        """Dynamic meet with the plan's guard: shorten the step [a, b) while its last chunk would be recomputed
        later than the I/O side could load it (after the chunks above it and the load in flight). Predictions are
        scaled by the compute speed measured so far; the I/O side's pace is its mean per chunk. Until a load has
        landed the plan stands. Returns (end, shortened: the compute side's last step)."""
        plan = self.plan
        if not (plan.chunk_compute_s and plan.chunk_io_s and self.io_chunk_s) or b <= a:
            return b, False
        C, speed = plan.chunk_tokens, self.speed()
        io = self.io_chunk_s
        in_flight = self.io_ahead(now)
        c0, c1 = a // C, b // C
        end = c1
        while end > c0 and speed * sum(plan.chunk_compute_s[c0:end]) > in_flight + io * (self.hi - end + 1):
            end -= 1
        return end * C, end < c1

    def speed(self) -> float:
        """Measured ÷ predicted compute seconds of this request's grid steps so far (1 before the first)."""
        return self.compute_actual / self.compute_predicted if self.compute_predicted else 1.0

    def io_ahead(self, now: float) -> float:
        """Seconds until the I/O side is done with what it has in flight (at its mean pace per chunk)."""
        if self.io_started is None or not self.in_flight:
            return 0.0
        io = self.io_chunk_s or self.plan.chunk_io_s
        return max(0.0, io - (now - self.io_started)) + io * max(0.0, self.in_flight_chunks - 1)

    def compute_claim(self, c1: int, now: float) -> int:
        """The compute side's claim of chunks [lo, c1), starting now; shortened at the stop point, which makes it the
        compute side's last (a pipelined meet, kvflow.planner.group). Returns the new ``lo``."""
        if self.final:
            return self.lo
        m = self.stop_point(now, now)
        if m is not None and m <= c1:
            c1, self.final = max(m, self.lo), True
        if c1 > self.lo:
            if self.plan.chunk_compute_s:
                self.compute_free = now + self.speed() * (self.prefix[c1] - self.prefix[self.lo])
            self.lo = c1
        return self.lo

    def computed(self, tokens: tuple[int, int], layers: tuple[int, int], start: float, end: float) -> None:
        """A grid compute step ran: its cells are filled, its time counts (and feeds the meet guard)."""
        C = self.plan.chunk_tokens
        assert tokens[0] % C == 0 and tokens[1] % C == 0, f"grid step tokens {tokens} are not whole chunks"
        c0, c1 = tokens[0] // C, tokens[1] // C
        self.cells.fill((c0, c1), layers)
        if self.plan.chunk_compute_s:
            self.compute_actual += end - start
            self.compute_predicted += sum(self.plan.chunk_compute_s[c0:c1])
        self.compute_busy += end - start
        self.grid_compute_end = end
        self.events.append(Event("compute", tokens, layers, start, end))

    # -- I/O side -----------------------------------------------------------------------------------------------
    def claim(self, chunks: tuple[int, int], reading: bool, now: float) -> str | None:
        """The I/O side's claim of dynamic-meet chunk ``chunks[0]``: "load" (claimed), "group" (the boundary is final:
        every unclaimed chunk claimed as the last group, ``self.group``), "shared" (the cell meet's chunk, first
        visit), "skip" (claimed already — by the compute side, the group, or the shared chunk visited), or None: near
        the meet or after the group with a read of this request still in flight (``reading``) — land it, then
        decide."""
        c0, c1 = chunks
        if (self.hi - self.lo <= 2 or self.shared is not None or self.group is not None) and reading:
            return None
        if self.shared is None and not self.final and self.lo <= c0 < self.hi:
            m = self.stop_point(now, max(now, self.compute_free))
            self.final = m is not None and m <= self.lo
        if self.sharing() and (self.shared == c0 or (self.shared is None and c0 == self.lo == self.hi - 1)):
            self.shared = c0
            first = not self.shared_visited[1]
            self.shared_visited[1] = True
            return "shared" if first else "skip"
        if c0 < self.lo or c0 >= self.hi or self.shared is not None:
            return "skip"
        assert c1 == self.hi and c1 - c0 == 1, "dynamic loads must walk backward by one chunk"
        got = self.hi - self.lo if self.final else 1
        if self.final:
            self.group = (self.lo, self.hi)
        self.hi -= got
        self.in_flight += self.plan.num_layers if self.final else 1
        self.in_flight_chunks += got
        self.pending = [n + got for n in self.pending]
        if self.io_started is None:
            self.io_started = now
        return "group" if self.final else "load"

    def landed(self, chunks: tuple[int, int], layers: tuple[int, int], misses: list[tuple[int, int]],
               start: float, end: float) -> None:
        """A load of chunks x layers landed; ``misses`` are its (chunk, plan layer) cells the pool did not have."""
        (c0, c1), (l0, l1) = chunks, layers
        self.cells.fill(chunks, layers)
        for i, layer in misses:
            self.cells.unfill(i, layer)
            self.fail_cell(i, layer)
        for layer in range(l0, l1):
            self.pending[layer] -= c1 - c0
        if self.plan.dynamic_meet:
            held = (c1 - c0) * (l1 - l0) / self.plan.num_layers     # whole chunks' worth
            self.in_flight -= 1
            self.in_flight_chunks -= held
            self.io_loaded += held    # reads in flight together land together: pace = mean busy / chunk
            self.io_loaded_s += end - start
            self.io_chunk_s = self.io_loaded_s / self.io_loaded
            self.io_started = end if self.in_flight else None
