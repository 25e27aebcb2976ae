"""`kvflow bench pipeline`: pipeline-parallel restoration, independent (boundary activations) vs sequential (stage
g waits for stage g-1's hidden states) vs one stage — same model, same pool, same stored context, one launch.

Every stage is its own process with ONE torch thread (configurable), so on a 2-core machine 2 stages use both
cores and 1 stage uses one: each stage is one "GPU". Each stage has its own link: its pool reader is throttled to
rho x the KV bytes/s its own layers recompute at short context (1 thread), measured warm at the start of the run
(bench/bound.py, as restore does); the 1-stage baseline's link follows the same rule with all layers, so every
link has (almost exactly) the same speed, as every GPU has its own PCIe link. "Unthrottled" reads the
shared-memory pool as fast as it goes.

The measured bound of an S-stage configuration: the slowest stage's balance point (planner/pipeline.py
``stage_balance``) of cell costs measured in this run (bench/bound.py ``CellProbe``, with the stages' thread count,
probed before and after the runs), its link's rate and activations, plus the query through the later stages and
the LM head, measured alone. The cost model's T* is reported beside it.

Runs are interleaved (configs rotate every repeat); medians are reported. The first run of every config is
checked against one full prefill (KV of every layer + logits) and doubles as warm-up.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvflow.chunks.record import HEADER_SIZE
from kvflow.cost import CostModel, cost_profile
from kvflow.cost.saved import noting
from kvflow.errors import KVFlowError
from kvflow.model import load_model
from kvflow.planner import PlannerConfig, Request
from kvflow.bench.bound import CellProbe, recompute_rate
from kvflow.planner.pipeline import PipelinePlanner, even_split, parse_split, stage_balance
from kvflow.report import BenchRun

Progress = Callable[[str], None]

@dataclass
class PipelineBenchConfig:
    model: str = "tiny-deep"
    seed: int = 0
    stages: list[int] = field(default_factory=lambda: [1, 2])
    context: int = 4096
    query: int = 32
    chunk_tokens: int = 256
    rhos: list[float | None] = field(default_factory=lambda: [1.0, None])   # None: unthrottled
    repeats: int = 5
    threads: int = 1
    split: str = "auto"                 # auto (planner-balanced at rho = 1) | even | sizes, e.g. 9,7
    handoffs: list[str] = field(default_factory=lambda: ["stage", "step"])
    timeout_s: float = 900.0


def compute_speed(cost: CostModel, report) -> float | None:
    """How fast a stage's grid compute ran against the cost model profiled alone with the same threads: 1.0 = as
    fast as alone; 0.5 = each stage got half a core (this machine's cores are not independent)."""
    steps = [(e[1], e[2], e[4] - e[3], e[6] - e[5]) for e in report.events if e[0] in ("compute", "fallback")]
    actual = sum(t for *_, t in steps)
    return sum(cost.step_time((a, b), n) for a, b, n, _ in steps) / actual if actual > 0 else None


def _splits(cfg: PipelineBenchConfig, runner, planner: PipelinePlanner, req: Request, rate) -> dict[int, list]:
    L, out = runner.num_layers, {}
    for S in cfg.stages:
        if S < 1 or S > L:
            raise KVFlowError(f"--stages {S}: the model has {L} layers")
        if S == 1:
            out[S] = [(0, L)]
        elif cfg.split == "even":
            out[S] = even_split(L, S)
        elif cfg.split == "auto":
            split = even_split(L, S)
            out[S] = list(planner.balance(req, split, [rate(b - a) for a, b in split], rate).suggested or split)
        else:
            split = parse_split(cfg.split, L)
            if len(split) != S:
                raise KVFlowError(f"--split {cfg.split} has {len(split)} stages; --stages asks for {S}")
            out[S] = split
    return out


def run(cfg: PipelineBenchConfig, progress: Progress = lambda s: None) -> dict:
    from kvflow.pipeline import Pipeline, PipelineRun, boundary_overhead, link_bandwidths, shared_pool
    from kvflow.pool import KVPool
    from kvflow.restorer import Restorer

    if cfg.context < cfg.chunk_tokens or cfg.query < 1 or cfg.repeats < 1:
        raise KVFlowError("need --context >= --chunk, --query >= 1 and --repeats >= 1")
    name = cfg.model
    runner = load_model(name, seed=cfg.seed)
    runner.check_context_len(cfg.context + cfg.query)      # before the profile sized by it
    C, L = cfg.chunk_tokens, runner.num_layers
    if cfg.split not in ("auto", "even"):
        parse_split(cfg.split, L)                 # a bad split is an error before anything is measured
    if max(cfg.stages) > L:
        raise KVFlowError(f"--stages {max(cfg.stages)}: the model has {L} layers")
    # the cost profile measured with the torch threads each stage has
    cost = cost_profile(runner, cfg.context + cfg.query, threads=cfg.threads, profiling=noting(progress))
    n = cfg.context // C
    req = Request(cfg.context, cfg.query, n)
    cell = C * cost.kv_bytes_per_token_layer + HEADER_SIZE
    act_record = C * runner.hidden_size * 4 + HEADER_SIZE
    planner = PipelinePlanner(cost, C, cell, act_record, PlannerConfig())
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)                  # rates and bound probes with a stage's threads
    try:
        progress("measuring the recompute rate (rho's denominator) with a stage's threads")
        measured = {k: recompute_rate(runner, C, layers=k) for k in range(1, L + 1)}
    finally:
        torch.set_num_threads(before)
    rate = measured.__getitem__
    splits = _splits(cfg, runner, planner, req, rate)
    boundaries = sorted({a for split in splits.values() for a, _ in split[1:]})
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    context = torch.randint(0, runner.config.vocab_size, (cfg.context,), generator=gen)
    query = torch.randint(0, runner.config.vocab_size, (cfg.query,), generator=gen)

    configs = []   # (S, mode, handoff)
    for S in cfg.stages:
        if S == 1:
            configs.append((1, "single", "stage"))
        else:
            configs.append((S, "independent", "stage"))
            configs += [(S, "sequential", h) for h in cfg.handoffs]

    def label(rho, S, mode, handoff):
        r = "unthrottled" if rho is None else f"rho={rho:g}"
        return f"{r} S={S} {mode}" + (f"/{handoff}" if mode == "sequential" else "")

    def make(rho, S, mode, handoff, verify):
        split = splits[S]
        return PipelineRun(context, query, split, "independent" if mode == "single" else mode,
                           link_bandwidths(rate, split, rho), handoff=handoff, return_kv=verify,
                           label=label(rho, S, mode, handoff))

    runs = [make(rho, *c, verify=True) for rho in cfg.rhos for c in configs]
    for r in range(cfg.repeats):
        for rho in cfg.rhos:
            rotated = configs[r % len(configs):] + configs[:r % len(configs)]
            runs += [make(rho, *c, verify=False) for c in rotated]

    kv_bytes = cfg.context * runner.kv_bytes_per_token() + n * L * HEADER_SIZE
    act_bytes = len(boundaries) * n * (C * runner.hidden_size * 4 + HEADER_SIZE)
    with shared_pool(int(1.5 * (kv_bytes + act_bytes)) + (64 << 20), chunk_tokens=C) as pool_cfg:
        pool = KVPool.open(pool_cfg)
        try:
            progress(f"storing {cfg.context} tokens (KV + boundary activations at layers {boundaries})")
            stored = Restorer(runner, pool, cost=cost).store(context, boundaries=boundaries)
            progress("reference prefill for the exactness checks")
            ref_kv, ref_logits = runner.reference_prefill(torch.cat([context, query]))
            pipe = Pipeline(name, runner.fingerprint, pool_cfg, cost, seed=cfg.seed, threads=cfg.threads,
                            timeout_s=cfg.timeout_s, dtype=str(runner.dtype).removeprefix("torch."),
                            device=str(runner.device))
            probe = CellProbe(C, L)
            ids = torch.cat([context, query])

            def bound_probe() -> None:
                progress("measuring the bound (cell costs, query alone) with a stage's threads")
                torch.set_num_threads(cfg.threads)
                try:
                    probe.probe(runner, ids, n, planner.config.max_step)
                finally:
                    torch.set_num_threads(before)

            bound_probe()
            progress(f"launching {max(cfg.stages)} stage processes for {len(runs)} runs")
            results = pipe.run(runs, progress=progress)
            bound_probe()
        finally:
            pool.close()

    by_label: dict[str, list] = {}
    checks: dict[str, dict] = {}
    for run_, res in zip(runs, results):
        if run_.return_kv:
            diff = max((res.logits - ref_logits).abs().max().item(),
                       *[max((k - rk).abs().max().item(), (v - rv).abs().max().item())
                         for (k, v), (rk, rv) in zip(res.kv, ref_kv)])
            checks[res.label] = {"max_abs_diff": diff, "argmax_ok": bool(res.logits.argmax() == ref_logits.argmax())}
            res.kv = None
        else:
            by_label.setdefault(res.label, []).append(res)

    points = []
    for rho in cfg.rhos:
        single = None
        for S, mode, handoff in configs:
            lab = label(rho, S, mode, handoff)
            group = by_label[lab]
            ttfts = [r.ttft_s for r in group]
            median = statistics.median(ttfts)
            mid = min(group, key=lambda r: abs(r.ttft_s - median))
            point = {"rho": rho, "stages": S, "mode": mode, "handoff": handoff if mode == "sequential" else None,
                     "label": lab, "split": [list(s) for s in splits[S]],
                     "bandwidths": [s.bandwidth for s in mid.stages] if rho is not None else None,
                     "ttft_s": median, "ttft_runs": ttfts,
                     "restore_s": statistics.median(max(s.restore_s for s in r.stages) for r in group),
                     "lower_bound_s": mid.lower_bound_s, "predicted_ttft_s": mid.predicted_ttft_s,
                     "measured_bound_s": (mb := measured_bound(probe, splits[S], link_bandwidths(rate, splits[S], rho),
                                                               cell, act_record)),
                     "vs_measured_bound": median / mb if mb else None,
                     "balance": mid.balance, "plan": mid.plan, **checks[lab],
                     "per_stage": [{"layers": list(s.layers), "inputs": s.inputs, "plan": s.plan,
                                    "restore_s": statistics.median(r.stages[s.stage].restore_s for r in group),
                                    "compute_busy_s": statistics.median(r.stages[s.stage].compute_busy_s for r in group),
                                    "io_busy_s": statistics.median(r.stages[s.stage].io_busy_s for r in group),
                                    "act_io_busy_s": statistics.median(r.stages[s.stage].act_io_busy_s for r in group),
                                    "blocked_s": statistics.median(r.stages[s.stage].blocked_s for r in group),
                                    "compute_speed": _median([compute_speed(cost, r.stages[s.stage])
                                                              for r in group]),
                                    "recomputed_chunks": s.recomputed_chunks, "loaded_chunks": s.loaded_chunks}
                                   for s in mid.stages],
                     "timeline": [{"stage": s.stage, "layers": list(s.layers), "events": s.events} for s in mid.stages],
                     "ttft_of_timeline_s": mid.ttft_s}
            if mode == "single":
                single = point
            points.append(point)
        for p in points:
            if p["rho"] == rho and single is not None:
                p["speedup_vs_1"] = single["ttft_s"] / p["ttft_s"]
                p["ideal"] = p["stages"]
                p["of_ideal"] = p["speedup_vs_1"] / p["stages"]
                p["bound_speedup"] = single["lower_bound_s"] / p["lower_bound_s"]
        indep = {p["stages"]: p for p in points if p["rho"] == rho and p["mode"] == "independent"}
        for p in points:
            if p["rho"] == rho and p["mode"] == "sequential" and p["stages"] in indep:
                p["vs_independent"] = p["ttft_s"] / indep[p["stages"]]["ttft_s"]

    overhead = {S: boundary_overhead(runner, [a for a, _ in split[1:]], C) for S, split in splits.items() if S > 1}
    return {"config": asdict(cfg), "model": {"name": cfg.model, "path": name, "layers": L,
                                             "hidden": runner.hidden_size, "kv_heads": runner.kv_heads,
                                             "head_dim": runner.head_dim, "fingerprint": runner.fingerprint},
            "machine": {"cpus": os.cpu_count(), "torch_threads_per_stage": cfg.threads,
                        "note": f"each stage is its own process with {cfg.threads} torch thread(s): S stages use "
                                f"S x {cfg.threads} core(s), the 1-stage baseline {cfg.threads}"},
            "recompute_rate_bytes_per_s": {k: measured[k] for k in sorted({b - a for sp in splits.values()
                                                                            for a, b in sp})},
            "bound_probe": probe.summary(),
            "cost_model": {"threads": cost.threads, "short_context_rate": cost.short_context_rate(C),
                           "held_out_median_rel_error": cost.fit.get("held_out_median_rel_error")},
            "splits": {S: [list(s) for s in split] for S, split in splits.items()},
            "stored": {"kv_bytes": stored.bytes_written, "act_bytes": stored.act_bytes_written},
            "overhead": overhead, "points": points}


def measured_bound(probe: CellProbe, split: list[tuple[int, int]], bandwidths: list[float] | None, cell_bytes: int,
                   act_bytes: int) -> float | None:
    """No S-stage restoration finishes sooner: each stage restores from its own link (its activations on it too)
    at measured cell costs, then the query passes the later stages; None when unthrottled (the shared-memory
    link's rate is not a link's)."""
    if bandwidths is None:
        return None
    L = probe.num_layers
    cells = probe.cells()
    own = probe.own
    q_layer = statistics.median(own.query_layer)
    per_layer = statistics.median(own.query) / L
    head = statistics.median(own.head)
    worst = 0.0
    for g, ((l0, l1), bw) in enumerate(zip(split, bandwidths)):
        act_s = act_bytes / bw if g > 0 else 0.0
        stage = stage_balance(cells, l1 - l0, cell_bytes / bw, act_s, len(cells), per_layer * (l1 - l0), q_layer)
        worst = max(worst, stage + per_layer * (L - l1))
    return worst + head


def bench(cfg: PipelineBenchConfig, folder: Path, progress: Progress = lambda s: None) -> BenchRun:
    """``run(cfg)`` and its timelines in ``folder``: ``kvflow bench pipeline``."""
    results = run(cfg, progress)
    pngs = figure(results, folder)
    return BenchRun(results, folder, tables(results),
                    f"results: {folder / 'results.json'}; timelines: {', '.join(str(p) for p in pngs)}")


def tables(results: dict) -> list[tuple[str, list[dict]]]:
    rows = []
    for p in results["points"]:
        rows.append({"link": "unthrottled" if p["rho"] is None else f"rho={p['rho']:g}", "stages": p["stages"],
                     "mode": p["mode"] + (f"/{p['handoff']}" if p["handoff"] else ""),
                     "layers": ",".join(str(b - a) for a, b in p["split"]),
                     "TTFT ms": p["ttft_s"] * 1e3, "restore ms": p["restore_s"] * 1e3,
                     "bound ms": p["measured_bound_s"] * 1e3 if p["measured_bound_s"] else None,
                     "TTFT/bound": p["vs_measured_bound"],
                     "T* ms": p["lower_bound_s"] * 1e3, "TTFT/T*": p["ttft_s"] / p["lower_bound_s"],
                     "speedup vs 1": _x(p.get("speedup_vs_1")),
                     "of ideal": f"{p['of_ideal']:.0%}" if "of_ideal" in p else "-",
                     "vs independent": f"{p['vs_independent'] - 1:+.0%}" if "vs_independent" in p else "-",
                     "max |diff|": f"{p['max_abs_diff']:.1e}" + ("" if p["argmax_ok"] else " ARGMAX"),
                     })
    cfg = results["config"]
    title = (f"pipeline restoration: {results['model']['name']} ({results['model']['layers']} layers), context "
             f"{cfg['context']} + query {cfg['query']}, chunk {cfg['chunk_tokens']}; {results['machine']['note']}; "
             f"median of {cfg['repeats']}")
    stage_rows = []
    for p in results["points"]:
        for g, s in enumerate(p["per_stage"]):
            stage_rows.append({"run": p["label"], "stage": g, "layers": f"{s['layers'][0]}-{s['layers'][1] - 1}",
                               "inputs": s["inputs"], "restore ms": s["restore_s"] * 1e3,
                               "compute ms": s["compute_busy_s"] * 1e3, "KV I/O ms": s["io_busy_s"] * 1e3,
                               "act I/O ms": s["act_io_busy_s"] * 1e3, "waited ms": s["blocked_s"] * 1e3,
                               "compute speed vs alone": "-" if s["compute_speed"] is None
                               else f"{s['compute_speed']:.2f}",
                               "recomputed": s["recomputed_chunks"], "loaded": s["loaded_chunks"]})
    balance = [{"stages": p["stages"], "link": "unthrottled" if p["rho"] is None else f"rho={p['rho']:g}",
                "balance": p["balance"]["describe"]} for p in results["points"] if p["mode"] == "independent"]
    overhead = [{"stages": S, "boundaries": ",".join(map(str, o["boundaries"])),
                 "act B/token": o["act_bytes_per_token"], "KV B/token": o["kv_bytes_per_token"],
                 "% of KV": f"{o['percent_of_kv']:.1f}%"} for S, o in results["overhead"].items()]
    return [(title, rows), ("per stage (the median run)", stage_rows), ("load balance (planner)", balance),
            ("boundary activation storage overhead (fp32)", overhead)]


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _x(v):
    return f"{v:.2f}x" if v is not None and math.isfinite(v) else "-"


COLORS = {"compute": "#4C72B0", "fallback": "#C44E52", "query": "#55A868", "head": "#8172B2", "load": "#DD8452",
          "act": "#937860", "wait": "#BBBBBB"}


def figure(results: dict, folder: Path) -> list[Path]:
    """One PNG per link setting: one panel per configuration, two lanes per stage (compute, I/O)."""
    from kvflow.extras import require
    matplotlib = require("plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for rho in results["config"]["rhos"]:
        pts = [p for p in results["points"] if p["rho"] == rho]
        height = sum(2 * len(p["timeline"]) for p in pts) * 0.35 + 1.2 * len(pts)
        fig, axes = plt.subplots(len(pts), 1, figsize=(11, max(3.0, height)), sharex=True, squeeze=False)
        for ax, p in zip(axes[:, 0], pts):
            labels = []
            for s in p["timeline"]:
                base = 2 * (len(p["timeline"]) - 1 - s["stage"])
                for kind, a, b, l0, l1, start, end in s["events"]:
                    lane = base + (0 if kind in ("load", "act") else 1)
                    ax.barh(lane, end - start, left=start, color=COLORS.get(kind, "#333333"), height=0.7,
                            edgecolor="white", linewidth=0.3)
                labels += [(base, f"stage {s['stage']} I/O"), (base + 1, f"stage {s['stage']} compute "
                                                                         f"(L{s['layers'][0]}-{s['layers'][1] - 1})")]
            ax.axvline(p["ttft_of_timeline_s"], color="k", lw=1, ls="--")
            ax.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=7)
            ax.set_title(f"{p['label']}: TTFT {p['ttft_of_timeline_s'] * 1e3:.0f} ms (dashed), "
                         f"T* {p['lower_bound_s'] * 1e3:.0f} ms", fontsize=9)
        axes[-1, 0].set_xlabel("seconds since the restoration started (all stages on one clock)")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
        axes[0, 0].legend(handles, list(COLORS), ncol=len(COLORS), fontsize=7, loc="lower right")
        fig.tight_layout()
        tag = "unthrottled" if rho is None else f"rho{rho:g}"
        path = folder / f"pipeline-timeline-{tag}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
