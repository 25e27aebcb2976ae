"""``kvflow bench second-turn``: TTFT of a chat's second turn whose long history was evicted, restored over a link.

One run = per repeat, per strategy (``recompute``, ``cacheflow``; the order alternates every repeat), a fresh engine
on the serve defaults (blocks of 16, 512 tokens a step; pool chunks of 64) with a fresh pool:

    1. turn 1     a system prompt of ``history`` tokens + a user message (bench/serve_bench.py's chat generator,
                  one user, two rounds), answered; its full chunks reach the pool (the write queue is flushed)
    2. eviction   another prompt as long as the whole resident budget takes every block (LRU: turn 1's blocks are
                  taken first), so nothing of the history stays resident
    3. the link   the pool throttled to rho x the KV bytes/s recompute produces at short context, measured warm
                  once at the start of the run (bench/bound.py's ``recompute_rate``, set through restore_bench's
                  ``Bench.set_link`` — the same rho as every kvflow benchmark, DESIGN.md §5)
    4. turn 2     turn 1's messages + its answer + the next user message: the history comes back from the pool,
                  restored by the strategy (``engine.pool_load`` off: never read straight into the blocks, so
                  the strategies' restorations are what is compared); TTFT = first token - ``add_request``

Reported: each strategy's median TTFT over the repeats, cacheflow / recompute (of the medians, and per repeat), the
history tokens restored from the pool vs resident, the tokens the restoration's plan loads vs recomputes (the engine's
``PoolTier`` counters: planned — cacheflow's run-time meet may recompute more), and whether turns 1 and 2's tokens
equal ``generate`` (checked in every run against one reference).

    turn = second_turn(SecondTurnOptions(history=4096, rho=1.0), cost_for=ensure_cost)
    print_table(turn.title, turn.rows); turn.notes    # turn.folder holds second_turn.json and second_turn.png
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvflow.bench.bound import recompute_rate
from kvflow.bench.restore_bench import Bench
from kvflow.demo.chat import ChatWorkload, sessions
from kvflow.server.process import kvflow_engine
from kvflow.engine import EngineConfig, SamplingParams

STRATEGIES = ("recompute", "cacheflow")
Progress = Callable[[str], None]


@dataclass(slots=True)
class SecondTurnOptions:
    """What ``kvflow bench second-turn`` takes, parsed (the option help in cli/restore_cmds.py says what each means);
    None: the serve default (server/build.py)."""
    model: str | None = None
    history: int = 4096
    user_tokens: int = 64
    answer_tokens: int = 16
    rho: float = 1.0
    repeats: int = 3
    chunk_tokens: int | None = None
    pool_dir: Path | None = None
    seed: int = 0
    out: Path | None = None


@dataclass(slots=True)
class SecondTurn:
    """A finished run: ``results`` (run_second_turn's) as written to ``folder/second_turn.json``."""
    model: str
    folder: Path
    results: dict

    def to_json(self) -> dict:
        return self.results

    @property
    def title(self) -> str:
        res = self.results
        return (f"{self.model}: second turn ({res['turn2_prompt_tokens']:,} prompt tokens) after "
                f"{res['evicted_history_tokens']:,} tokens of history were evicted; pool at rho={res['rho']:g} "
                f"(recompute {res['recompute_rate_bytes_per_s'] / 2**20:.1f} MiB/s of KV, link "
                f"{res['link_bytes_per_s'] / 2**20:.1f} MiB/s)")

    @property
    def rows(self) -> list[dict]:
        return [{"strategy": s, "TTFT ms (median)": r["ttft_s"] * 1e3,
                 "each repeat ms": ", ".join(f"{t * 1e3:.0f}" for t in r["ttft_runs"]),
                 "from pool": r["pool_hit_tokens"], "resident": r["resident_hit_tokens"],
                 "planned loaded / recomputed": f"{r['loaded_tokens']:.0f} / {r['recomputed_tokens']:.0f}",
                 "exact": r["exact"]}
                for s, r in self.results["rows"].items()]

    @property
    def notes(self) -> list[str]:
        """The lines under the table (rich markup)."""
        res, lines = self.results, []
        if "cacheflow_vs_recompute" in res:
            each = ", ".join(f"{x:.2f}" for x in res["cacheflow_vs_recompute_each_repeat"])
            lines.append(f"cacheflow / recompute TTFT: [bold]{res['cacheflow_vs_recompute']:.2f}x[/] (medians; each "
                         f"repeat {each})")
        return lines + [f"JSON + PNG in {self.folder}"]


def second_turn(o: SecondTurnOptions, cost_for: Callable, progress: Progress = lambda s: None) -> SecondTurn:
    """Run ``o``; ``cost_for(runner, max_position)`` gives the cost model. Writes second_turn.json and .png."""
    from kvflow.model import load_model
    from kvflow.report import out_dir, save_figure, write_json
    from kvflow.server.build import DEFAULT_CHUNK_TOKENS, DEFAULT_MODEL

    model = o.model or DEFAULT_MODEL
    progress(f"building {model}")
    runner = load_model(model)
    runner.check_context_len(o.history + 4 * o.user_tokens + o.answer_tokens + 64)
    cost = cost_for(runner, max(8192, o.history * 2))
    folder = out_dir("second-turn", o.out)
    res = run_second_turn(runner, cost, history=o.history, user_tokens=o.user_tokens, answer_tokens=o.answer_tokens,
                          rho=o.rho, repeats=o.repeats, chunk_tokens=o.chunk_tokens or DEFAULT_CHUNK_TOKENS,
                          pool_dir=str(o.pool_dir) if o.pool_dir else None, seed=o.seed, progress=progress)
    write_json(folder / "second_turn.json", res)
    save_figure(folder / "second_turn.png", _draw_turns(res))
    return SecondTurn(model, folder, res)


def _draw_turns(res: dict):
    def draw(axes):
        ax = axes[0]
        names = list(res["rows"])
        for i, name in enumerate(names):
            runs = res["rows"][name]["ttft_runs"]
            ax.scatter([i] * len(runs), [t * 1e3 for t in runs], alpha=0.6)
            ax.bar(i, res["rows"][name]["ttft_s"] * 1e3, alpha=0.3)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"second turn, {res['evicted_history_tokens']:,} evicted tokens, rho={res['rho']:g}")
        ax.grid(alpha=0.3, axis="y")
    return draw


def turn_prompts(tokenizer, history: int, user_tokens: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(turn 1 messages, turn 2 messages without the answer) of one chat user with a ``history``-token system
    prompt; turn 2's messages get turn 1's answer inserted by the caller."""
    w = ChatWorkload("chat", users=1, rounds=2, system_tokens=history, user_tokens=user_tokens, seed=seed)
    w.validate()
    s = sessions(w)[0]
    first = [{"role": "system", "content": s.system}, {"role": s.turns[0][0], "content": s.turns[0][1]}]
    return first, [{"role": s.turns[1][0], "content": s.turns[1][1]}]


def _serve(engine, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], int, int]:
    """(TTFT s, output tokens, resident hit tokens, pool hit tokens) of one request served alone."""
    before = (engine.stats.resident_hit_tokens, engine.stats.pool_hit_tokens)
    t0 = time.perf_counter()
    sid = engine.add_request(prompt, params)
    ttft, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.seq_id == sid:
                ttft = ttft or time.perf_counter() - t0
                tokens += out.new_token_ids
    st = engine.stats
    return ttft, tokens, st.resident_hit_tokens - before[0], st.pool_hit_tokens - before[1]


def run_second_turn(runner, cost, *, history: int = 4096, user_tokens: int = 64, answer_tokens: int = 16,
                    rho: float = 1.0, repeats: int = 3, chunk_tokens: int = 64, strategies=STRATEGIES,
                    pool_dir: str | None = None, seed: int = 0, progress: Progress = lambda s: None) -> dict:
    """The run described in the module docstring; ``pool_dir``: the pools are extent files there (removed after
    each run) instead of memory."""
    defaults = EngineConfig()
    block, step = defaults.block_size, defaults.max_num_batched_tokens
    tok = runner_tokenizer(runner)
    first, second = turn_prompts(tok, history, user_tokens, seed)
    params = SamplingParams(max_tokens=answer_tokens, ignore_eos=True)
    p1 = tok.chat(first)
    # turn 2's prompt is fixed by turn 1's (greedy, exact) answer: the reference run gives both
    answer1 = _greedy(runner, p1, answer_tokens)
    messages2 = first + [{"role": "assistant", "content": tok.decode(answer1)}] + second
    p2 = tok.chat(messages2)
    want2 = _greedy(runner, p2, answer_tokens)
    kv = runner.kv_bytes_per_token()
    capacity = -(-(len(p2) + answer_tokens + block) // block) * block     # turn 2 fits the budget, with a block spare
    filler = [(7 * i + seed) % 256 for i in range(capacity - 1)]       # takes every block (max_tokens = 1)
    pool_bytes = ((4 * capacity * kv) >> 20) + 64 << 20

    load_before = os.getloadavg()
    progress("measuring the recompute rate (rho's denominator)")
    bench = Bench(runner, cost, chunk_tokens)
    bench.recompute_rate = recompute_rate(runner, chunk_tokens)
    runs = {s: [] for s in strategies}
    for rep in range(repeats):
        order = list(strategies) if rep % 2 == 0 else list(reversed(strategies))
        for name in order:
            progress(f"{name} ({rep + 1}/{repeats}): turn 1, eviction, turn 2 at rho={rho:g}")
            engine = kvflow_engine(runner, name, capacity * kv, block, pool_bytes, chunk_tokens, step, cost,
                                   pool_dir, pool_load=False)     # the strategies' restorations compared
            bench.pools[name] = engine.pool.pool
            try:
                bench.set_link(name, None)
                _, got1, _, _ = _serve(engine, p1, params)
                engine.pool.flush()
                _serve(engine, filler, SamplingParams(max_tokens=1, ignore_eos=True))
                engine.pool.flush()
                link = bench.set_link(name, rho)
                gc.collect()
                ttft, got2, resident, pool = _serve(engine, p2, params)
                runs[name].append({"ttft_s": ttft, "resident_hit_tokens": resident, "pool_hit_tokens": pool,
                                   "link_bytes_per_s": link, "turn1_exact": got1 == answer1, "exact": got2 == want2,
                                   "restores": engine.pool.counters["restores"],
                                   "loaded_tokens": engine.pool.loaded_tokens[name],
                                   "recomputed_tokens": engine.pool.recomputed_tokens[name]})
            finally:
                bench.set_link(name, None)
                engine.close()
                bench.pools.pop(name).close()
                if pool_dir is not None:
                    shutil.rmtree(Path(pool_dir) / f"serve-{name}", ignore_errors=True)   # fresh_pool's folder
    rows = {}
    for name, got in runs.items():
        rows[name] = {"strategy": name, "ttft_s": statistics.median(r["ttft_s"] for r in got),
                      "ttft_runs": [r["ttft_s"] for r in got],
                      "pool_hit_tokens": min(r["pool_hit_tokens"] for r in got),
                      "resident_hit_tokens": max(r["resident_hit_tokens"] for r in got),
                      "loaded_tokens": statistics.median(r["loaded_tokens"] for r in got),
                      "recomputed_tokens": statistics.median(r["recomputed_tokens"] for r in got),
                      "exact": all(r["exact"] and r["turn1_exact"] for r in got)}
    result = {"model": runner.name, "history_tokens": history, "turn1_prompt_tokens": len(p1),
              "turn2_prompt_tokens": len(p2),
              "evicted_history_tokens": min(r["pool_hit_tokens"] for got in runs.values() for r in got),
              "answer_tokens": answer_tokens, "rho": rho, "repeats": repeats, "chunk_tokens": chunk_tokens,
              "block_size": block, "max_num_batched_tokens": step, "kv_budget_tokens": capacity,
              "recompute_rate_bytes_per_s": bench.recompute_rate, "link_bytes_per_s": rho * bench.recompute_rate,
              "pool": "memory" if pool_dir is None else f"extent file under {pool_dir}",
              "load_average": {"start": load_before, "end": os.getloadavg()}, "rows": rows, "runs": runs}
    if "cacheflow" in rows and "recompute" in rows:
        per = [c["ttft_s"] / r["ttft_s"] for c, r in zip(runs["cacheflow"], runs["recompute"])]
        result["cacheflow_vs_recompute"] = rows["cacheflow"]["ttft_s"] / rows["recompute"]["ttft_s"]
        result["cacheflow_vs_recompute_each_repeat"] = per
    return result


def runner_tokenizer(runner):
    from kvflow.engine.tokenizer import ByteTokenizer
    return ByteTokenizer(runner.config.vocab_size)


def _greedy(runner, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy ``generate`` with eos ignored (as the requests ask): the exactness reference."""
    import torch
    with torch.inference_mode():
        out = runner.hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None,
                                       pad_token_id=0)
    return out[0, len(prompt):].tolist()
