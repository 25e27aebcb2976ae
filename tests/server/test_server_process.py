"""Benchmark servers run in processes of their own (server/process.py): not the client's GIL, its stats come
back over the pipe, a build that fails is one error with the child's reason, nothing is left running."""

import os
from functools import partial

import httpx
import pytest

from kvflow.server.process import ServerProcess, engine_for
from kvflow.errors import KVFlowError

ENGINE = dict(strategy=None, kv_budget=4 << 20, block_size=16, pool_bytes=8 << 20, chunk_tokens=16,
              max_num_batched_tokens=64)


def test_a_benchmark_server_is_another_process_that_reports_its_hits_and_stops():
    with ServerProcess(partial(engine_for, "tiny", 0, **ENGINE), "tiny") as server:
        assert server.pid and server.pid != os.getpid()
        prompt = list(range(40))
        for _ in range(2):
            r = httpx.post(f"{server.url}/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                           timeout=120)
            assert r.status_code == 200, r.text
        assert server.finished() == 2 and server.is_alive()
    assert not server.is_alive()
    assert server.hit_split()["resident"] > 0            # the second request reused the first one's blocks


def test_a_server_that_cannot_be_built_is_one_error_with_the_childs_reason():
    with pytest.raises(KVFlowError, match="no-such-model"):
        with ServerProcess(partial(engine_for, "no-such-model", 0, **ENGINE), "x"):
            pass
