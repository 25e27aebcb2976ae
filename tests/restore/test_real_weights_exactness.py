"""On a real, trained model (SmolLM2-135M-Instruct: 30 layers, tied embeddings, rope theta 1e5) and human text,
every restoration strategy yields the KV and next-token logits of one fresh full prefill (fp32 <= 1e-4, same
argmax; bit for bit on the host, where every path computes as the full prefill: docs/DESIGN.md, "Exactness") —
with plans that really split the context between recompute and load."""

import pytest
import torch

from kvflow import KVPool, Restorer
from kvflow.planner import STRATEGIES
from tests.conftest import max_abs_diff_kv
from tests.engine.helpers import synthetic_cost
from tests.texts import DECLARATION

TOL = 1e-4
WHOLE = ("recompute", "load", "load-layerwise")      # the baselines that recompute or load everything by definition


def _bound(runner) -> float:
    """0 where every path gives ``runner`` the full prefill's bits (``ModelRunner.bit_for_bit``), else TOL."""
    return 0.0 if runner.bit_for_bit else TOL


@pytest.fixture(scope="module")
def request_ids(smollm2, smollm2_tokenizer):
    """A 300-token context of real text and its question (ids from the model's own tokenizer), and the reference:
    one transformers forward over both."""
    context = torch.tensor(smollm2_tokenizer.encode(DECLARATION)[:300])
    query = torch.tensor(smollm2_tokenizer.encode("\nWhich three rights does this passage name?"))
    return context, query, smollm2.reference_prefill(torch.cat([context, query]))


def test_every_strategy_on_real_weights_equals_full_prefill(smollm2, request_ids):
    """4 chunks of 64 and a 44-token tail, the link at half the rate recompute makes KV: cake, token and cacheflow
    meet between chunks, layer loads the upper layers of every chunk, staircase also splits chunks by layers."""
    context, query, (ref_kv, ref_logits) = request_ids
    chunk, rho = 64, 0.5
    pool = KVPool.memory("64M", chunk_tokens=chunk, devices=2)
    restorer = Restorer(smollm2, pool, cost=synthetic_cost(smollm2), calibrate=False)   # plans fixed by the test
    restorer.store(context)
    pool.set_throttle(rho * restorer.cost.short_context_rate(chunk))
    L, n = smollm2.num_layers, context.numel() // chunk
    for strategy in STRATEGIES:
        out = restorer.restore(context, query, strategy)
        kv_diff, logit_diff = max_abs_diff_kv(out.kv, ref_kv), (out.logits - ref_logits).abs().max().item()
        assert kv_diff <= _bound(smollm2) and logit_diff <= _bound(smollm2), (strategy, kv_diff, logit_diff)
        assert out.logits.argmax() == ref_logits.argmax(), strategy
        assert out.plan.num_chunks == n and not out.fallback_chunks
        if strategy not in WHOLE:
            assert 0 < sum(out.plan.split) < L * n, (strategy, out.plan.split)
            assert {"compute", "load"} <= {e.kind for e in out.timeline}, (strategy, out.plan.split)


def test_a_2k_token_context_in_engine_steps_and_restored_equals_full_prefill(smollm2, smollm2_tokenizer):
    """2,048 tokens of human text in engine steps of 512, and restored from chunks of 256 with a 32-token query
    (recompute and cacheflow), give the full prefill's KV and logits on all 30 layers — bit for bit on the host,
    where every chunk and the full prefill attend through the same native op (model/attention.py), else within the
    bound."""
    from kvflow.demo.texts import long_document
    from kvflow.engine.model_runner import BatchRunner, StepItem
    from kvflow.engine.paged_cache import PagedKVCache
    tol = _bound(smollm2)
    ids = long_document(smollm2_tokenizer, 2048)
    ref_kv, ref_logits = smollm2.reference_prefill(torch.tensor(ids))
    cache = PagedKVCache(smollm2.num_layers, 130, 16, smollm2.kv_heads, smollm2.head_dim)
    steps, table = BatchRunner(smollm2, cache), list(range(130))
    for s in range(0, 2048, 512):
        out = steps.execute([StepItem(table, s, ids[s:s + 512], s + 512 >= 2048)])
    logits = out[0]
    kv = [(cache.kv[i, 0, :2048].transpose(0, 1).unsqueeze(0), cache.kv[i, 1, :2048].transpose(0, 1).unsqueeze(0))
          for i in range(smollm2.num_layers)]
    assert max_abs_diff_kv(kv, ref_kv) <= tol and (logits - ref_logits).abs().max().item() <= tol
    assert logits.argmax() == ref_logits.argmax()
    pool = KVPool.memory("256M", chunk_tokens=256)
    restorer = Restorer(smollm2, pool, cost=synthetic_cost(smollm2), calibrate=False)
    context, query = torch.tensor(ids[:-32]), torch.tensor(ids[-32:])
    restorer.store(context)
    pool.set_throttle(restorer.cost.short_context_rate(256))
    for strategy in ("recompute", "cacheflow"):
        out = restorer.restore(context, query, strategy)
        assert max_abs_diff_kv(out.kv, ref_kv) <= tol and (out.logits - ref_logits).abs().max().item() <= tol
        assert out.logits.argmax() == ref_logits.argmax(), strategy
