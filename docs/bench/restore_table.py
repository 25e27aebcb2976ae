"""The restore tables of docs/BENCHMARKS.md, read from a `kvflow bench restore` JSON (nothing typed by hand).

    .venv/bin/python docs/bench/restore_table.py docs/bench/restore-8k.json

Prints the rho-sweep table (medians of the run's interleaved repeats), the ratios issue 9 asks for, and each
point's tail after the grid (ttft_s - restore_s) for `token` and `staircase`.
"""

import json
import sys

from kvflow.bench.restore_bench import speedups

ORDER = ("recompute", "load", "load-layerwise", "cake", "token", "layer", "staircase", "cacheflow")


def main(path: str) -> None:
    run = json.load(open(path))
    print(f"recompute rate measured {run['recompute_rate_mib_s']:.2f} MiB/s, profile "
          f"{run['profiled_recompute_rate_mib_s']:.2f}")
    print("| ρ | pool | " + " | ".join(ORDER) + " | cacheflow plan | cacheflow / best other | cacheflow / measured bound"
          " | tail token / staircase | repeat spread |")
    print("|---" * (len(ORDER) + 7) + "|")
    worst = []
    for point in run["rho_sweep"]:
        rows = {r["strategy"]: r for r in point["rows"]}
        cf = rows["cacheflow"]
        sp = speedups(rows)           # the bench's own comparison (older JSON lacks its newer fields)
        best, ratio, spread = sp["best_other"], sp["cacheflow_vs_best_other"], sp["repeat_spread"]
        worst.append((ratio, point["rho"], point["latency_s"], point["pool"]))
        pool = point["pool"]      # names its per-read latency
        tails = " / ".join(f"{rows[k]['ttft_s'] - rows[k]['restore_s']:.3f}" for k in ("token", "staircase"))
        print(f"| {point['rho']:g} | {pool} | " + " | ".join(f"{rows[k]['ttft_s']:.3f}" for k in ORDER)
              + f" | {cf['plan']} ({cf.get('chose')}) | {ratio:.3f} ({best}) | {cf['vs_measured_bound']:.2f} | {tails} | {spread:.3f} |")
    acc = run["acceptance"]
    print(f"rho=1: / measured bound {acc['rho1_cacheflow_vs_measured_bound']:.3f}, / min(recompute, load) "
          f"{acc['rho1_cacheflow_vs_min_recompute_load']:.3f}, / best other {acc['rho1_cacheflow_vs_best_other']:.3f}, "
          f"/ cake {acc['rho1_cacheflow_vs_cake']:.3f}")
    within = sum(r <= 1.03 for r, *_ in worst)
    print(f"sweep: {within} of {len(worst)} points within 3% of the best other; worst {max(worst)[0]:.3f} at "
          f"rho={max(worst)[1]:g}" + (f" + {max(worst)[2] * 1e6:g} µs" if max(worst)[2] else ""))


if __name__ == "__main__":
    main(sys.argv[1])
