"""A/B of grouped follow-up chunks (kvflow/engine/attention.py, ``SegmentGroup``): one ``BatchRunner`` step of k
chunks that continue their histories (q tokens on ctx cached) beside d decodes, attended as groups against one by
one, in the same process, arms interleaved repeat by repeat.

    PYTHONPATH=src .venv/bin/python docs/bench/chunk_groups_ab.py [--repeats 7] [--model smollm2-135m]

Prints each configuration's median step time per arm, the median ratio and its range over the repeats, and the
largest logits difference between the arms (the K/V are random here, so it is not an exactness figure: the tests
compare both paths with full prefills).
"""

import argparse
import statistics
import time

import torch

from kvflow.engine import model_runner
from kvflow.engine.model_runner import BatchRunner, StepItem
from kvflow.engine.paged_cache import PagedKVCache
from kvflow.model.runner import load_model
from kvflow.threads import use_compute_threads

SHAPES = ((2, 300, 40, 4), (4, 300, 40, 4), (4, 600, 16, 6), (6, 250, 48, 2), (3, 1000, 100, 4))  # k, ctx, q, d
BLOCK = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    use_compute_threads()
    runner = load_model(args.model)
    cache = PagedKVCache(runner.num_layers, 4096, BLOCK, runner.kv_heads, runner.head_dim)
    cache.kv.normal_()
    batch = BatchRunner(runner, cache)
    grouped = model_runner.groups_of_segments
    arms = {"grouped": grouped, "one by one": lambda segs, *a: ([], segs)}

    def table(i: int, n: int) -> list[int]:
        return list(range(i * 150, i * 150 + (n + BLOCK - 1) // BLOCK))

    for k, ctx, q, d in SHAPES:
        items = [StepItem(table(i, ctx + q), ctx, [(7 * i + j) % 1000 + 1 for j in range(q)], True) for i in range(k)]
        items += [StepItem(table(20 + j, ctx + 1), ctx, [5], True) for j in range(d)]
        logits, times = {}, {name: [] for name in arms}
        for name, fn in arms.items():
            model_runner.groups_of_segments = fn
            logits[name] = batch.execute(items)                                 # warm-up, and the logits compared
        for _ in range(args.repeats):
            for name, fn in arms.items():
                model_runner.groups_of_segments = fn
                t = time.perf_counter()
                batch.execute(items)
                times[name].append(time.perf_counter() - t)
        model_runner.groups_of_segments = grouped
        ratios = sorted(a / b for a, b in zip(times["grouped"], times["one by one"]))
        diff = (logits["grouped"] - logits["one by one"]).abs().max().item()
        print(f"{k} chunks of {q} on {ctx} + {d} decodes: grouped {statistics.median(times['grouped']) * 1e3:.0f} ms, "
              f"one by one {statistics.median(times['one by one']) * 1e3:.0f} ms, ratio {statistics.median(ratios):.3f} "
              f"({ratios[0]:.3f}-{ratios[-1]:.3f}); logits max diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
