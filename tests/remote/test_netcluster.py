"""Two engines on hosts of their own share a context through a Redis cluster on hosts of its own (network namespaces,
kvflow/bench/netcluster.py): engine B restores exactly what engine A stored; a master killed, its replica takes over
and B still restores exactly (a record lost would be a recompute, never a wrong value); nothing of the cluster
remains afterwards. Skips without root, iproute2 or redis-server."""

import json
import os
import time

import pytest

from kvflow import KVPool, Restorer
from kvflow.bench.netcluster import NetCluster, leftovers, netcluster_available
from tests.restore.test_restore_exactness import ids, synthetic_cost

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(netcluster_available() is not None, reason=str(netcluster_available()))]

# engine B, per turn: waits for the file <argv[2]><turn>, restores with a fresh pool, prints a JSON line
ENGINE_B = """
import json, os, sys, time, torch
from kvflow import KVPool, Restorer, load_model
from kvflow.bench.restore_bench import kv_diff
from tests.restore.test_restore_exactness import ids, synthetic_cost
torch.set_num_threads(1)
cfg, go = json.loads(sys.argv[1]), sys.argv[2]
runner = load_model("tiny")
context, query = ids(6 * 32 + 5, 61), ids(7, 62)
ref = runner.reference_prefill(torch.cat([context, query]))
for turn in range(2):
    while not os.path.exists(f"{go}{turn}"):
        time.sleep(0.05)
    with KVPool.open(cfg) as pool:
        restorer = Restorer(runner, pool, cost=synthetic_cost(runner), calibrate=False)
        found = restorer.lookup(context, query.numel())[0].stored_chunks
        out = restorer.restore(context, query, "load")
        st = pool.stats()
        print(json.dumps({"found": found, "diff": kv_diff(out, ref), "argmax": bool(out.logits.argmax() == ref[1].argmax()),
                          "hits": st["hits"], "misses": st["misses"], "cells": 6 * runner.num_layers}), flush=True)
"""


def _lines(path, n: int, proc, timeout_s: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [json.loads(l) for l in path.read_text().splitlines() if l.startswith("{")] if path.exists() else []
        if len(found) >= n:
            return found
        assert proc.alive, proc.failure()
        time.sleep(0.1)
    raise AssertionError(f"engine B printed {n} lines in {timeout_s} s? {proc.failure()}")


def test_engine_b_restores_what_engine_a_stored_across_hosts_exactly_through_a_master_failover_and_nothing_remains(
        tiny, tmp_path):
    with NetCluster() as nc:
        run, pids = nc.run, [p.pid for p in nc.procs.values()]
        cfg = {"chunk_tokens": 32, "probe_bytes": "4M",
               "devices": [{"type": "remote", "url": nc.url, "cluster": True, "timeout_s": 2}]}
        log, go = tmp_path / "engine-b.log", tmp_path / "go"     # B waits for go0, then go1
        b = nc.spawn("eb", nc.python("-c", ENGINE_B, json.dumps(cfg), str(go)), log_path=log,
                     env=nc.env(OMP_NUM_THREADS="1"), name="engine B")
        try:
            nc.enter("ea")                                 # this process is engine A, on host ea
            with KVPool.open(cfg) as pool:
                Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False).store(ids(6 * 32 + 5, 61))
                assert pool.stats()["put_records"] > 0
            nc.leave()
            nc.wait_replicated()
            (tmp_path / "go0").touch()
            first = _lines(log, 1, b)[0]
            assert first["found"] == 6 and first["diff"] <= 1e-4 and first["argmax"]
            assert first["hits"] == first["cells"] and first["misses"] == 0   # every cell read from the cluster

            nc.kill("m0")
            assert nc.wait_failover("m0") == "r0"
            (tmp_path / "go1").touch()
            second = _lines(log, 2, b)[1]
            assert second["diff"] <= 1e-4 and second["argmax"]    # a lost record is a recompute, never a wrong value
            assert second["hits"] == second["cells"]              # replicated before the kill: nothing was lost
        finally:
            b.stop()
    assert leftovers(run) == {"namespaces": [], "pids": [], "dir": False}
    for pid in pids + [b.pid]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
