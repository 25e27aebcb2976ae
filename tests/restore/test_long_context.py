"""At the lengths kvflow exists for: a 16K-token context restored with mixed plans equals one fresh full prefill
(fp32 <= 1e-4, same argmax) on ``tiny``. The fast check of the long-context benchmarks (docs/BENCHMARKS.md), which
run 8K-128K outside the test suite."""

import pytest
import torch

from kvflow import KVPool, Restorer
from tests.conftest import max_abs_diff_kv
from tests.engine.helpers import synthetic_cost

TOL = 1e-4
LENGTH, CHUNK = 16384, 1024


@pytest.mark.parametrize("strategy", ["cacheflow", "cake"])
def test_a_16k_context_restored_with_a_mixed_plan_equals_full_prefill(tiny, strategy):
    g = torch.Generator().manual_seed(16)
    context = torch.randint(0, tiny.config.vocab_size, (LENGTH,), generator=g)
    query = torch.randint(0, tiny.config.vocab_size, (32,), generator=g)
    ref_kv, ref_logits = tiny.reference_prefill(torch.cat([context, query]))
    pool = KVPool.memory("96M", chunk_tokens=CHUNK, devices=2)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)       # plans fixed by the test
    restorer.store(context)
    pool.set_throttle(restorer.cost.short_context_rate(CHUNK))                          # rho = 1: both pointers move
    out = restorer.restore(context, query, strategy)
    kv_diff, logit_diff = max_abs_diff_kv(out.kv, ref_kv), (out.logits - ref_logits).abs().max().item()
    assert kv_diff <= TOL and logit_diff <= TOL, (kv_diff, logit_diff)
    assert out.logits.argmax() == ref_logits.argmax()
    assert out.plan.num_chunks == LENGTH // CHUNK and not out.fallback_chunks
    assert 0 < sum(out.plan.split) < tiny.num_layers * out.plan.num_chunks, out.plan.split
    assert {"compute", "load"} <= {e.kind for e in out.timeline}
