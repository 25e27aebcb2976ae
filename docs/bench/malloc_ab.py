"""A/B of the host-memory fix (kvflow/model/host_memory.py): the noise-floor computation in alternating processes,
``KVFLOW_MALLOC=keep`` (the default) against ``KVFLOW_MALLOC=default`` (glibc's own thresholds).

    .venv/bin/python docs/bench/malloc_ab.py [--rounds 3] [--passes 4] [--out docs/bench/malloc_ab.json]

Each process warms up with one pass and times ``--passes`` more (docs/bench/noise_floor.py); the arms alternate
round by round, so a drift in the machine's speed hits both. Prints each arm's median pass and minor faults.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    arms = {"keep": [], "default": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for arm in arms:
                out = Path(tmp) / f"{arm}{r}.json"
                subprocess.run([sys.executable, str(HERE / "noise_floor.py"), "--passes", str(args.passes),
                                "--out", str(out)], env={**os.environ, "KVFLOW_MALLOC": arm}, check=True,
                               stdout=subprocess.DEVNULL)
                arms[arm].append(json.loads(out.read_text())["passes"])
                walls = [p["wall_s"] for p in arms[arm][-1]]
                print(f"round {r + 1} {arm:8s} passes " + " ".join(f"{w:.3f}" for w in walls), flush=True)
    summary = {arm: {"median_pass_s": statistics.median(p["wall_s"] for rnd in rounds for p in rnd),
                     "median_minor_faults": statistics.median(p["minor_faults"] for rnd in rounds for p in rnd),
                     "rounds": rounds} for arm, rounds in arms.items()}
    for arm, s in summary.items():
        print(f"{arm:8s} median pass {s['median_pass_s']:.3f} s, median minor faults {s['median_minor_faults']:.0f}")
    print(f"keep / default: {summary['keep']['median_pass_s'] / summary['default']['median_pass_s']:.3f}")
    if args.out:
        json.dump(summary, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
