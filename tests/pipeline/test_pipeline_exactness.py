"""Stages as real processes (gloo, one torch thread each) restore exactly what one full prefill computes: KV of
every layer and the next-token logits (fp32 <= 1e-4, same argmax) — for uneven layer splits, independent and
sequential, throttled and not; and when boundary activations are missing or corrupt, a stage falls back (loads
instead, or waits for the previous stage's hidden states) and stays exact."""

import pytest
import torch

from kvflow import KVPool, Restorer
from kvflow.pipeline import Pipeline, PipelineRun, link_bandwidths, shared_pool
from kvflow.planner.pipeline import stage_rate
from tests.conftest import max_abs_diff_kv
from tests.restore.test_restore_exactness import ids, synthetic_cost

TOL = 1e-4
C = 32


@pytest.fixture(scope="module")
def setup(tiny):
    with shared_pool("64M", chunk_tokens=C) as cfg:
        pool = KVPool.open(cfg)
        yield tiny, cfg, pool, Restorer(tiny, pool, cost=synthetic_cost(tiny))
        pool.close()


def pipeline(setup, **kw) -> Pipeline:
    runner, cfg, _pool, restorer = setup
    return Pipeline("tiny", runner.fingerprint, cfg, restorer.cost, timeout_s=120, **kw)


def assert_exact(runner, result, context, query):
    ref_kv, ref_logits = runner.reference_prefill(torch.cat([context, query]))
    assert max_abs_diff_kv(result.kv, ref_kv) <= TOL, result.label
    assert (result.logits - ref_logits).abs().max().item() <= TOL, result.label
    assert result.logits.argmax() == ref_logits.argmax(), result.label


def _corrupt(pool, key):
    dev, offset = next((d, off) for digest, d, off, _len, _seq in pool.entries() if digest == key.digest)
    device = pool.slots[dev].device
    getattr(device, "inner", device)._mem[offset + 200] ^= 0x55


def test_stage_processes_restore_every_layer_and_the_logits_of_one_full_prefill(setup):
    runner, _cfg, _pool, restorer = setup
    context, query = ids(300, 1), ids(7, 2)        # 9 full chunks + a 12-token tail
    restorer.store(context, boundaries=[1, 2, 3])
    runs = []
    for stages in ([(0, 1), (1, 4)], [(0, 3), (3, 4)]):       # uneven splits, both ways round
        for mode, handoff in (("independent", "stage"), ("sequential", "stage"), ("sequential", "step")):
            for rho in (None, 0.5):
                bw = link_bandwidths(lambda k: stage_rate(restorer.cost, k, C), stages, rho)
                bw = bw and [b * 50 for b in bw]           # keep the test fast, ratios intact
                runs.append(PipelineRun(context, query, stages, mode, bw, handoff=handoff, return_kv=True,
                                        label=f"{stages} {mode}/{handoff} rho={rho}"))
    runs.append(PipelineRun(context, query, [(0, 4)], return_kv=True, label="one stage"))
    runs.append(PipelineRun(context, query, [(0, 1), (1, 2), (2, 4)], strategy="cake", return_kv=True,
                            label="three stages"))
    results = pipeline(setup).run(runs)
    for result in results:
        assert_exact(runner, result, context, query)
        assert [s.layers for s in result.stages] == [tuple(s) for s in runs[results.index(result)].stages]
        assert all(s.complete_chunks == 9 and not s.repaired for s in result.stages)
        assert result.ttft_s == result.stages[-1].ttft_s > max(s.restore_s for s in result.stages)
        assert result.lower_bound_s > 0
    independent = [r for r in results if r.mode == "independent" and len(r.stages) == 2]
    assert all(r.stages[1].inputs == "act" for r in independent)
    assert all(r.stages[1].inputs == "handoff" for r in results if r.mode == "sequential")


def test_missing_or_corrupt_boundary_activations_fall_back_and_stay_exact(setup):
    runner, _cfg, pool, restorer = setup
    query = ids(5, 99)
    few = ids(320, 10)                              # activations stored for the first 3 chunks only
    restorer.store(few[:3 * C], boundaries=[2])
    restorer.store(few)
    bad_act = ids(320, 11)                          # chunk 2's activation corrupt
    restorer.store(bad_act, boundaries=[2])
    _corrupt(pool, restorer.act_keys(bad_act, 2)[2])
    hole, hole_seq = ids(320, 12), ids(320, 14)     # chunk 4: activation AND stage 1's KV corrupt -> nothing but
    for context in (hole, hole_seq):                # the previous stage's hidden states can fill it (a reader
        restorer.store(context, boundaries=[2])     # drops a bad record from its index: one context per run)
        _corrupt(pool, restorer.act_keys(context, 2)[4])
        _corrupt(pool, restorer.keys(context)[4][3])
    deep = ids(320, 13)                             # three stages: stage 2 and stage 1 both lack chunk 6's inputs
    restorer.store(deep, boundaries=[1, 2])
    for b in (1, 2):
        _corrupt(pool, restorer.act_keys(deep, b)[6])
    _corrupt(pool, restorer.keys(deep)[6][3])
    two = [(0, 2), (2, 4)]
    slow = [200e3, 200e3]                           # 160 ms per chunk: the compute side gets as far as it can
    runs = [PipelineRun(few, query, two, "independent", slow, strategy="cake", return_kv=True, label="few"),
            PipelineRun(bad_act, query, two, "independent", slow, strategy="cake", return_kv=True, label="bad act"),
            PipelineRun(hole, query, two, "independent", None, strategy="load", return_kv=True, label="hole"),
            PipelineRun(hole_seq, query, two, "sequential", None, strategy="load", return_kv=True, label="hole seq"),
            PipelineRun(deep, query, [(0, 1), (1, 2), (2, 4)], "independent", None, strategy="load",
                        return_kv=True, label="deep")]
    results = {r.label: r for r in pipeline(setup).run(runs)}
    for run in runs:
        assert_exact(runner, results[run.label], run.context, run.query)
    few_s1 = results["few"].stages[1]
    assert few_s1.act_chunks == 3 and few_s1.recomputed_chunks <= 3 < few_s1.loaded_chunks
    bad_s1 = results["bad act"].stages[1]
    assert bad_s1.act_failed == [2] and bad_s1.recomputed_chunks == 2, "compute stops at the bad activation"
    for label in ("hole", "hole seq"):
        s1 = results[label].stages[1]
        assert s1.fallback_chunks == [4] and s1.complete_chunks == 4
        assert s1.repaired == [[4 * C, 10 * C]], "the previous stage recomputed chunks 4.. for it"
    deep = results["deep"].stages
    assert deep[2].repaired == [[6 * C, 10 * C]] and deep[1].repaired == [[6 * C, 10 * C]], \
        "stage 2 waits for stage 1, which waits for stage 0"
