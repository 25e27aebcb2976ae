"""The noise floor of this machine: one identical computation timed again and again, nothing else in the process.

    .venv/bin/python docs/bench/noise_floor.py [--passes 8] [--out docs/bench/noise_floor.json]

A 4,096-token context of `qwen2.5-0.5b@layers=4` recomputed chunk by chunk (256 tokens) through the runner, with
torch's default threads; per pass: wall seconds, the CPU time stolen by the hypervisor (/proc/stat), and the
process's minor page faults. The spread of these passes is what any two TTFTs measured here can differ by without
any difference in the plan: the resolution of a "within 3%" comparison (docs/BENCHMARKS.md, issue 9).
"""

import argparse
import json
import resource
import statistics
import time

import torch

from kvflow.model.runner import load_model


def cpu_ticks() -> tuple[int, int]:
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    return fields[7], sum(fields)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runner = load_model("qwen2.5-0.5b@layers=4")
    n = args.tokens
    ids = torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(1))
    cache = runner.new_cache(n)
    passes = []
    for i in range(args.passes + 1):             # the first pass warms up and is not counted
        s0, a0 = cpu_ticks()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        for a in range(0, n, 256):
            runner.prefill_range(cache, ids[a:a + 256], a)
        wall = time.perf_counter() - t0
        s1, a1 = cpu_ticks()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        if i:
            passes.append({"wall_s": wall, "steal_pct": 100 * (s1 - s0) / max(1, a1 - a0), "minor_faults": faults})
            print(f"pass {i}: {wall:.3f} s, steal {passes[-1]['steal_pct']:.1f}%, {faults} minor faults", flush=True)
    walls = [p["wall_s"] for p in passes]
    summary = {"model": runner.name, "tokens": n, "threads": torch.get_num_threads(), "passes": passes,
               "max_over_min": max(walls) / min(walls), "cv": statistics.pstdev(walls) / statistics.mean(walls)}
    print(f"max / min {summary['max_over_min']:.3f}, coefficient of variation {summary['cv']:.3f}")
    if args.out:
        json.dump(summary, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
