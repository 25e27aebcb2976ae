"""Pipeline stages (DESIGN.md §2.1, GPU dimension): one two-pointer plan per stage, the S-stage bound T*, balance.

    stage g owns layers [b_g, b_{g+1})        b_0 = 0 < b_1 < ... < b_S = L; each stage has its own link
    ─────────────────────────────────────────────────────────────────────────────────────────────────
    independent   compute ─▶ early chunks of its layers, from the stored boundary activations at b_g
                             (embeddings for g = 0); each recomputed chunk first loads its activation
                  I/O     ◀─ late chunks of its own KV            ... every stage at once, then
                  tail + query: stage 0 ─▶ stage 1 ─▶ ... ─▶ stage S-1 ─▶ logits
    sequential    stage g's compute waits for stage g-1's recomputed hidden states (an engine without
                  boundary activations); its I/O loads its own KV meanwhile. Same per-stage strategy.

A stage's plan is an ordinary Plan over its own n_g layers (``layer_offset`` = b_g), so the executor runs it like
any other. Policy lives here: which inputs a stage uses, how far its compute may go (only chunks whose activation
is stored), its predicted time and bound, and whether the split of layers over stages is balanced.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from kvflow.cost.model import CostModel
from kvflow.errors import KVFlowError
from kvflow.planner.plan import Plan, Prediction
from kvflow.planner.bound import balance_point, model_cells
from kvflow.planner.predict import IOModel
from kvflow.planner.simulate import SimResult, simulate_plan
from kvflow.planner.strategies import Planner, PlannerConfig, Request

MODES = ("independent", "sequential")
STAGE_STRATEGIES = ("token", "cake", "load")   # two pointers with a run-time meet (inputs may run out), or load all


def even_split(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, sizes differing by at most one (earlier stages get the extra layers)."""
    if not 1 <= stages <= num_layers:
        raise KVFlowError(f"cannot split {num_layers} layers into {stages} stages")
    q, r = divmod(num_layers, stages)
    edges = [0]
    for g in range(stages):
        edges.append(edges[-1] + q + (g < r))
    return list(zip(edges, edges[1:]))


def parse_split(text: str, num_layers: int) -> list[tuple[int, int]]:
    """``"5,3"`` (layers per stage) -> [(0, 5), (5, 8)]; must add up to ``num_layers``."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise KVFlowError(f"bad layer split {text!r}: expected layers per stage, e.g. 5,3") from None
    if any(s < 1 for s in sizes) or sum(sizes) != num_layers:
        raise KVFlowError(f"layer split {text!r} must give every stage >= 1 layer and add up to {num_layers}")
    edges = [0]
    for s in sizes:
        edges.append(edges[-1] + s)
    return list(zip(edges, edges[1:]))


def stage_rate(cost: CostModel, n_layers: int, chunk: int) -> float:
    """KV bytes/s that recomputing ``n_layers`` layers produces at short context (position 0, ``chunk`` tokens):
    rho x this is the stage's own link bandwidth (CostModel.short_context_rate with the stage's layer count)."""
    return chunk * cost.kv_bytes_per_token_layer * n_layers / cost.compute_time(chunk, 0, n_layers)


@dataclass(frozen=True, slots=True)
class StagePlan:
    stage: int
    layers: tuple[int, int]           # model layers [l0, l1)
    inputs: str                       # embed | act (stored boundary activations) | handoff (previous stage)
    plan: Plan                        # over the stage's own layers (plan.layer_offset == layers[0])
    bandwidth: float                  # the stage's own link, bytes/s
    act_chunks: int                   # leading chunks whose compute inputs exist (activations stored / handed off)
    act_bytes: int                    # one activation record, header included (0 for embed)
    bound_s: float                    # T* of this stage alone: its restoration + its share of the query
    predicted_restore_s: float
    predicted_compute_end_s: float
    handoff: bool                     # sequential: send recomputed hidden states to the next stage

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True, slots=True)
class Balance:
    stage_bounds: tuple[float, ...]   # each stage's restoration bound (its slowest part decides)
    imbalance: float                  # slowest / fastest
    unbalanced: bool                  # slowest / fastest above 1 + tolerance
    suggested: tuple[tuple[int, int], ...] | None   # the split whose slowest stage bound is smallest
    suggested_bound_s: float | None

    @property
    def gain(self) -> float:
        """How much faster the slowest stage would be with the suggested split (0: this split is the best)."""
        return 1 - self.suggested_bound_s / max(self.stage_bounds) if self.suggested_bound_s else 0.0

    def describe(self) -> str:
        bounds = " / ".join(f"{b * 1e3:.0f}" for b in self.stage_bounds)
        text = f"stage bounds {bounds} ms, slowest/fastest {self.imbalance:.2f}"
        if self.unbalanced:
            text += " — UNBALANCED"
        if self.suggested is not None:
            sizes = ",".join(str(b - a) for a, b in self.suggested)
            text += (f"; split {sizes} would make the slowest stage {self.gain:.0%} faster" if self.gain > 0.005
                     else "; no split of whole layers balances better")
        return text


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    mode: str
    strategy: str
    context_len: int
    query_len: int
    chunk_tokens: int
    num_chunks: int
    stages: tuple[StagePlan, ...]
    lower_bound_s: float              # T* for these S stages (independent restoration + query through the stages)
    predicted_ttft_s: float
    balance: Balance

    @property
    def suffix(self) -> tuple[int, int]:
        return self.num_chunks * self.chunk_tokens, self.context_len + self.query_len

    def describe(self) -> str:
        lines = [f"{self.mode} pipeline restoration, {len(self.stages)} stage(s), {self.num_chunks} chunks: "
                 f"T* {self.lower_bound_s * 1e3:.0f} ms, predicted TTFT {self.predicted_ttft_s * 1e3:.0f} ms"]
        for s in self.stages:
            lines.append(f"  stage {s.stage}: layers {s.layers[0]}-{s.layers[1] - 1} ({s.num_layers}), link "
                         f"{s.bandwidth / 2**20:,.1f} MiB/s, inputs {s.inputs} ({s.act_chunks} chunks), "
                         f"{s.plan.describe()}, bound {s.bound_s * 1e3:.0f} ms, "
                         f"predicted restore {s.predicted_restore_s * 1e3:.0f} ms")
        lines.append("  " + self.balance.describe())
        return "\n".join(lines)


@dataclass(slots=True)
class PipelinePlanner:
    """Plans every stage of one request. ``cell_bytes``: one KV record (chunk x layer, header included);
    ``act_bytes``: one boundary activation record (chunk x hidden, fp32, header included)."""
    cost: CostModel
    chunk_tokens: int
    cell_bytes: int
    act_bytes: int
    config: PlannerConfig | None = None
    balance_tolerance: float = 0.2    # slowest stage bound more than this above the fastest: unbalanced

    def plan(self, req: Request, stages: list[tuple[int, int]], bandwidths: list[float], mode: str = "independent",
             act_chunks: list[int] | None = None, strategy: str = "token",
             link_bandwidth: Callable[[int], float] | None = None, suggest: bool = True) -> PipelinePlan:
        """``act_chunks[g]``: leading chunks whose activations entering stage g are stored (ignored for g = 0 and
        in sequential mode). ``link_bandwidth(n_layers)``: a stage link's bandwidth as a function of its layer
        count, used to suggest a balanced split (default: the bandwidths given, if all equal). ``suggest=False``
        skips that search (a stage about to restore; ``balance()`` can run it later)."""
        if mode not in MODES:
            raise KVFlowError(f"unknown pipeline mode {mode!r}: use {' or '.join(MODES)}")
        if strategy not in STAGE_STRATEGIES:
            raise KVFlowError(f"unknown stage strategy {strategy!r}: use one of {', '.join(STAGE_STRATEGIES)}")
        assert len(bandwidths) == len(stages) and stages[0][0] == 0
        assert all(a < b for a, b in stages) and all(p[1] == q[0] for p, q in zip(stages, stages[1:]))
        n, C = req.stored_chunks, self.chunk_tokens
        act_chunks = list(act_chunks) if act_chunks is not None else [n] * len(stages)
        suffix = (n * C, req.context_len + req.query_len)
        out: list[StagePlan] = []
        sims: list[SimResult] = []
        for g, (l0, l1) in enumerate(stages):
            io = self._io(bandwidths[g])
            if g == 0:
                inputs, usable, clip, start = "embed", n, n, 0.0
            elif mode == "independent":
                inputs, usable, start = "act", min(act_chunks[g], n), 0.0
                clip = usable
            else:   # the hand-off holds what the previous stage recomputed (known only at run time)
                inputs, usable, clip, start = "handoff", sims[-1].recomputed, n, sims[-1].compute_end_s
            act_s = self.act_bytes / bandwidths[g] if inputs == "act" else 0.0
            plan = self._stage_plan(req, (l0, l1), bandwidths[g], strategy, clip, inputs)
            sim = simulate_plan(plan, self.cost, io.read_time, start_s=start, usable=usable, act_s=act_s,
                                query=False, cell_meet=False) if plan.dynamic_meet else \
                SimResult(io.cells_time(n * (l1 - l0)), start, 0.0, io.cells_time(n * (l1 - l0)), 0,
                          io.cells_time(n * (l1 - l0)))
            sims.append(sim)
            plan = replace(plan, split=tuple([l1 - l0] * sim.recomputed + [0] * (n - sim.recomputed)))
            bound = stage_bound(self.cost, io, n, C, l1 - l0, suffix, self._max_step, act_s,
                                usable if inputs == "act" else n)
            out.append(StagePlan(g, (l0, l1), inputs, plan, bandwidths[g], usable,
                                 self.act_bytes if inputs == "act" else 0, bound, sim.restore_s, sim.compute_end_s,
                                 handoff=mode == "sequential" and g + 1 < len(stages)))
        # the query passes the stages in order; stage g starts it once restored and handed the previous output
        queries = [self.cost.step_time(suffix, s.num_layers) for s in out]
        t = 0.0
        for s, q in zip(out, queries):
            t = max(t, s.predicted_restore_s) + q
        ttft = t + self.cost.head
        bound = max(s.bound_s + sum(queries[s.stage + 1:]) for s in out) + self.cost.head
        out = [replace(s, plan=replace(s.plan, predicted=Prediction(ttft, sim.restore_s, sim.compute_s, sim.io_s),
                                       lower_bound_s=bound)) for s, sim in zip(out, sims)]
        balance = self.balance(req, stages, bandwidths, link_bandwidth, suggest)
        return PipelinePlan(mode, strategy, req.context_len, req.query_len, C, n, tuple(out), bound, ttft, balance)

    # ------------------------------------------------------------------------------------------ balance
    def stage_restore_bound(self, req: Request, layers: tuple[int, int], bandwidth: float) -> float:
        """A stage's restoration bound with every activation stored (embeddings for the first stage)."""
        n, C = req.stored_chunks, self.chunk_tokens
        act_s = self.act_bytes / bandwidth if layers[0] > 0 else 0.0
        return stage_bound(self.cost, self._io(bandwidth), n, C, layers[1] - layers[0], (n * C, n * C),
                           self._max_step, act_s, n)

    def balance(self, req: Request, stages: list[tuple[int, int]], bandwidths: list[float],
                link_bandwidth: Callable[[int], float] | None = None, suggest: bool = True) -> Balance:
        """Restoration bound per stage (layers and bandwidth both count), and the split that minimises the slowest
        one (dynamic programming over contiguous splits; activations priced for every stage but the first)."""
        bounds = tuple(self.stage_restore_bound(req, s, b) for s, b in zip(stages, bandwidths))
        fastest = min(bounds)
        imbalance = max(bounds) / fastest if fastest > 0 else 1.0
        L, S = stages[-1][1], len(stages)
        suggested = best = None
        if link_bandwidth is None and len(set(bandwidths)) == 1:
            link_bandwidth = lambda _n, b=bandwidths[0]: b  # noqa: E731
        if suggest and link_bandwidth is not None and L * L * max(req.stored_chunks, 1) <= 200_000:
            memo: dict[tuple[int, int], float] = {}

            def cost(a: int, b: int) -> float:
                if (a, b) not in memo:
                    memo[(a, b)] = self.stage_restore_bound(req, (a, b), link_bandwidth(b - a))
                return memo[(a, b)]

            # best[g][l]: smallest slowest-bound for layers [0, l) split into g + 1 stages
            best_tab = [[(cost(0, l), [(0, l)]) if l >= 1 else (float("inf"), []) for l in range(L + 1)]]
            for g in range(1, S):
                row = [(float("inf"), [])] * (L + 1)
                for l in range(g + 1, L + 1):
                    for k in range(g, l):
                        prev, split = best_tab[g - 1][k]
                        value = max(prev, cost(k, l))
                        if value < row[l][0]:
                            row[l] = (value, split + [(k, l)])
                best_tab.append(row)
            best, split = best_tab[S - 1][L]
            suggested = tuple(split)
        return Balance(bounds, imbalance, imbalance > 1 + self.balance_tolerance, suggested, best)

    # --------------------------------------------------------------------------------------- internals
    @property
    def _max_step(self) -> int:
        return (self.config or PlannerConfig()).max_step

    def _io(self, bandwidth: float) -> IOModel:
        return IOModel(bandwidth=self.cost.loaded_rate(bandwidth), cell_bytes=self.cell_bytes)

    def _stage_plan(self, req: Request, layers: tuple[int, int], bandwidth: float, strategy: str,
                    usable: int, inputs: str) -> Plan:
        """The ordinary planner over the stage's own layers; compute steps end where inputs end; a stage fed by
        stored activations starts with a one-chunk step (its first activations arrive before the KV loads fill
        the link; the next step's are prefetched meanwhile). Two-pointer plans carry the run-time meet guard."""
        n_layers, C = layers[1] - layers[0], self.chunk_tokens
        io = self._io(bandwidth)
        plan = Planner(self.cost, io, n_layers, C, self.config).plan(strategy, req)
        compute = tuple(s for s in plan.compute if s.tokens[0] < usable * C)
        compute = tuple(replace(s, tokens=(s.tokens[0], min(s.tokens[1], usable * C))) for s in compute)
        if inputs == "act" and compute and compute[0].tokens[1] - compute[0].tokens[0] > C:
            (a, b), first = compute[0].tokens, compute[0]
            compute = (replace(first, tokens=(a, a + C)), replace(first, tokens=(a + C, b))) + compute[1:]
        guard = {}
        if plan.dynamic_meet:
            guard = dict(chunk_compute_s=tuple(self.cost.step_time((i * C, (i + 1) * C), n_layers)
                                               for i in range(req.stored_chunks)),
                         chunk_io_s=io.read_time(n_layers),
                         pipelined_query=False, query_s=())     # a stage runs no query: no last group
        return replace(plan, compute=compute, layer_offset=layers[0], strategy=f"stage-{strategy}", **guard)


def stage_bound(cost: CostModel, io: IOModel, num_chunks: int, chunk_tokens: int, n_layers: int,
                suffix: tuple[int, int], max_step: int, act_s: float, usable: int) -> float:
    """T* of one stage under the cost model, head excluded (:func:`stage_balance` of the model's cells)."""
    return stage_balance(model_cells(cost, num_chunks, chunk_tokens, max_step), n_layers, io.cells_time(1), act_s,
                         usable, cost.step_time(suffix, n_layers), cost.step_time(suffix, 1))


def stage_balance(cells: list[float], n_layers: int, io_per_cell: float, act_s: float, usable: int,
                  query_s: float, query_layer_s: float) -> float:
    """The balance point (planner/bound.py) of one stage: ``cells`` = seconds per cell (one layer) of each chunk,
    latest chunks loaded first, with the stage's inputs priced — every chunk that keeps a recomputed cell first
    moves its activation (``act_s``) over the same link, and chunks from ``usable`` on have no inputs, so they are
    loaded whole. The compute side runs the stage's query (``query_s``), the I/O side is followed by at least its
    last layer (``query_layer_s``). The cost model's T* and the benchmark's measured bound both come from here."""
    n = len(cells)
    ordered = [c for c in reversed(cells) for _ in range(n_layers)]

    def activations(k: int) -> float:   # k cells loaded: chunks below the one cell k belongs to keep inputs
        return 0.0 if k >= len(ordered) else (n - k // n_layers) * act_s

    return balance_point(ordered, io_per_cell, query_s, query_layer_s, activations,
                         min_loaded=max(0, n - usable) * n_layers)
