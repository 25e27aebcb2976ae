"""Elastic reserve properties: the reserve is never lent while a scheduled step computes a prefill; no block is lost
or owned twice, whatever interleaving of prefills, decodes, preemptions, aborts and (failing) take-backs; the lent
pages leave RAM when the reserve is taken back; greedy outputs are the non-elastic engine's token for token."""

from __future__ import annotations

import mmap

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
from kvflow.engine.elastic import PAGE, TakeBackError
from tests.engine.helpers import hf_greedy, ids

BASES = [ids(40, 100), ids(40, 101)]            # prompts share prefixes: cached blocks move with their hashes


def elastic_engine(tiny, base=12, lent=6, budget=8, **kw):
    return LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=base, max_num_batched_tokens=budget, max_num_seqs=4,
                                        elastic_reserve=True, elastic_blocks=lent, **kw))


def check_blocks(engine):
    """Every block is exactly one of: held (refcount = tables holding it), free, offline; offline = the lent ids
    exactly when the reserve is not lent; the prefix cache points only at online blocks carrying that hash."""
    bm, el = engine.blocks, engine.elastic
    held: dict[int, int] = {}
    for s in engine.scheduler.running:
        assert len(set(s.block_table)) == len(s.block_table)
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    for s in engine.scheduler.waiting:
        assert not s.block_table
    for block in bm.blocks:
        b = block.block_id
        assert block.ref_count == held.get(b, 0)
        assert (b in bm.free) + (b in held) + (b in bm.offline) == 1, f"block {b} lost or owned twice"
    assert bm.offline == (set() if el.lent else set(el.lent_ids))
    for h, b in bm.cached.items():
        assert bm.blocks[b].hash == h and b not in bm.offline


def watch_plans(engine, log):
    """Record (reserve lent?, tokens per scheduled sequence) of every plan the scheduler makes."""
    schedule = engine.scheduler.schedule

    def recorded():
        plan = schedule()
        log.append((engine.elastic.lent, [s.num_tokens + (10**6 if s.seq.pool_restore else 0) for s in plan.scheduled]))
        return plan
    engine.scheduler.schedule = recorded


def inject(engine, kind):
    """The next take-back fails: in the copy (phase 2) or when dropping the pages (phase 4)."""
    el, cache = engine.elastic, engine.cache
    if kind == "copy":
        original = cache.copy_blocks

        def broken(src, dst):
            cache.copy_blocks = original
            if dst:
                cache.kv[:, :, dst[0] * 4] = float("nan")      # a half-done copy: whatever it wrote is discarded
            raise RuntimeError("injected copy failure")
        cache.copy_blocks = broken
    else:
        region, original = el.region, el.region.release

        def broken():
            region.release = original
            raise OSError(12, "injected madvise failure")
        region.release = broken


ops = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(0, 1), st.integers(1, 24), st.integers(1, 8)),
                         st.tuples(st.just("step"), st.integers(1, 6)),
                         st.tuples(st.just("abort"), st.integers(0, 9)),
                         st.tuples(st.just("fail"), st.sampled_from(["copy", "release"]))),
               min_size=1, max_size=16)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=(Phase.explicit, Phase.reuse, Phase.generate))      # shrinking a model run takes minutes here
@given(ops=ops)
def test_any_interleaving_keeps_blocks_consistent_never_lends_under_a_prefill_and_changes_no_token(tiny, ops):
    engine = elastic_engine(tiny)
    el, plans = engine.elastic, []
    watch_plans(engine, plans)
    prompts, tokens, reasons = {}, {}, {}

    def step():
        takebacks, before = el.stats.takebacks, el.region.resident_lent()
        for out in engine.step():
            tokens.setdefault(out.seq_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.seq_id] = out.finish_reason
        check_blocks(engine)
        if el.stats.takebacks > takebacks:                      # memory really left: the lent pages are gone
            assert el.region.resident_lent() == 0 <= before
        if not el.lent and el.released:
            assert el.region.resident_lent() == 0
            planes = engine.runner.num_layers * 2
            assert el.region.resident_total() <= el.region.base_bytes + 2 * planes * PAGE

    for op in ops:
        if op[0] == "add":
            _, base, n, m = op
            sid = engine.add_request(BASES[base][:n], SamplingParams(max_tokens=m))
            prompts[sid] = (BASES[base][:n], m)
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        elif op[0] == "abort" and prompts:
            sid = sorted(prompts)[op[1] % len(prompts)]
            if sid not in reasons:
                engine.abort(sid)
                reasons[sid] = "abort"
        elif op[0] == "fail":
            inject(engine, op[1])
    for _ in range(400):
        if not engine.has_unfinished():
            break
        step()
    assert not engine.has_unfinished()
    for lent, sizes in plans:                                     # the reserve is never lent under a prefill
        assert not lent or all(n <= 1 for n in sizes)
    for sid, (prompt, m) in prompts.items():
        if reasons.get(sid) != "abort":                           # aborted or not admitted (a failed take-back)
            assert tokens[sid] == hf_greedy(tiny, prompt, m)
    assert len(engine.blocks.free) + len(engine.blocks.offline) == engine.blocks.num_blocks


def run_schedule(engine, arrivals, max_steps=400):
    """Requests added at given step numbers; the tokens each produced."""
    tokens, pending, n = {}, sorted(arrivals, key=lambda a: a[0]), 0
    order = []
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= n:
            _, prompt, m = pending.pop(0)
            order.append(engine.add_request(prompt, SamplingParams(max_tokens=m)))
        for out in engine.step():
            tokens.setdefault(out.seq_id, []).extend(out.new_token_ids)
        n += 1
        assert n < max_steps
    return [tokens[sid] for sid in order]


MIXED = [(0, ids(6, 1), 28), (0, ids(5, 2), 28), (20, ids(20, 3), 4), (22, ids(9, 4), 6)]


def test_greedy_outputs_equal_the_non_elastic_engine_through_moves_and_preemptions(tiny):
    plain = LLMEngine(tiny, EngineConfig(block_size=4, num_blocks=10, max_num_batched_tokens=8, max_num_seqs=4))
    elastic = elastic_engine(tiny, base=10, lent=8)
    assert run_schedule(elastic, MIXED) == run_schedule(plain, MIXED)
    st_ = elastic.elastic.stats
    assert st_.lends >= 2 and st_.takebacks >= 1
    assert st_.blocks_moved >= 1 and st_.preempted >= 1      # two decoders outgrew the base blocks meanwhile
    assert elastic.elastic.region.resident_lent() == 0 or elastic.elastic.lent


def test_a_failed_copy_leaves_the_reserve_lent_the_decodes_intact_and_the_prefill_refused(tiny):
    engine = elastic_engine(tiny, base=10, lent=8)
    a = engine.add_request(ids(6, 1), SamplingParams(max_tokens=16))
    tokens = []
    for _ in range(10):
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert engine.elastic.lent and any(b >= 10 for b in engine.seqs[a].block_table)
    inject(engine, "copy")
    late = engine.add_request(ids(12, 2), SamplingParams(max_tokens=2))
    outs = engine.step()
    refused = [o for o in outs if o.seq_id == late]
    assert refused and refused[0].finished and refused[0].finish_reason == "abort" and not refused[0].new_token_ids
    assert "copying" in engine.elastic.stats.last_error and engine.elastic.stats.failures == 1
    assert engine.elastic.lent
    check_blocks(engine)
    tokens += [t for o in outs if o.seq_id == a for t in o.new_token_ids]
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == hf_greedy(tiny, ids(6, 1), 16)


def test_a_failed_page_release_refuses_the_prefill_and_the_next_take_back_retries_it(tiny):
    engine = elastic_engine(tiny, base=10, lent=8)
    first = engine.add_request(ids(6, 1), SamplingParams(max_tokens=12))
    for _ in range(8):
        engine.step()
    inject(engine, "release")
    late = engine.add_request(ids(12, 2), SamplingParams(max_tokens=2))
    assert [o.finish_reason for o in engine.step() if o.seq_id == late] == ["abort"]
    el = engine.elastic
    assert not el.lent and not el.released and "dropping the lent pages" in el.stats.last_error
    check_blocks(engine)
    again = engine.add_request(ids(7, 4), SamplingParams(max_tokens=3))
    tokens = {first: [], again: []}
    for n in range(400):
        for out in engine.step():
            tokens[out.seq_id] += out.new_token_ids
        if n == 0:
            assert el.released and not el.lent          # retried before the prefill was scheduled, and it held
        if not engine.has_unfinished():
            break
    assert el.stats.failures == 1
    assert tokens[again] == hf_greedy(tiny, ids(7, 4), 3)


def test_take_back_drops_the_lent_pages_from_ram(tiny):
    engine = elastic_engine(tiny, base=10, lent=8)
    engine.add_request(ids(6, 1), SamplingParams(max_tokens=24))
    for _ in range(20):
        engine.step()
    el = engine.elastic
    el.region.kv[:, :, 10 * 4:].fill_(1.0)         # every lent page touched (as a long decode phase would)
    touched = el.region.resident_lent()
    assert touched == sum(n for _, n in el.region.ranges) > 0
    el.take_back()
    assert el.region.resident_lent() == 0 and not el.lent
    check_blocks(engine)


def test_the_elastic_option_is_off_by_default_and_validated():
    assert EngineConfig().elastic_reserve is False
    with pytest.raises(Exception, match="elastic_blocks"):
        EngineConfig(elastic_blocks=-1).validate()
    assert TakeBackError.__mro__[1].__name__ == "KVFlowError"
    assert mmap.PAGESIZE == PAGE
