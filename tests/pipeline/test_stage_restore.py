"""One pipeline stage, in-process: the executor restoring a layer range through a StageLink fills exactly the KV a
full prefill computes for those layers — from stored boundary activations, from the previous stage's hidden
states, and when its inputs run out part way (I/O covers the rest); a chunk nothing can fill is reported, never
faked. Boundary activations are the model's own hidden states, stored fp32."""

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import KVPool, Restorer
from kvflow.executor import Executor
from kvflow.pipeline.links import ActivationInputs, EmbedInputs
from kvflow.pipeline.stage_link import StageLink
from kvflow.pipeline.storage import boundary_overhead
from kvflow.planner import Request
from kvflow.planner.pipeline import PipelinePlanner
from tests.restore.test_restore_exactness import ids, synthetic_cost

TOL = 1e-4
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def planner(restorer, chunk):
    r = restorer.runner
    return PipelinePlanner(restorer.cost, chunk, restorer.io_model().cell_bytes, chunk * r.hidden_size * 4 + 128)


def act_keys(restorer, context, boundary, n):
    return restorer.act_keys(context, boundary)[:n]


def grid_diff(cache, ref_kv, layers, n_tokens):
    worst = 0.0
    for layer in range(*layers) if n_tokens else ():
        k, v = ref_kv[layer]
        worst = max(worst, (cache.keys[layer][:, :, :n_tokens] - k[:, :, :n_tokens]).abs().max().item(),
                    (cache.values[layer][:, :, :n_tokens] - v[:, :, :n_tokens]).abs().max().item())
    return worst


def clock():
    return 0.0


@SETTINGS
@given(n=st.integers(1, 400), chunk=st.sampled_from([16, 32, 64]), cut=st.integers(1, 3),
       rho=st.sampled_from([None, 0.25, 1.0, 8.0]), b=st.floats(1e-9, 1e-6), strategy=st.sampled_from(
           ["token", "cake", "load"]), seed=st.integers(0, 2**16))
def test_each_stage_restores_its_layers_exactly_from_stored_boundary_activations(tiny, n, chunk, cut, rho, b,
                                                                                 strategy, seed):
    pool = KVPool.memory("64M", chunk_tokens=chunk)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny, b))
    context, query = ids(n, seed), ids(5, seed + 1)
    restorer.store(context, boundaries=[cut])
    N = n // chunk
    if rho is not None:
        pool.set_throttle(rho * restorer.cost.short_context_rate(chunk) * 50)
    stages = [(0, cut), (cut, tiny.num_layers)]
    pplan = planner(restorer, chunk).plan(Request(n, 5, N), stages, [pool.read_bandwidth] * 2,
                                          act_chunks=[N, N], strategy=strategy)
    ref_kv, _ = tiny.reference_prefill(torch.cat([context, query]))
    token_ids = torch.cat([context, query])
    keys = restorer.keys(context)
    for sp in pplan.stages:
        l0, l1 = sp.layers
        assert sp.plan.layer_offset == l0 and sp.plan.num_layers == l1 - l0
        link = EmbedInputs(tiny, token_ids) if l0 == 0 else ActivationInputs(
            pool, act_keys(restorer, context, l0, N), chunk, [s.tokens for s in sp.plan.compute], clock)
        ex = Executor(tiny, pool).run(sp.plan, [row[l0:l1] for row in keys], token_ids, link=link)
        if isinstance(link, ActivationInputs):
            link.close()
        assert ex.logits is None and ex.complete_chunks == N
        assert grid_diff(ex.cache, ref_kv, (l0, l1), N * chunk) <= TOL


def _corrupt(pool, key):
    dev, offset = next((d, off) for digest, d, off, _len, _seq in pool.entries() if digest == key.digest)
    device = pool.slots[dev].device
    getattr(device, "inner", device)._mem[offset + 200] ^= 0x55


def _stored(tiny, seed: int, boundary: int, n: int = 320, chunk: int = 32):
    """A context of ``n`` tokens stored with its activations at ``boundary``: (restorer, pool, context, query, keys)."""
    pool = KVPool.memory("64M", chunk_tokens=chunk)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))
    context, query = ids(n, seed), ids(4, seed + 1)
    restorer.store(context, boundaries=[boundary])
    return restorer, pool, context, query, restorer.keys(context)


def test_inputs_that_run_out_stop_the_compute_side_and_io_covers_the_rest(tiny):
    chunk, n = 32, 320
    restorer, pool, context, query, keys = _stored(tiny, 3, 2, n, chunk)
    N = n // chunk
    _corrupt(pool, restorer.act_keys(context, 2)[2])
    pool.set_throttle(restorer.cost.short_context_rate(chunk) * 0.05)    # slow I/O: compute would go far
    sp = planner(restorer, chunk).plan(Request(n, 4, N), [(0, 2), (2, 4)], [pool.read_bandwidth] * 2,
                                       strategy="cake").stages[1]
    token_ids = torch.cat([context, query])
    link = ActivationInputs(pool, act_keys(restorer, context, 2, N), chunk, [s.tokens for s in sp.plan.compute],
                            clock)
    ex = Executor(tiny, pool).run(sp.plan, [row[2:4] for row in keys], token_ids, link=link)
    link.close()
    assert link.failed in ([2], []) and ex.complete_chunks == N
    computed = {i for e in ex.timeline if e.kind == "compute" for i in range(e.tokens[0] // chunk, e.tokens[1] // chunk)}
    # the compute side reaches the corrupt inputs (I/O is 20x slower than compute on an idle box); on a loaded box
    # the I/O side can land chunk 2 first (a clean-clone run beside other work did)
    if link.failed:
        assert computed == {0, 1}, "the compute side stops where its inputs end"
    else:
        assert 2 not in computed
    ref_kv, _ = tiny.reference_prefill(token_ids)
    assert grid_diff(ex.cache, ref_kv, (2, 4), N * chunk) <= TOL


def test_a_chunk_without_kv_and_without_inputs_is_reported_not_faked(tiny):
    chunk, n = 32, 320
    restorer, pool, context, query, keys = _stored(tiny, 5, 1, n, chunk)
    N = n // chunk
    _corrupt(pool, restorer.act_keys(context, 1)[6])
    _corrupt(pool, keys[6][2])                                         # chunk 6, layer 2 (stage 1's second layer)
    sp = planner(restorer, chunk).plan(Request(n, 4, N), [(0, 1), (1, 4)], [pool.read_bandwidth] * 2,
                                       strategy="load").stages[1]
    token_ids = torch.cat([context, query])
    link = ActivationInputs(pool, act_keys(restorer, context, 1, N), chunk, [], clock)
    ex = Executor(tiny, pool).run(sp.plan, [row[1:4] for row in keys], token_ids, link=link)
    link.close()
    assert ex.fallback_chunks == [6] and ex.complete_chunks == 6
    ref_kv, _ = tiny.reference_prefill(token_ids)
    assert grid_diff(ex.cache, ref_kv, (1, 4), 6 * chunk) <= TOL


class Captured(StageLink):
    """A previous stage's outputs, handed over in pieces (what a sequential pipeline receives)."""

    def __init__(self, upto: int):
        self.parts, self.upto, self.done = [], upto, threading.Event()

    def output(self, a, hidden):
        self.parts.append((a, hidden))

    def grid_computed(self):
        self.done.set()

    def inputs(self, a, b):
        hidden = torch.cat([h for _, h in self.parts], dim=1)[:, :self.upto]
        return hidden[:, a:b] if a < hidden.shape[1] else None


def test_full_stage_outputs_are_the_next_stages_inputs(tiny):
    chunk, n = 32, 256
    pool = KVPool.memory("64M", chunk_tokens=chunk)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))
    context, query = ids(n, 7), ids(3, 8)
    restorer.store(context)
    keys, token_ids, N = restorer.keys(context), torch.cat([context, query]), n // chunk
    pool.set_throttle(restorer.cost.short_context_rate(chunk) * 0.01)    # slow I/O: compute takes most chunks
    pplan = planner(restorer, chunk).plan(Request(n, 3, N), [(0, 3), (3, 4)], [pool.read_bandwidth] * 2,
                                          mode="sequential", strategy="cake")
    handed = Captured(upto=5 * chunk)                       # stage 1 gets stage 0's hidden states of chunks 0-4
    stage0 = EmbedInputs(tiny, token_ids)
    stage0.output, stage0.grid_computed = handed.output, handed.grid_computed
    first = Executor(tiny, pool).run(pplan.stages[0].plan, [row[0:3] for row in keys], token_ids, link=stage0)
    computed = max(e.tokens[1] for e in first.timeline if e.kind == "compute")
    assert handed.done.is_set() and computed >= 5 * chunk
    assert [a for a, _ in handed.parts] == sorted(a for a, _ in handed.parts) and handed.parts[0][0] == 0
    assert sum(h.shape[1] for _, h in handed.parts) == computed, "every full-stage output, in order"
    pool.set_throttle(None)
    ex = Executor(tiny, pool).run(pplan.stages[1].plan, [row[3:4] for row in keys], token_ids, link=handed)
    ref_kv, _ = tiny.reference_prefill(token_ids)
    assert ex.complete_chunks == N and grid_diff(ex.cache, ref_kv, (3, 4), N * chunk) <= TOL
    assert max(e.tokens[1] for e in ex.timeline if e.kind == "compute") <= 5 * chunk


def test_stored_boundary_activations_are_the_models_hidden_states_in_fp32(tiny):
    chunk, n = 32, 200
    pool = KVPool.memory("64M", chunk_tokens=chunk, storage_dtype="bfloat16")
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))
    context = ids(n, 9)
    out = restorer.store(context, boundaries=[1, 3])
    N = n // chunk
    assert out.act_bytes_written == 2 * N * (chunk * tiny.hidden_size * 4 + 128)
    with torch.inference_mode():
        hidden = tiny.hf_model(input_ids=context[:N * chunk].view(1, -1), output_hidden_states=True).hidden_states
    for b in (1, 3):
        got = pool.get_many(restorer.act_keys(context, b))
        for i, key in enumerate(restorer.act_keys(context, b)):
            assert got[key].dtype == torch.float32
            assert (got[key].view(1, chunk, -1) - hidden[b][:, i * chunk:(i + 1) * chunk]).abs().max() <= 1e-5
    assert restorer.store(context, boundaries=[1, 3]).act_bytes_written == 0, "stored records are not rewritten"
    overhead = boundary_overhead(tiny, [2], chunk, "bfloat16")
    assert overhead["act_bytes_per_token"] == pytest.approx(tiny.hidden_size * 4 + 128 / chunk)
    assert overhead["percent_of_kv"] == pytest.approx(100 * overhead["act_bytes_per_token"]
                                                      / (4 * (2 * 2 * 32 * 2 + 128 / chunk)))


def test_unknown_boundaries_are_clear_errors(tiny):
    from kvflow.errors import KVFlowError
    restorer = Restorer(tiny, KVPool.memory("16M", chunk_tokens=32), cost=synthetic_cost(tiny))
    with pytest.raises(KVFlowError, match="boundaries"):
        restorer.store(ids(64, 0), boundaries=[4])
