"""A workload-matrix cell replayed in the engine (no HTTP) on a virtual clock: each step lasts what the cost model
prices its work at (``CostModel.added_time`` of every scheduled slice, plus the step's per-call and per-step
overheads and one LM head per sequence), the arrivals and the follow-up turns (after their think time) land on that
clock. The schedule — and so every figure below — is a function of the code and the workload alone, not of what
else the machine is running: two scheduler versions compare exactly, side by side, on a busy box. Seconds here are
the model's, not measured (docs/BENCHMARKS.md has those).

    PYTHONPATH=src python -m tests.engine.virtual_replay prefix light --share 0.25 [--policy remaining-work]
        [--starvation F] [--requests] [--steps]

Prints one line: TTFT mean / P50 / P99 (later turns' P99), ITL P50 / P99 / max, request latency mean / P99 (arrival
to last token), wall, output tokens/s, swaps,
preemptions, the steps whose budget cut was moved to a later arrival, computed tokens, steps and the mean decode
batch; ``--requests`` adds a line per request, ``--steps`` one per step (who decoded, who prefilled how much, who
waits, free blocks, who was swapped or preempted).
"""

from __future__ import annotations

import argparse
import heapq
import statistics

from kvflow.bench.matrix import SHAPES, MatrixOptions, workload_of
from kvflow.bench.serve_run import ServeRunOptions, engine_options, load_for, prepare
from kvflow.cli.restore_cmds import ensure_cost
from kvflow.demo.chat import chat_ids, sessions
from kvflow.engine.sampling import SamplingParams
from kvflow.server.process import kvflow_engine
from kvflow.threads import in_fresh_thread


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))] if xs else float("nan")


def replay(kind: str, level: str, share: float, policy: str, model: str, per_request: bool, per_step: bool,
           starvation: float | None = None) -> dict:
    o = MatrixOptions(workloads=(kind,))                  # the matrix's shape, block and step sizes
    w = workload_of(o, kind, SHAPES[kind].rates[level])
    base = ServeRunOptions(w, model=model, configs="cacheflow", block_size=o.block_size, max_batched=o.max_batched,
                           kv_share=share)
    loaded = load_for(base, True, ensure_cost)
    p = prepare(base, False, loaded)
    runner, tok, cost = loaded[0], loaded[1], p.cost
    layers = cost.num_layers
    eng = in_fresh_thread(kvflow_engine, runner, tokenizer=tok, **engine_options(base, p, "cacheflow", policy))
    if starvation is not None:                # the bench builds its EngineConfig itself: KVFLOW_ENGINE_* is not read
        eng.scheduler.config.starvation_factor = starvation
    sched, clock, moved = [], [0.0], [0]
    schedule = eng.scheduler.schedule
    reorder = eng.scheduler._older_first_at_the_cut

    def counted(order, ranks, budget, blocked):     # steps where the budget's cut was moved to a later arrival
        out = reorder(order, ranks, budget, blocked)
        moved[0] += out is not order
        return out
    eng.scheduler._older_first_at_the_cut = counted

    def traced():
        out = schedule()
        sched.append([(s.num_tokens, s.start) for s in out.scheduled])
        if per_step:
            bm, sc = eng.blocks, eng.scheduler
            print(f"step {len(sched)} t={clock[0]:.2f} decodes {sum(1 for s in out.scheduled if s.num_tokens == 1)} "
                  f"prefill {[(s.seq.seq_id, s.num_tokens) for s in out.scheduled if s.num_tokens > 1]} "
                  f"running {[s.seq_id for s in sc.running]} waiting "
                  f"{[(s.seq_id, s.first_token_s is not None, bm.needed(s, bm.match(s)[0])) for s in sc.waiting]} "
                  f"free {bm.num_free} swapped {[s.seq_id for s in out.swapped]} "
                  f"preempted {[s.seq_id for s in out.preempted]}")
        return out
    eng.scheduler.schedule = traced

    def step_s(scheduled) -> float:
        if not scheduled:
            return 0.0
        return layers * cost.d + cost.e + sum(cost.added_time(n, start, layers) + cost.head for n, start in scheduled)

    params = SamplingParams(max_tokens=w.answer_tokens, ignore_eos=True)
    ss = sessions(w)

    def run():
        events = [(s.arrival_s, u, 0) for u, s in enumerate(ss)]
        heapq.heapify(events)
        history = {u: ([{"role": "system", "content": s.system}] if s.system else []) for u, s in enumerate(ss)}
        meta, last, gaps, done = {}, {}, [], 0
        total = sum(len(s.turns) for s in ss)
        while done < total:
            while events and events[0][0] <= clock[0]:
                t, u, k = heapq.heappop(events)
                msgs = history[u] + [{"role": ss[u].turns[k][0], "content": ss[u].turns[k][1]}]
                prompt = chat_ids(tok, msgs)
                meta[eng.add_request(prompt, params)] = dict(user=u, turn=k, arrival=t, msgs=msgs, out=[], first=None,
                                                             prompt=len(prompt))
            if not eng.has_unfinished():
                clock[0] = events[0][0]
                continue
            n = len(sched)
            outputs = eng.step()
            if len(sched) > n:
                clock[0] += step_s(sched[-1])
            for o in outputs:
                m = meta[o.seq_id]
                if o.new_token_ids:
                    if m["first"] is None:
                        m["first"], m["cached"] = clock[0] - m["arrival"], o.cached_tokens
                    elif o.seq_id in last:
                        gaps.append(clock[0] - last[o.seq_id])
                    last[o.seq_id] = clock[0]
                    m["out"] += o.new_token_ids
                if o.finished:
                    done += 1
                    m["end"] = clock[0]
                    s = ss[m["user"]]
                    if s.keep_history and m["turn"] + 1 < len(s.turns):
                        history[m["user"]] = m["msgs"] + [{"role": "assistant", "content": m["out"]}]
                        heapq.heappush(events, (clock[0] + s.turns[m["turn"]][2], m["user"], m["turn"] + 1))
        return meta, gaps

    try:
        meta, gaps = in_fresh_thread(run)
    finally:
        eng.close()
    if per_request:
        for sid, m in sorted(meta.items()):
            print(f"request {sid} user {m['user']} turn {m['turn']} arrival {m['arrival']:.2f} prompt {m['prompt']} "
                  f"cached {m.get('cached')} ttft {m['first']:.2f} end {m['end']:.2f}")
    ttft = [m["first"] for m in meta.values()]
    latency = [m["end"] - m["arrival"] for m in meta.values()]          # sent to last token
    wall = clock[0]
    return {"workload": kind, "level": level, "share": share, "policy": policy,
            "starvation": eng.scheduler.config.starvation_factor,
            "ttft_mean": statistics.mean(ttft), "ttft_p50": statistics.median(ttft), "ttft_p99": p99(ttft),
            "later_p99": p99([m["first"] for m in meta.values() if m["turn"] > 0]),
            "itl_p50": statistics.median(gaps) if gaps else float("nan"), "itl_p99": p99(gaps),
            "itl_max": max(gaps, default=float("nan")), "latency_mean": statistics.mean(latency),
            "latency_p99": p99(latency), "wall": wall,
            "tok_s": sum(len(m["out"]) for m in meta.values()) / wall, "swaps": eng.stats.swaps,
            "preemptions": eng.stats.preemptions, "cuts_moved": moved[0], "computed": eng.stats.computed_tokens,
            "steps": eng.stats.steps,
            "decode_batch": statistics.mean(sum(1 for n, _ in sc if n == 1) for sc in sched if sc)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=sorted(SHAPES))
    ap.add_argument("level", choices=("light", "saturated"))
    ap.add_argument("--share", type=float, default=0.25, help="KV budget as a share of the working set (0.25, 1)")
    ap.add_argument("--policy", default="remaining-work", choices=("remaining-work", "first-token", "fcfs"))
    ap.add_argument("--starvation", type=float, default=None, help="engine.starvation_factor F (default: the engine's)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", action="store_true", help="a line per request")
    ap.add_argument("--steps", action="store_true", help="a line per step")
    a = ap.parse_args()
    if a.starvation is not None and a.starvation < 1:
        ap.error(f"--starvation must be >= 1 (engine.starvation_factor), got {a.starvation:g}")
    r = replay(a.workload, a.level, a.share, a.policy, a.model, a.requests, a.steps, a.starvation)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
