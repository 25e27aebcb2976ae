"""A/B of the native chunk attention op (kvflow/model/chunk_attention.py) against torch's paths it replaces, one layer's
attention of one chunk, on smollm2-135m's head layout (9 query / 3 KV heads of 64) unless told otherwise.

    .venv/bin/python docs/bench/chunk_attention_ab.py [--rounds 3] [--calls 20] [--out docs/bench/chunk_attention_ab.json]

torch's path is what the engine ran before the op: a chunk from position 0 is one causal flash call (GQA), a chunk on
cached keys is ``prefix_plus_diagonal`` (two flash calls merged by log-sum-exp). Per round and shape the two arms run
back to back, their order alternating by round, ``--calls`` calls each after two warm-ups; a round's figure is the
median call. Prints each shape's median over rounds for both arms and the ratio's spread (native / torch per round).
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvflow import native
from kvflow.model import chunk_attention
from kvflow.model.attention import prefix_plus_diagonal

SHAPES = [(44, 288), (64, 0), (128, 0), (332, 0), (512, 0), (1024, 0), (512, 4096), (512, 7680)]


def timed(fn, calls: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    if not native.loaded():
        raise SystemExit("kvflow's native ops are not built here (make setup)")
    g = torch.Generator().manual_seed(0)
    rows = []
    for n, start in SHAPES:
        q = torch.randn(n, hq, d, generator=g)
        k, v = torch.randn(start + n, hkv, d, generator=g), torch.randn(start + n, hkv, d, generator=g)
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))       # transformers' [1, H, T, D]
        if start == 0:
            def torch_arm():
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=hq != hkv)
        else:
            def torch_arm():
                return prefix_plus_diagonal(qt, kt, vt, start, None)

        def native_arm():
            return chunk_attention.dense(qt, kt, vt, start, d ** -0.5, None)

        arms = {"torch": [], "native": []}
        for r in range(args.rounds):
            for name in (("torch", "native") if r % 2 == 0 else ("native", "torch")):
                arms[name].append(timed(torch_arm if name == "torch" else native_arm, args.calls))
        ratios = [a / b for a, b in zip(arms["native"], arms["torch"])]
        flop = 4 * hq * n * (start + (n + 1) / 2) * d                # causal: each query over its own keys
        row = {"queries": n, "cached": start, "torch_ms": statistics.median(arms["torch"]) * 1e3,
               "native_ms": statistics.median(arms["native"]) * 1e3, "ratio": statistics.median(ratios),
               "ratio_min": min(ratios), "ratio_max": max(ratios),
               "native_gflops": flop / statistics.median(arms["native"]) / 1e9, "rounds": arms}
        rows.append(row)
        print(f"{n:5d} queries on {start:5d} cached: torch {row['torch_ms']:7.3f} ms  native {row['native_ms']:7.3f} ms"
              f"  native/torch {row['ratio']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
              f"  {row['native_gflops']:.0f} GFLOP/s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"heads": [hq, hkv, d], "threads": torch.get_num_threads(),
                                              "cpu": os.cpu_count(), "load_average": os.getloadavg(),
                                              "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
