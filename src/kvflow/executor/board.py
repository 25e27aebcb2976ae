"""The claims board: one request's state shared by the compute and I/O threads (every method: lock held).

    dynamic meet   unclaimed chunks [lo, hi) — compute claims from lo forward, I/O from hi backward, each skips
                   what the other side already claimed (Cake's run-time meet)
    cell meet      the last unclaimed chunk is shared layer by layer: compute owns [0, sl), I/O owns [sh, L)
    static         cells still to load per layer (a pipelined query runs layer l once layer l is in)
    failed         chunk -> lowest plan layer that neither side filled: the fallback recomputes the chunk
    cells          how often each grid cell was filled (kvflow.executor.cells), checked before the query
"""

from __future__ import annotations

from kvflow.executor.cells import Cells
from kvflow.executor.timeline import Event
from kvflow.planner.plan import Plan


class Board:
    def __init__(self, plan: Plan, cell_meet: bool | None = None):
        self.plan = plan
        self.cell_meet = plan.cell_meet if cell_meet is None else cell_meet   # a stage never shares a chunk
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
        self.io_started: float | None = None           # meet guard: when the load in flight began
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
            return self.grid_loaded() or (io_done and self.compute_left == 0)
        return self.compute_left == 0 and (io_done or self.grid_loaded())

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
        C = plan.chunk_tokens
        speed = self.compute_actual / self.compute_predicted if self.compute_predicted else 1.0
        io = self.io_chunk_s
        in_flight = (max(0.0, io - (now - self.io_started)) + io * (self.in_flight - 1)
                     if self.io_started is not None and self.in_flight else 0.0)
        c0, c1 = a // C, b // C
        end = c1
        while end > c0 and speed * sum(plan.chunk_compute_s[c0:end]) > in_flight + io * (self.hi - end + 1):
            end -= 1
        return end * C, end < c1

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
        """The I/O side's claim of dynamic-meet chunk ``chunks[0]``: "load" (claimed), "shared" (the cell meet's
        chunk, first visit), "skip" (the compute side got there first, or the shared chunk was visited), or None:
        near the meet with a read of this request still in flight (``reading``) — land it, then decide."""
        c0, c1 = chunks
        if (self.hi - self.lo <= 2 or self.shared is not None) and reading:
            return None
        if self.cell_meet and (self.shared == c0 or (self.shared is None and c0 == self.lo == self.hi - 1)):
            self.shared = c0
            first = not self.shared_visited[1]
            self.shared_visited[1] = True
            return "shared" if first else "skip"
        if c0 < self.lo or self.shared is not None:
            return "skip"
        assert c1 == self.hi and c1 - c0 == 1, "dynamic loads must walk backward by one chunk"
        self.hi = c0
        self.in_flight += 1
        if self.io_started is None:
            self.io_started = now
        return "load"

    def landed(self, chunks: tuple[int, int], layers: tuple[int, int], misses: list[tuple[int, int]],
               start: float, end: float) -> None:
        """A load of chunks x layers landed; ``misses`` are its (chunk, plan layer) cells the pool did not have."""
        (c0, c1), (l0, l1) = chunks, layers
        self.cells.fill(chunks, layers)
        for i, layer in misses:
            self.cells.unfill(i, layer)
            self.fail_cell(i, layer)
        if self.plan.dynamic_meet:
            self.in_flight -= 1
            self.io_loaded += 1       # reads in flight together land together: pace = mean busy / chunk
            self.io_loaded_s += end - start
            self.io_chunk_s = self.io_loaded_s / self.io_loaded
            self.io_started = end if self.in_flight else None
        else:
            for layer in range(l0, l1):
                self.pending[layer] -= c1 - c0
