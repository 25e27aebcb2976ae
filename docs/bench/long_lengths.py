"""Redraw the TTFT-vs-length figure of docs/BENCHMARKS.md ("Long contexts") from the published runs' JSON: run A
(8K-64K, long_tiny.json) and run B (128K, long_tiny_128k.json) are separate `kvflow bench restore` runs (the 128K
point alone takes 23 min), drawn on one pair of axes by the bench's own plot.

    .venv/bin/python docs/bench/long_lengths.py        # -> docs/bench/long_length_sweep.png
"""

import json
from pathlib import Path

from kvflow.bench.restore_bench import plot_lengths

HERE = Path(__file__).parent


def points(name: str) -> list[dict]:
    """A run's length sweep with each point's rows keyed by strategy (as the bench holds them)."""
    sweep = json.loads((HERE / name).read_text())["length_sweep"]
    return [{**p, "rows": {r["strategy"]: r for r in p["rows"]}} for p in sweep]


if __name__ == "__main__":
    merged = sorted(points("long_tiny.json") + points("long_tiny_128k.json"), key=lambda p: p["context"])
    plot_lengths(merged, HERE / "long_length_sweep.png", "tiny, rho=1 (vs each context's recompute): runs A + B")
    print("wrote", HERE / "long_length_sweep.png")
