"""Where the two pointers are decided. Every strategy — kvflow's and the peers' baselines — is a plan
builder here; the executor runs them all the same way, so comparisons differ only in the plan.

    recompute        full prefill in max_step steps (vLLM on a prefix miss)
    load             load every chunk, then prefill the query (LMCache)
    load-layerwise   load layer by layer while the query runs layer by layer (LMCache layer-wise pipelining)
    cake             compute forward / load backward in fixed chunks, meet at run time, no cost model (Cake)
    token            CacheFlow token two-pointer: meet planned from the cost model (sets step sizes), corrected
                     at run time; the I/O side's last chunks loaded as one group layer by layer with the query
                     pipelined behind them, or else the last chunk shared layer by layer
    layer            lower layers recomputed for every token, upper layers loaded; cut from the cost model
    staircase        best token x layer staircase the cost model finds
    cacheflow        of token / layer / staircase / load-layerwise / recompute, the plan with the smallest worst-case
                     regret when compute and I/O run at other speeds than the model says (``compute_band``,
                     ``io_band``): a dynamic meet corrects itself at run time, a static split pays the whole
                     error, so a static plan wins only where it is faster under every speed in the band
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvflow.config import check, load_section
from kvflow.cost.model import CostModel
from kvflow.errors import KVFlowError
from kvflow.planner.plan import ComputeStep, LoadStep, Plan
from kvflow.planner.predict import (IOModel, compute_steps, layer_major_loads, lower_bound, predict, predicted_meet,
                                    query_time)

STRATEGIES = ("recompute", "load", "load-layerwise", "cake", "token", "layer", "staircase", "cacheflow")


@dataclass(slots=True)
class PlannerConfig:
    max_step: int = 1024          # largest compute step in tokens (bigger steps amortise per-call overhead)
    near_meet_chunks: int = 2     # `token` uses single-chunk steps this close to the predicted meet
    # cacheflow's choice must hold when the machine runs this much faster or slower than the (calibrated) model:
    # compute speed in [1/(1+c), 1+c], I/O in [1/(1+i), 1+i] (a profile made on a busy machine is off by tens of %)
    compute_band: float = 0.35
    io_band: float = 0.15

    def validate(self) -> None:
        check(self.max_step >= 1, f"planner.max_step must be >= 1, got {self.max_step}")
        check(self.near_meet_chunks >= 0, "planner.near_meet_chunks must be >= 0")
        for name in ("compute_band", "io_band"):
            value = getattr(self, name)
            check(math.isfinite(value) and 0 <= value <= 4, f"planner.{name} must be in [0, 4], got {value}")

    @classmethod
    def load(cls, data=None) -> "PlannerConfig":
        """From a config file's ``planner`` section (or none) + ``KVFLOW_PLANNER_*`` overrides, validated."""
        return load_section(cls, "planner", data)


@dataclass(frozen=True, slots=True)
class Request:
    """What the planner needs to know about one restoration."""
    context_len: int
    query_len: int
    stored_chunks: int     # full chunks of the context found in the pool (a prefix)


class Planner:
    def __init__(self, cost: CostModel, io: IOModel, num_layers: int, chunk_tokens: int,
                 config: PlannerConfig | None = None):
        self.cost, self.io, self.L, self.C = cost, io, num_layers, chunk_tokens
        self.config = config or PlannerConfig.load()

    # ----------------------------------------------------------------------------------------- API
    def plan(self, strategy: str, req: Request) -> Plan:
        builder = getattr(self, "_" + strategy.replace("-", "_"), None)
        if strategy not in STRATEGIES or builder is None:
            raise KVFlowError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
        plan = builder(req)
        return self.finish(plan)

    def finish(self, plan: Plan) -> Plan:
        bound = lower_bound(self.cost, self.io, plan.num_chunks, self.C, self.L, plan.suffix, self.config.max_step)
        return replace(plan, predicted=predict(plan, self.cost, self.io), lower_bound_s=bound)

    def bound(self, req: Request) -> float:
        """T* of ``req`` under this planner's models (``lower_bound``): no plan of any strategy is predicted sooner,
        so a caller comparing a restoration with other ways can skip planning when T* already loses."""
        n = req.stored_chunks
        return lower_bound(self.cost, self.io, n, self.C, self.L, (n * self.C, req.context_len + req.query_len),
                           self.config.max_step)

    def crossover_length(self, query_len: int, max_chunks: int = 256) -> int | None:
        """L_delta: the shortest context (tokens) at which the token plan is predicted faster than the layer plan."""
        for n in range(1, max_chunks + 1):
            req = Request(n * self.C, query_len, n)
            if self.plan("token", req).predicted.ttft_s < self.plan("layer", req).predicted.ttft_s:
                return n * self.C
        return None

    # ------------------------------------------------------------------------------------ builders
    def make_plan(self, strategy: str, req: Request, split, **kw) -> Plan:
        return Plan(strategy, req.context_len, req.query_len, self.C, self.L, tuple(split),
                    step_tokens=self.config.max_step, **kw)

    def static_plan(self, strategy: str, req: Request, split, pipelined: bool = True) -> Plan:
        split = tuple(split)
        return self.make_plan(strategy, req, split, compute=compute_steps(split, self.C, self.config.max_step),
                          loads=layer_major_loads(split, self.L), pipelined_query=pipelined)

    def _recompute(self, req: Request) -> Plan:
        # Stored chunks are ignored: the grid is recomputed like the query, in max_step steps.
        return self.static_plan("recompute", req, [self.L] * req.stored_chunks, pipelined=False)

    def _load(self, req: Request) -> Plan:
        n = req.stored_chunks
        loads = tuple(LoadStep((i, i + 1), (0, self.L)) for i in range(n))
        return self.make_plan("load", req, [0] * n, compute=(), loads=loads)

    def _load_layerwise(self, req: Request) -> Plan:
        return self.static_plan("load-layerwise", req, [0] * req.stored_chunks)

    def _meet(self, strategy: str, req: Request, steps, **kw) -> Plan:
        n = req.stored_chunks
        loads = tuple(LoadStep((i, i + 1), (0, self.L)) for i in reversed(range(n)))
        plan = self.make_plan(strategy, req, [self.L] * n, compute=tuple(steps), loads=loads, dynamic_meet=True,
                              **kw)
        return replace(plan, split=self._predicted_meet(plan))

    def _predicted_meet(self, plan: Plan) -> tuple[int, ...]:
        """Where the simulated pointers meet: recomputed chunks get L, loaded ones 0."""
        meet = predicted_meet(plan, self.cost, self.io)
        return tuple([self.L] * meet + [0] * (plan.num_chunks - meet))

    def _cake(self, req: Request) -> Plan:
        steps = [ComputeStep((i * self.C, (i + 1) * self.C), (0, self.L)) for i in range(req.stored_chunks)]
        return self._meet("cake", req, steps)

    def _token(self, req: Request) -> Plan:
        n, C = req.stored_chunks, self.C
        guess = self._cake(req).split.count(self.L)          # predicted meet with single-chunk steps
        per = max(1, self.config.max_step // C)
        steps, i = [], 0
        while i < n:                                         # big steps while far from the meet, then single chunks
            size = per if i + per <= guess - self.config.near_meet_chunks else 1
            steps.append(ComputeStep((i * C, min(i + size, n) * C), (0, self.L)))
            i += size
        # near the end the I/O side claims its last chunks as one group loaded layer by layer, and the query runs
        # behind it layer by layer (kvflow.planner.group); when no group pays, the pointers meet inside the last
        # chunk, layer by layer (cake meets at whole chunks)
        plan = self.make_plan("token", req, [self.L] * n, compute=(), loads=())
        return self._meet("token", req, steps, cell_meet=True, pipelined_query=True,
                          chunk_compute_s=tuple(self.cost.step_time((i * C, (i + 1) * C), self.L) for i in range(n)),
                          chunk_io_s=self.io.read_time(self.L), query_s=query_time(self.cost, plan))

    def _layer(self, req: Request) -> Plan:
        n = req.stored_chunks
        candidates = [self.static_plan("layer", req, [cut] * n) for cut in range(self.L + 1)]
        return min(candidates, key=self._ttft)

    def _staircase(self, req: Request) -> Plan:
        """Two staircase families, each balanced by bisection on the number m of fully recomputed chunks:
        (a) [L]*m + [s] + [0]*rest   token split with a partially recomputed boundary chunk;
        (b) [L]*m + [s]*rest          full chunks first, then the lower s layers of the rest."""
        n, L = req.stored_chunks, self.L
        if n == 0:
            return self.static_plan("staircase", req, [])
        priced: dict[tuple[int, ...], tuple[Plan, float, bool]] = {}   # one prediction per split (families overlap)

        def price(split: list[int]) -> tuple[Plan, float, bool]:
            """(plan, predicted TTFT, compute predicted shorter than I/O)"""
            key = tuple(split)
            if key not in priced:
                plan = self.static_plan("staircase", req, key)
                p = predict(plan, self.cost, self.io)
                priced[key] = (plan, p.ttft_s, p.compute_s < p.io_s)
            return priced[key]

        best = None
        for s in range(L + 1):
            for family in ("a", "b"):
                def split(m, s=s, family=family):
                    rest = n - m
                    if family == "a":
                        return [L] * m + ([s] + [0] * (rest - 1) if rest else [])
                    return [L] * m + [s] * rest
                for m in self._balanced(lambda m: price(split(m))[2], n):
                    plan, ttft, _ = price(split(m))
                    if best is None or ttft < best[1]:
                        best = (plan, ttft)
        return best[0]

    def _balanced(self, compute_shorter, n: int) -> list[int]:
        """m values around the point where predicted compute stops being shorter than I/O (``compute_shorter(m)``)."""
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if compute_shorter(mid):
                lo = mid + 1
            else:
                hi = mid
        return sorted({max(0, lo - 1), lo, min(n, lo + 1)})

    def _cacheflow(self, req: Request) -> Plan:
        candidates = [self._token(req), self._layer(req), self._staircase(req), self._load_layerwise(req),
                      self._recompute(req)]
        if req.stored_chunks == 0:
            candidates = candidates[-1:]
        times = self.scenario_times(candidates)
        regrets, nominal = self.regrets(candidates, times), times[(1.0, 1.0)]
        best = min(range(len(candidates)), key=lambda i: (round(regrets[i], 3), nominal[i]))
        choice = candidates[best]
        return replace(choice, strategy="cacheflow", notes={"chose": choice.strategy, "regret": regrets[best],
                                                             "band": (self.config.compute_band, self.config.io_band)})

    def scenarios(self) -> list[tuple[float, float]]:
        """(compute slowdown, I/O slowdown) the choice must hold under: the band's corners and the model itself."""
        c, i = 1 + self.config.compute_band, 1 + self.config.io_band
        return [(fc, fi) for fc in (1 / c, 1.0, c) for fi in (1 / i, 1.0, i)]

    def scenario_times(self, plans: list[Plan]) -> dict[tuple[float, float], list[float]]:
        """Each plan's predicted TTFT in each scenario. A dynamic meet is re-simulated at each speed (it moves at
        run time); a static split keeps its cells."""
        out = {}
        for fc, fi in self.scenarios():
            cost = self.cost.scaled(fc)
            io = replace(self.io, bandwidth=self.io.bandwidth / fi, step_latency=self.io.step_latency * fi)
            out[(fc, fi)] = [predict(p, cost, io).ttft_s for p in plans]
        return out

    def regrets(self, plans: list[Plan], times: dict | None = None) -> list[float]:
        """Each plan's worst ratio, over the scenarios, of its predicted TTFT to the best of ``plans`` there."""
        worst = [1.0] * len(plans)
        for scenario in (times or self.scenario_times(plans)).values():
            fastest = min(scenario)
            worst = [max(w, t / fastest) if fastest > 0 else w for w, t in zip(worst, scenario)]
        return worst

    def _ttft(self, plan: Plan) -> float:
        return predict(plan, self.cost, self.io).ttft_s
