"""Issue 32's re-check shape at small scale, in the engine (no HTTP): users whose long first turns arrive close
together and whose short follow-ups then queue behind the other users' first-turn prefills. Time is counted in
engine steps (deterministic) and seconds (this machine, for a reader only).

    PYTHONPATH=src python -m tests.engine.second_turns --model tiny --users 8 --first 2048 --policies fcfs,first-token,remaining-work
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from kvflow import KVPool, Restorer, load_model
from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.helpers import ids, synthetic_cost


@dataclass(slots=True)
class Turn:
    user: int
    turn: int
    arrival_step: int
    arrival_s: float
    prompt: list[int]
    first_step: int | None = None
    first_s: float | None = None


@dataclass(slots=True)
class Shape:
    users: int = 8
    first: int = 2048          # first-turn prompt tokens
    follow: int = 100          # follow-up message tokens
    answer: int = 8            # answer tokens
    turns: int = 3
    gap: int = 2               # steps between two users' first turns
    think: int = 0             # steps between an answer and the next turn
    budget_tokens: int = 0     # resident KV (tokens); 0: exactly the users' first turns (issue 32: 8 x 4K = 32K)
    step_tokens: int = 512     # max_num_batched_tokens


@dataclass(slots=True)
class Result:
    policy: str
    turns: list[Turn] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    swaps: int = 0
    restores: int = 0
    loads: int = 0

    def waits(self, turn: int, unit: str = "steps") -> list[float]:
        if unit == "steps":
            return [t.first_step - t.arrival_step + 1 for t in self.turns if t.turn == turn]
        return [t.first_s - t.arrival_s for t in self.turns if t.turn == turn]


def run(runner, policy: str, shape: Shape, pool: bool = True) -> Result:
    budget = shape.budget_tokens or shape.users * shape.first
    block = 16
    restorer = (Restorer(runner, KVPool.memory("2G", chunk_tokens=64), cost=synthetic_cost(runner)) if pool
                else None)
    eng = LLMEngine(runner, EngineConfig(block_size=block, num_blocks=budget // block, scheduling_policy=policy,
                                         max_num_batched_tokens=shape.step_tokens), restorer=restorer)
    res, params = Result(policy), SamplingParams(max_tokens=shape.answer, ignore_eos=True)
    history = {u: ids(shape.first, 1000 + u) for u in range(shape.users)}
    due = {u: (u * shape.gap, 1) for u in range(shape.users)}        # user -> (step of the next turn, turn)
    live: dict[int, Turn] = {}
    t0, step = time.perf_counter(), 0
    while due or eng.has_unfinished():
        for u, (at, turn) in list(due.items()):
            if at <= step:
                del due[u]
                prompt = history[u] if turn == 1 else history[u] + ids(shape.follow, 10_000 * turn + u)
                t = Turn(u, turn, step, time.perf_counter() - t0, prompt)
                live[eng.add_request(prompt, params)] = t
                res.turns.append(t)
        for out in eng.step():
            t = live[out.seq_id]
            if t.first_step is None:
                t.first_step, t.first_s = step, time.perf_counter() - t0
            t.prompt = t.prompt + out.new_token_ids
            if out.finished:
                history[t.user] = t.prompt
                if t.turn < shape.turns:
                    due[t.user] = (step + 1 + shape.think, t.turn + 1)
        if eng.pool is not None:
            eng.pool.flush()
        step += 1
    res.steps, res.seconds, res.swaps = eng.stats.steps, time.perf_counter() - t0, eng.stats.swaps
    res.restores = eng.pool.counters["restores"] if eng.pool is not None else 0
    res.loads = eng.pool.counters["loads"] if eng.pool is not None else 0
    eng.close()
    return res


def table(results: list[Result]) -> str:
    def p99(xs):
        return sorted(xs)[max(0, int(round(0.99 * len(xs))) - 1)]
    lines = [f"{'policy':<15} {'2nd turn steps max/mean':>24} {'2nd s max/mean':>16} {'1st steps max/mean':>19} "
             f"{'3rd steps max':>13} {'steps':>6} {'s':>6} {'swaps':>5} {'loads':>5} {'restores':>8}"]
    for r in results:
        s2, s2s, s1, s3 = r.waits(2), r.waits(2, "s"), r.waits(1), r.waits(3)
        lines.append(f"{r.policy:<15} {p99(s2):>14} / {sum(s2) / len(s2):>7.1f} {p99(s2s):>7.2f} / {sum(s2s) / len(s2s):>6.2f}"
                     f" {p99(s1):>9} / {sum(s1) / len(s1):>7.1f} {max(s3) if s3 else 0:>13} {r.steps:>6}"
                     f" {r.seconds:>6.1f} {r.swaps:>5} {r.loads:>5} {r.restores:>8}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--policies", default="fcfs,first-token,remaining-work")
    ap.add_argument("--no-pool", action="store_true")
    for name, default in Shape().__annotations__.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(Shape(), name))
    args = ap.parse_args()
    shape = Shape(**{k: getattr(args, k) for k in Shape.__annotations__})
    runner = load_model(args.model)
    results = [run(runner, p, shape, pool=not args.no_pool) for p in args.policies.split(",")]
    print(shape)
    print(table(results))
    for r in results:
        print(r.policy, "2nd-turn steps per user:", r.waits(2))


if __name__ == "__main__":
    main()
