"""``kvflow bench elastic``: does chunked prefill close the gap an elastic reserve would fill (DESIGN.md §2.3)?

One mixed workload, in-process (engine API, no HTTP): ``decoders`` short requests decode steadily; long prompts of
``long_len`` tokens arrive one after another (the next when the previous has its first token and ``gap`` more steps
ran). Measured:

    (a) TTFT of the long prompts vs the token budget (``max_num_batched_tokens``), every budget once per repeat, the
        order rotated each repeat (the machine's load drifts); median and min..max over repeats
    (b) the activation reserve each budget needs (engine/reserve.py's measurement)
    (c) at ONE memory budget M = KV + reserve of the largest token budget, a decode-heavy mix under three configs:
        ``fixed``   the largest budget, its reserve held all the time
        ``elastic`` the same, the reserve lent as KV blocks while only decodes run (taken back for each prefill)
        ``small``   a small token budget: its smaller reserve frees the difference as KV blocks for good
        -> KV blocks, concurrent decodes (max / mean running), preemptions, decode tokens/s, long-prompt TTFT
    (d) take-back latency P50 / P99 (and blocks moved, sequences preempted) over every elastic run
    (e) peak resident memory of every run (sampled every few ms by a thread) above the process's resident memory
        before the engine was built, against that run's budget: KV blocks + activation reserve. Every engine here
        runs with ``engine.release_heap`` (as an elastic one always does): the budget is what is judged, so the
        process's resident memory is held to the live set (engine/reserve.py) from before the first reserve is
        measured; TTFTs here include what that costs prefill (its pages faulted in afresh each step)

Everything runs on the engine thread of this process; numbers on a shared machine are noisy, which is why (a) gives
the spread, not just a median.

    run = elastic_run("tiny", ElasticWorkload(budgets=(256, 4096)))     # run.folder holds elastic.json and .png
    for title, rows in run.tables(): print_table(title, rows)
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
from kvflow.engine.engine import longest_sequence
from kvflow.engine.reserve import measure_activation_reserve
from kvflow.model.host_memory import hold_to_live_set, release_freed_memory
from kvflow.errors import ConfigError
from kvflow.stats import percentile, rss_bytes

Progress = Callable[[str], None]
OPEN_DECODE = 4096            # (a): decoders' max_tokens (they are aborted once the long prompts are done)
SEQS = 64                     # max_num_seqs of every engine here


@dataclass(slots=True)
class ElasticWorkload:
    budgets: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    long_len: int = 4096
    long_prompts: int = 2
    decoders: int = 4
    decode_prompt: int = 64
    gap: int = 8                     # decode-only steps between a long prompt's first token and the next arrival
    repeats: int = 3
    c_decoders: int = 16             # (c): decoders
    c_long_len: int = 1024           # (c): tokens of each arriving long prompt
    c_long_prompts: int = 4          # (c): long prompts per run (each one is a take-back for the elastic config)
    c_tokens: int = 192              # (c): tokens each decodes
    c_base_blocks: int = 0           # (c): KV blocks of the fixed config (0: half of what the decoders need at the end)
    small_budget: int = 512          # (c): the smaller token budget
    block_size: int = 16
    seed: int = 0

    def validate(self) -> None:
        if not self.budgets or any(b < 1 for b in self.budgets):
            raise ConfigError(f"--budgets must be positive token counts, got {','.join(map(str, self.budgets))}")
        for name in ("long_len", "long_prompts", "decoders", "decode_prompt", "repeats", "c_decoders", "c_tokens",
                     "c_long_len", "c_long_prompts", "small_budget", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.gap < 0 or self.c_base_blocks < 0:
            raise ConfigError("--gap and --c-base-blocks must be >= 0")
        if self.small_budget >= max(self.budgets):
            raise ConfigError(f"--small-budget ({self.small_budget}) must be below the largest budget "
                              f"({max(self.budgets)})")


class RssSampler:
    """Peak resident memory of this process while running, sampled from /proc/self/statm every ``period`` s."""

    def __init__(self, period: float = 0.002):
        self.period, self.peak, self._stop = period, rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvflow-rss")

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_mixed(runner, cfg: EngineConfig, w: ElasticWorkload, *, decoders: int, decode_tokens: int | None,
              long_len: int, long_prompts: int, seed: int, reserve: int) -> dict:
    """One run: ``decoders`` decode (``decode_tokens`` each, None: until the long prompts are done), the long prompts
    arrive one after another. TTFTs, concurrency, decode throughput, elastic counters, peak RSS vs budget."""
    gc.collect()
    release_freed_memory()                    # glibc hands freed memory back, so ``before`` is not inflated
    vocab = runner.config.vocab_size
    before = rss_bytes()
    with RssSampler() as sampler:
        engine = LLMEngine(runner, cfg)
        try:
            dec = SamplingParams(max_tokens=decode_tokens or OPEN_DECODE, ignore_eos=True)
            ids = [engine.add_request(_prompt(vocab, w.decode_prompt, seed * 1000 + i), dec) for i in range(decoders)]
            produced = dict.fromkeys(ids, 0)
            longs: dict[int, float] = {}          # seq id -> arrival
            ttft: dict[int, float] = {}
            running, steps, next_at, t0 = [], 0, None, time.perf_counter()
            while True:
                if len(longs) < long_prompts and next_at is not None and steps >= next_at:
                    sid = engine.add_request(_prompt(vocab, long_len, seed * 1000 + 500 + len(longs)),
                                             SamplingParams(max_tokens=1, ignore_eos=True))
                    longs[sid], next_at = time.perf_counter(), None
                for out in engine.step():
                    if out.seq_id in produced:
                        produced[out.seq_id] += len(out.new_token_ids)
                    elif out.seq_id in longs and out.seq_id not in ttft:
                        ttft[out.seq_id] = time.perf_counter() - longs[out.seq_id]
                steps += 1
                running.append(engine.num_running)
                if next_at is None and len(ttft) == len(longs) and all(produced.values()):
                    next_at = steps + w.gap          # decode-only steps first (the elastic config lends)
                done_longs = len(ttft) == long_prompts
                if done_longs and (decode_tokens is None or not engine.has_unfinished()):
                    break
                if not engine.has_unfinished() and not done_longs and next_at is None:
                    next_at = steps
            wall = time.perf_counter() - t0
            for sid in list(engine.seqs):
                engine.abort(sid)
            el = engine.elastic
            lent = el.stats.lent_blocks if el else 0
            per_block = engine.cache.kv[:, :, :cfg.block_size].numel() * engine.cache.kv.element_size()
            row = {"budget": cfg.max_num_batched_tokens, "elastic": bool(el), "kv_blocks": engine.num_blocks,
                   "lent_blocks": lent, "ttft_s": [ttft[s] for s in longs], "steps": steps, "wall_s": wall,
                   "max_running": max(running), "mean_running": statistics.fmean(running),
                   "preemptions": engine.stats.preemptions, "decode_tokens": sum(produced.values()),
                   "decode_tok_s": sum(produced.values()) / wall,
                   "budget_bytes": engine.num_blocks * per_block + reserve}
            if el:
                row.update(takebacks=el.stats.takebacks, blocks_moved=el.stats.blocks_moved,
                           takeback_preempted=el.stats.preempted, takeback_s=list(el.stats.takeback_s),
                           takeback_failures=el.stats.failures)
        finally:
            engine.close()
            del engine
            gc.collect()
    row["peak_rss_bytes"] = sampler.peak - before
    row["within_budget"] = row["peak_rss_bytes"] <= row["budget_bytes"]
    return row


def _reserve_kw(reserve: int) -> dict:
    """Hand the engine the reserve already measured (engine/reserve.py's config field, where it exists)."""
    return {"activation_reserve": reserve} if "activation_reserve" in EngineConfig.__dataclass_fields__ else {}


def _reserve(runner, tokens: int, longest: int) -> int:
    """The measured reserve of a ``tokens``-token step whose sequences reach ``longest`` (what the engines compute)."""
    return measure_activation_reserve(runner, tokens, max_model_len=longest, max_num_seqs=SEQS)


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


@dataclass(slots=True)
class ElasticRun:
    """A finished run: ``results`` (``run``'s) as written to ``folder/elastic.json``."""
    model: str
    workload: ElasticWorkload
    folder: Path
    results: dict

    def to_json(self) -> dict:
        """What ``--json`` prints: the results with the number of runs in place of the runs."""
        return {k: v for k, v in self.results.items() if k != "runs"} | {"runs": len(self.results["runs"])}

    def tables(self) -> list[tuple[str, list[dict]]]:
        res, w, tb = self.results, self.workload, self.results["takeback"]
        return [
            (f"(a, b) {self.model}: long-prompt ({w.long_len} tokens) TTFT vs token budget, {w.repeats} repeats",
             [{"budget": r["budget"], "reserve MiB": r["reserve_MiB"], "TTFT p50 s": r["ttft_p50_s"],
               "min s": r["ttft_min_s"], "max s": r["ttft_max_s"], "spread": r["spread"],
               "vs best": res["ttft_gap_vs_best"][str(r["budget"])]} for r in res["ttft"]]),
            (f"(c) one memory budget ({res['memory_budget_bytes'] / 2**20:.1f} MiB of KV + reserve)",
             [{"config": r["config"], "budget": r["budget"], "KV blocks": r["kv_blocks"], "lent": r["lent_blocks"],
               "max running": r["max_running"], "mean running": r["mean_running"], "preemptions": r["preemptions"],
               "decode tok/s": r["decode_tok_s"], "long TTFT s": r["long_ttft_p50_s"]} for r in res["capacity"]]),
            ("(d) take-back", [{"n": tb["n"], "P50 ms": tb["p50_ms"], "P99 ms": tb["p99_ms"], "max ms": tb["max_ms"],
                                "blocks moved": tb["blocks_moved"], "preempted": tb["preempted"],
                                "failures": tb["failures"]}]),
            ("(e) peak resident memory above start vs budget (KV + reserve), every run",
             [{"part": r["part"], "config": r.get("config", ""), "budget tok": r["budget"], "elastic": r["elastic"],
               "peak MiB": r["peak_rss_bytes"] / 2**20, "budget MiB": r["budget_bytes"] / 2**20,
               "within": r["within_budget"]} for r in res["runs"]])]

    @property
    def footer(self) -> str:
        return f"reserve: {self.results['reserve_source']}; JSON + PNG in {self.folder}"


def elastic_run(model: str, w: ElasticWorkload, out: Path | None = None,
                progress: Progress = lambda s: None) -> ElasticRun:
    """Build ``model`` and run ``w`` on it; writes elastic.json and elastic.png (default folder runs/elastic-TIME)."""
    from kvflow.model import host_memory, load_model
    from kvflow.report import out_dir, save_figure, write_json

    w.validate()
    host_memory.hold_to_live_set()    # as early as the bench knows its budget is judged (engine/reserve.py)
    runner = load_model(model)
    runner.check_context_len(max(w.long_len, w.decode_prompt + 4096) + 1)
    folder = out_dir("elastic", out)
    res = run(runner, w, progress=progress)
    write_json(folder / "elastic.json", res)
    save_figure(folder / "elastic.png", draw(res), panels=4, size=(4.6, 3.6))
    return ElasticRun(model, w, folder, res)


def run(runner, w: ElasticWorkload, progress: Progress = lambda s: None) -> dict:
    w.validate()
    held = hold_to_live_set()     # what every engine below does when it starts; before the reserves are measured here
    bs = w.block_size
    per_block = bs * runner.shape.kv_bytes_per_token(runner.dtype)

    def longest(blocks: int) -> int:                # what the engines below compute for their reserve
        return longest_sequence(runner, EngineConfig(block_size=bs), blocks)

    need = _blocks(w.long_len + 1, bs) + w.decoders * _blocks(w.decode_prompt + OPEN_DECODE, bs)
    reserves = {t: _reserve(runner, t, longest(need))
                for t in sorted(set(w.budgets) | {w.small_budget})}
    source = "measured (engine/reserve.py)"
    progress(f"reserves ({source}): " + ", ".join(f"{t}: {r / 2**20:.1f} MiB" for t, r in reserves.items()))

    # (a) TTFT vs token budget; KV enough for everything (the budget under study is the token budget)
    ttft_rows, runs = [], []
    for r in range(w.repeats):
        order = list(w.budgets[r % len(w.budgets):] + w.budgets[:r % len(w.budgets)])
        for t in order:
            cfg = EngineConfig(block_size=bs, num_blocks=need, max_num_batched_tokens=t, max_num_seqs=SEQS,
                               release_heap=True,
                               **_reserve_kw(reserves[t]))
            row = run_mixed(runner, cfg, w, decoders=w.decoders, decode_tokens=None, long_len=w.long_len,
                            long_prompts=w.long_prompts, seed=w.seed + r,
                            reserve=reserves[t])
            row.update(part="a", repeat=r)
            runs.append(row)
            progress(f"(a) repeat {r} budget {t}: TTFT {', '.join(f'{x:.2f}' for x in row['ttft_s'])} s")
    for t in w.budgets:
        xs = [x for row in runs if row["part"] == "a" and row["budget"] == t for x in row["ttft_s"]]
        med = statistics.median(xs)
        ttft_rows.append({"budget": t, "reserve_MiB": reserves[t] / 2**20, "ttft_p50_s": med, "ttft_min_s": min(xs),
                          "ttft_max_s": max(xs), "spread": (max(xs) - min(xs)) / med, "n": len(xs)})
    best = min(r["ttft_p50_s"] for r in ttft_rows)

    # (c) one memory budget: KV of the fixed config + the largest budget's reserve
    big = max(w.budgets)
    base = w.c_base_blocks or max(_blocks(w.c_long_len + 1, bs) + 1,
                                  w.c_decoders * _blocks(w.decode_prompt + w.c_tokens, bs) // 2)
    c_reserve = {big: _reserve(runner, big, longest(base))}
    memory = base * per_block + c_reserve[big]
    # the small config's blocks: what the memory holds beside its reserve, which grows with its longest sequence
    # (more blocks, longer); from the reserve at the base length down until blocks + reserve fit the one budget
    small_blocks = (memory - _reserve(runner, w.small_budget, longest(base))) // per_block
    while True:
        c_reserve[w.small_budget] = _reserve(runner, w.small_budget, longest(small_blocks))
        fit = (memory - c_reserve[w.small_budget]) // per_block
        if fit < 1:
            raise ConfigError(f"--small-budget {w.small_budget}: its reserve "
                              f"({c_reserve[w.small_budget] / 2**20:.1f} MiB) leaves no KV block in the "
                              f"{memory / 2**20:.1f} MiB memory budget of (c)")
        if fit >= small_blocks:
            break
        small_blocks = fit
    configs = {"fixed": dict(max_num_batched_tokens=big, num_blocks=base),
               "elastic": dict(max_num_batched_tokens=big, num_blocks=base, elastic_reserve=True),
               "small": dict(max_num_batched_tokens=w.small_budget, num_blocks=small_blocks)}
    c_rows = []
    for r in range(w.repeats):
        names = list(configs)[r % 3:] + list(configs)[:r % 3]
        for name in names:
            t = configs[name]["max_num_batched_tokens"]
            cfg = EngineConfig(block_size=bs, max_num_seqs=SEQS, release_heap=True, **_reserve_kw(c_reserve[t]),
                               **configs[name])
            row = run_mixed(runner, cfg, w, decoders=w.c_decoders, decode_tokens=w.c_tokens, long_len=w.c_long_len,
                            long_prompts=w.c_long_prompts, seed=w.seed + 100 + r,
                            reserve=c_reserve[t])
            row.update(part="c", config=name, repeat=r)
            runs.append(row)
            progress(f"(c) repeat {r} {name}: {row['decode_tok_s']:.1f} decode tok/s, max running "
                     f"{row['max_running']}, preemptions {row['preemptions']}")
    for name in configs:
        rows = [x for x in runs if x.get("config") == name]
        c_rows.append({"config": name, "budget": rows[0]["budget"], "kv_blocks": rows[0]["kv_blocks"],
                       "lent_blocks": rows[0]["lent_blocks"],
                       "max_running": max(x["max_running"] for x in rows),
                       "mean_running": statistics.median(x["mean_running"] for x in rows),
                       "preemptions": statistics.median(x["preemptions"] for x in rows),
                       "decode_tok_s": statistics.median(x["decode_tok_s"] for x in rows),
                       "long_ttft_p50_s": statistics.median(y for x in rows for y in x["ttft_s"])})

    # (d) take-back latency over every elastic run
    lat = sorted(s for x in runs if x["elastic"] for s in x["takeback_s"])
    takeback = {"n": len(lat), "p50_ms": percentile(lat, 50, empty=0.0) * 1e3, "p99_ms": percentile(lat, 99, empty=0.0) * 1e3,
                "max_ms": (lat[-1] * 1e3) if lat else 0.0,
                "blocks_moved": sum(x["blocks_moved"] for x in runs if x["elastic"]),
                "preempted": sum(x["takeback_preempted"] for x in runs if x["elastic"]),
                "failures": sum(x["takeback_failures"] for x in runs if x["elastic"])}
    return {"workload": {k: getattr(w, k) for k in w.__slots__}, "model": runner.name,
            "bytes_per_block": per_block, "reserve_source": source, "held_to_live_set": held,
            "reserves": {str(t): r for t, r in reserves.items()},
            "ttft": ttft_rows, "ttft_gap_vs_best": {str(r["budget"]): r["ttft_p50_s"] / best - 1 for r in ttft_rows},
            "memory_budget_bytes": memory, "capacity_reserves": {str(t): r for t, r in c_reserve.items()},
            "capacity": c_rows, "takeback": takeback,
            "all_within_budget": all(x["within_budget"] for x in runs), "runs": runs,
            "load_average": os.getloadavg()}


def draw(results: dict) -> Callable[[list], None]:
    def fill(axes) -> None:
        ax = axes[0]
        t = [r["budget"] for r in results["ttft"]]
        med = [r["ttft_p50_s"] for r in results["ttft"]]
        lo = [m - r["ttft_min_s"] for m, r in zip(med, results["ttft"])]
        hi = [r["ttft_max_s"] - m for m, r in zip(med, results["ttft"])]
        ax.errorbar(t, med, yerr=[lo, hi], marker="o", capsize=3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(t, [str(x) for x in t])
        ax.set(xlabel="token budget (max_num_batched_tokens)", ylabel="long-prompt TTFT (s)", ylim=(0, None),
               title="(a) TTFT vs token budget (median, min..max)")
        ax = axes[1]
        ax.plot([int(k) for k in results["reserves"]], [v / 2**20 for v in results["reserves"].values()], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xticks(t, [str(x) for x in t])
        ax.set(xlabel="token budget", ylabel="MiB", title=f"(b) activation reserve ({results['reserve_source'][:8]})")
        ax = axes[2]
        names = [r["config"] for r in results["capacity"]]
        ax.bar(names, [r["kv_blocks"] for r in results["capacity"]], label="KV blocks")
        ax.bar(names, [r["lent_blocks"] for r in results["capacity"]],
               bottom=[r["kv_blocks"] for r in results["capacity"]], label="lent (decode-only)")
        for i, r in enumerate(results["capacity"]):
            ax.annotate(f"{r['decode_tok_s']:.1f} decode tok/s\nmax {r['max_running']} running",
                        (i, r["kv_blocks"] + r["lent_blocks"]), ha="center", va="bottom", fontsize=7)
        ax.set(ylabel="KV blocks", title="(c) one memory budget",
               ylim=(0, 1.3 * max(r["kv_blocks"] + r["lent_blocks"] for r in results["capacity"])))
        ax.legend(fontsize=7)
        ax = axes[3]
        runs = results["runs"]
        ax.scatter([r["budget_bytes"] / 2**20 for r in runs], [r["peak_rss_bytes"] / 2**20 for r in runs],
                   c=["C1" if r["elastic"] else "C0" for r in runs], s=12)
        top = max([r["budget_bytes"] for r in runs] + [r["peak_rss_bytes"] for r in runs]) / 2**20
        ax.plot([0, top], [0, top], "k--", lw=0.8)
        tb = results["takeback"]
        ax.set(xlabel="budget: KV + reserve (MiB)", ylabel="peak RSS above start (MiB)",
               title=f"(e) peak RSS vs budget, every run\n(d) take-back P50 {tb['p50_ms']:.2f} / P99 "
                     f"{tb['p99_ms']:.2f} ms (n={tb['n']})")
    return fill
