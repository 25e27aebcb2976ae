"""Engines share contexts through the cluster: what one process stored, another process — with its own empty local
devices and no index of the first — finds and restores, and its output equals a full prefill / the same greedy
answer. Keys are content addresses, so nothing but the store is shared."""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch

from kvflow import KVPool, Restorer
from tests.remote.helpers import remote_cfg
from tests.restore.test_restore_exactness import assert_exact, ids, synthetic_cost
from kvflow.net import free_port
from tests.server.helpers import kvflow_serve

ROOT = str(Path(__file__).resolve().parents[2])
C = 32
pytestmark = pytest.mark.timeout(300)

FIRST = textwrap.dedent("""
    import json, sys, torch
    from kvflow import KVPool, Restorer, load_model
    from tests.restore.test_restore_exactness import synthetic_cost
    cfg, context = json.loads(sys.argv[1]), torch.tensor(json.loads(sys.argv[2]))
    runner = load_model("tiny")
    with KVPool.open(cfg) as pool:
        Restorer(runner, pool, cost=synthetic_cost(runner), calibrate=False).store(context)
""")


@pytest.mark.parametrize("placement", ["copy", "stripe"])
def test_a_second_process_restores_what_the_first_stored_on_the_cluster_exactly(tiny, cluster, placement):
    local = [{"type": "memory", "capacity": "32M"}] if placement == "copy" else []
    cfg = remote_cfg(cluster, *local, chunk_tokens=C, remote_placement=placement)
    context, query = ids(6 * C + 5, 31), ids(7, 32)
    done = subprocess.run([sys.executable, "-c", FIRST, json.dumps(cfg), json.dumps(context.tolist())],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    try:
        with KVPool.open(cfg) as pool:            # its local devices are empty: it has only the cluster
            assert pool.stats()["records"] == 0
            restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
            req, _ = restorer.lookup(context, query.numel())
            assert req.stored_chunks == 6
            out = restorer.restore(context, query, "load")
            assert_exact(tiny, out, context, query)
            assert pool.stats()["hits"] == 6 * tiny.num_layers and pool.stats()["misses"] == 0
    finally:
        for p in cluster.live:
            cluster._cli("flushall", port=p)


def _metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name) and "_created" not in line)


def test_two_kvflow_serve_processes_share_a_long_context_through_the_cluster(cluster, tmp_path):
    pool = remote_cfg(cluster, {"type": "memory", "capacity": "32M"}, chunk_tokens=C, remote_placement="copy")
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(json.dumps({"engine": {"kv_budget": "4M", "block_size": 8}, "pool": pool}))   # JSON is YAML
    ports = [free_port(), free_port()]
    procs = [kvflow_serve(cfg, p, tmp_path / f"serve-{p}.log").spawn() for p in ports]
    prompt = ids(8 * C + 3, 41).tolist()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    try:
        for proc in procs:
            proc.wait_ready(180)
        first = httpx.post(f"http://127.0.0.1:{ports[0]}/v1/completions", json=body, timeout=120).json()
        deadline, seen = time.monotonic() + 60, -1
        while time.monotonic() < deadline:        # the first engine's pool tier writes after the answer
            n = cluster.keys()
            if n == seen and n > 0:
                break
            seen = n
            time.sleep(0.5)
        def from_the_pool() -> float:    # a restoration, or a load into the blocks (whichever was predicted sooner)
            return _metric(ports[1], "kvflow_pool_restores") + _metric(ports[1], "kvflow_pool_loads")
        assert from_the_pool() == 0
        second = httpx.post(f"http://127.0.0.1:{ports[1]}/v1/completions", json=body, timeout=120).json()
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert from_the_pool() == 1          # the second engine took the context from the cluster, not prefilled
    finally:
        for proc in procs:
            proc.kill()
        for p in cluster.live:
            cluster._cli("flushall", port=p)
