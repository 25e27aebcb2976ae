"""Planning time of `cacheflow` at 8K (qwen2.5-0.5b@layers=4's profile), base 3f82804 vs the working tree, in one
process, interleaved (15 plans each at rho = 1 and 8), medians; asserts both pick the same plan.

    git show 3f82804:src/kvflow/planner/strategies.py > /tmp/old_strategies.py
    .venv/bin/python docs/bench/plan_ab.py PROFILE.json > docs/bench/plan_ab.json

(The committed plan_ab.json was made with a hand-written 64-byte record header; the cell size now takes the
record's own, kvflow.chunks.record.HEADER_SIZE (128 bytes), as the restorer's I/O model does — 64 bytes more in
a 262 KB cell; not re-run since.)
"""
import importlib.util
import json
import statistics
import sys
import time

import kvflow.planner.strategies as new
from kvflow.chunks.record import HEADER_SIZE
from kvflow.cost.model import CostModel
from kvflow.planner.predict import IOModel

spec = importlib.util.spec_from_file_location("old_strategies", "/tmp/old_strategies.py")
old = importlib.util.module_from_spec(spec)
sys.modules["old_strategies"] = old
spec.loader.exec_module(old)
cost = CostModel.load(sys.argv[1])
ms = {"base": [], "new": []}
for rho in (1, 8):
    io = IOModel(bandwidth=cost.bandwidth_for_rho(rho), cell_bytes=256 * cost.kv_bytes_per_token_layer + HEADER_SIZE)
    for _ in range(15):
        for name, mod in (("base", old), ("new", new)):
            planner = mod.Planner(cost, io, 4, 256, mod.PlannerConfig())
            t = time.perf_counter()
            planner.plan("cacheflow", mod.Request(8192, 32, 32))
            ms[name].append((time.perf_counter() - t) * 1e3)
    a = old.Planner(cost, io, 4, 256, old.PlannerConfig()).plan("cacheflow", old.Request(8192, 32, 32))
    b = new.Planner(cost, io, 4, 256, new.PlannerConfig()).plan("cacheflow", new.Request(8192, 32, 32))
    assert a.split == b.split and a.notes["chose"] == b.notes["chose"]
med = {k: statistics.median(v) for k, v in ms.items()}
print(json.dumps({"median_ms": med, "new_over_base": med["new"] / med["base"], "same_plans": True, "runs_ms": ms}))
