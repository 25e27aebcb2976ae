import json, statistics, sys, time, torch
import kvflow
from kvflow import KVPool, Restorer, load_model
from kvflow.cost import cost_profile
runner = load_model("qwen2.5-0.5b@layers=4")
cost = cost_profile(runner)
out = {"src": kvflow.__file__}
g = torch.Generator().manual_seed(1)
for n, strategy, rho in [(8192, "load", None), (8192, "cacheflow", 8.0), (4096, "cacheflow", 1.0)]:
    pool = KVPool.memory("2G", chunk_tokens=256, devices=2)
    r = Restorer(runner, pool, cost=cost)
    ctx = torch.randint(0, 30000, (n,), generator=g); q = torch.randint(0, 30000, (32,), generator=g)
    r.store(ctx)
    if rho: pool.set_throttle(cost.bandwidth_for_rho(rho))
    r.restore(ctx, q, strategy)
    t = [r.restore(ctx, q, strategy).timings.ttft_s for _ in range(5)]
    out[f"{strategy}-{n}-{rho}"] = statistics.median(t)
    pool.close()
print(json.dumps(out))
