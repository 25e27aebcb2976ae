"""A second engine process on the same pool restores a conversation the first one stored — the pool on disk is
content-addressed, so no engine needs another's index — and the output still equals generate."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from kvflow import KVPool, Restorer
from kvflow.pool.devices import odirect_supported
from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.helpers import hf_greedy, ids, synthetic_cost

ROOT = str(Path(__file__).resolve().parents[2])
FIRST = textwrap.dedent("""
    import json, sys
    from kvflow import KVPool, Restorer, load_model
    from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
    from tests.engine.helpers import synthetic_cost
    cfg, prompt = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    runner = load_model("tiny")
    with KVPool.open(cfg) as pool:
        engine = LLMEngine(runner, EngineConfig(block_size=16), restorer=Restorer(runner, pool,
                                                                                  cost=synthetic_cost(runner)))
        out = engine.generate([prompt], SamplingParams(max_tokens=4))[0]
        engine.close()
        print(json.dumps(out.token_ids))
""")


def test_a_second_process_restores_what_the_first_stored(tiny, tmp_path):
    cfg = {"devices": [{"type": "extent", "path": str(tmp_path / "kv.img"), "capacity": 32 << 20,
                        "direct": odirect_supported(tmp_path)}],
           "chunk_tokens": 32, "index_dir": str(tmp_path / "index")}
    prompt = ids(90, 1)
    done = subprocess.run([sys.executable, "-c", FIRST, json.dumps(cfg), json.dumps(prompt)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    follow = prompt + answer + ids(5, 2)
    with KVPool.open(cfg) as pool:
        engine = LLMEngine(tiny, EngineConfig(block_size=16), restorer=Restorer(tiny, pool, cost=synthetic_cost(tiny)))
        out = engine.generate([follow], SamplingParams(max_tokens=5))[0]
        engine.close()
    assert out.token_ids == hf_greedy(tiny, follow, 5)
    assert out.cached_tokens == 64 and engine.stats.requests_by_hit["pool"] == 1     # 93 computed: 2 chunks of 32
