"""The meet's last group in the executor: whatever group the decision (kvflow.planner.group) claims, the I/O side
loads it one read per layer bottom up, the query runs layer by layer behind it, every cell is filled exactly once,
and the result is exact — also when a record of the group is corrupt."""

from dataclasses import replace

import pytest
import torch

import kvflow.executor.board as board_module
from kvflow import KVPool, Restorer
from kvflow.planner import ComputeStep
from tests.restore.test_restore_exactness import TOL, _memory_of, ids, synthetic_cost

C = 32


def restore_with_group(tiny, monkeypatch, g: int, rho: float, n: int = 8, corrupt: tuple[int, int] | None = None):
    """Token plan over n chunks, compute in single-chunk steps (so the I/O side's first claims find many chunks
    unclaimed), the decision forced to make the boundary final once at most g chunks are unclaimed."""
    monkeypatch.setattr(board_module, "stop_point", lambda s: max(s.lo, s.hi - g))
    pool = KVPool.memory("64M", chunk_tokens=C)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))
    context, query = ids(C * n + 5, g), ids(4, g + 1)
    restorer.store(context)
    if corrupt is not None:
        victim = restorer.keys(context)[corrupt[0]][corrupt[1]]
        dev, offset = next((d, off) for digest, d, off, _len, _seq in pool.entries() if digest == victim.digest)
        _memory_of(pool, dev)[offset + 300] ^= 0x55
    pool.set_throttle(rho * restorer.cost.short_context_rate(C) * 20)
    plan, keys, _ = restorer.plan(context, query.numel(), "token")
    plan = replace(plan, compute=tuple(ComputeStep((i * C, (i + 1) * C), (0, tiny.num_layers)) for i in range(n)))
    ex = restorer.executor.run(plan, keys, torch.cat([context, query]))
    ref_kv, ref_logits = tiny.reference_prefill(torch.cat([context, query]))
    length = context.numel() + query.numel()
    for (k, v), (rk, rv) in zip(ex.cache.layer_kv(length), ref_kv):
        assert (k - rk).abs().max().item() <= TOL and (v - rv).abs().max().item() <= TOL
    assert (ex.logits - ref_logits).abs().max().item() <= TOL and ex.logits.argmax() == ref_logits.argmax()
    return ex


@pytest.mark.parametrize("g", [2, 3, 64])   # g = 1 may leave the last chunk to the cell meet first
@pytest.mark.parametrize("rho", [0.5, 4.0])
def test_a_last_group_is_loaded_layer_by_layer_and_the_query_runs_behind_it(tiny, monkeypatch, g, rho):
    ex = restore_with_group(tiny, monkeypatch, g, rho)
    L = tiny.num_layers
    loads = [e for e in ex.timeline if e.kind == "load"]
    group = [e for e in loads if e.layers[1] - e.layers[0] == 1]
    assert [e.layers for e in group] == [(layer, layer + 1) for layer in range(L)], "one read per layer, bottom up"
    assert len({e.tokens for e in group}) == 1
    assert 1 <= (group[0].tokens[1] - group[0].tokens[0]) // C <= g
    cells = [(i, layer) for e in ex.timeline if e.kind in ("compute", "load")
             for i in range(e.tokens[0] // C, e.tokens[1] // C) for layer in range(*e.layers)]
    assert sorted(cells) == [(i, layer) for i in range(8) for layer in range(L)], "every cell once"
    queries = [e for e in ex.timeline if e.kind == "query"]
    assert [e.layers for e in queries] == [(layer, layer + 1) for layer in range(L)], "the query, layer by layer"
    for q, load in zip(queries, group):
        assert q.start >= load.end - 1e-6, "query layer l runs once layer l of the group is in"


def test_a_corrupt_record_in_the_last_group_is_recomputed_never_served(tiny, monkeypatch):
    ex = restore_with_group(tiny, monkeypatch, 64, 4.0, corrupt=(7, 1))     # chunk 7 is in any group claimed
    assert ex.fallback_chunks == [7]
