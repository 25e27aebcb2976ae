"""Greedy engine output equals transformers' model.generate(do_sample=False) token for token — whatever the
batching, chunking, prefix hits or preemptions the engine goes through on the way."""

import pytest
import torch

from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
from kvflow.engine.model_runner import BatchRunner, StepItem
from kvflow.engine.paged_cache import PagedKVCache
from tests.engine.helpers import hf_greedy, ids

MAX = 10
POLICIES = ("fcfs", "first-token", "remaining-work")     # engine.scheduling_policy: the order, never the tokens


def assert_greedy(tiny, engine, prompts, max_tokens=MAX):
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(tiny, prompt, max_tokens)
    return outs


def test_one_step_of_mixed_prefill_chunks_and_decodes_gives_each_sequences_own_logits(tiny):
    cache = PagedKVCache(tiny.num_layers, 16, 8, tiny.kv_heads, tiny.head_dim)
    runner = BatchRunner(tiny, cache)
    a, b = ids(30, 1), ids(6, 2)
    runner.execute([StepItem([0, 1, 2, 3], 0, a[:12], False), StepItem([4], 0, b, True)])
    logits = runner.execute([StepItem([0, 1, 2, 3], 12, a[12:], True), StepItem([4], 6, [9], True)])
    for row, tokens in zip(logits, (a, b + [9])):
        _, ref = tiny.reference_prefill(torch.tensor(tokens))
        assert (row - ref).abs().max().item() <= 1e-4 and row.argmax() == ref.argmax()


@pytest.mark.parametrize("group_bytes", [1, 1 << 20])
def test_decodes_attended_in_groups_come_back_in_the_items_order(tiny, monkeypatch, group_bytes):
    """Short decodes move to the front of the step's row (longest first) and are attended in groups — one group
    or one per decode here; every item's logits still come back in the items' order, each its own prefill's."""
    from kvflow.engine import attention
    monkeypatch.setattr(attention, "GROUP_BYTES", group_bytes)
    cache = PagedKVCache(tiny.num_layers, 32, 4, tiny.kv_heads, tiny.head_dim)
    runner = BatchRunner(tiny, cache)
    a, b, c, d = ids(30, 1), ids(5, 2), ids(13, 3), ids(9, 4)
    tables = {"a": list(range(0, 8)), "b": [20, 9], "c": [31, 8, 12, 30], "d": [15, 14, 13]}  # scattered blocks
    runner.execute([StepItem(tables["a"], 0, a[:10], False), StepItem(tables["b"], 0, b, True),
                    StepItem(tables["c"], 0, c, True), StepItem(tables["d"], 0, d, True)])
    logits = runner.execute([StepItem(tables["b"], 5, [7], True), StepItem(tables["a"], 10, a[10:], True),
                             StepItem(tables["c"], 13, [8], True), StepItem(tables["d"], 9, [6], False)])
    assert logits.shape[0] == 3
    for row, tokens in zip(logits, (b + [7], a, c + [8])):
        _, ref = tiny.reference_prefill(torch.tensor(tokens))
        assert (row - ref).abs().max().item() <= 1e-4 and row.argmax() == ref.argmax()


@pytest.mark.parametrize("path", ["grouped", "one by one", "native"])
def test_follow_ups_on_cached_histories_attended_as_one_group_give_each_sequences_own_logits(tiny, monkeypatch,
                                                                                             path):
    """Three chunks that continue their histories (over scattered blocks) plus a decode in one step: attended in
    place by the native chunk op, or (torch's path) as one group (attention.SegmentGroup) or one by one, each item's
    logits are its own prefill's."""
    from kvflow.engine import model_runner
    from kvflow.model import chunk_attention
    if path == "native" and not chunk_attention.available():
        pytest.skip("the native chunk op is not built here")
    if path != "native":
        monkeypatch.setenv("KVFLOW_CHUNK_ATTENTION", "torch")
    grouped = path == "grouped"
    made, group = [], model_runner.groups_of_segments
    monkeypatch.setattr(model_runner, "groups_of_segments", lambda segs, *a: made.append(group(segs, *a)) or
                        made[-1] if grouped else ([], segs))
    cache = PagedKVCache(tiny.num_layers, 40, 4, tiny.kv_heads, tiny.head_dim)
    runner = BatchRunner(tiny, cache)
    assert runner.native_chunks == (path == "native")
    a, b, c, d = ids(29, 1), ids(14, 2), ids(22, 3), ids(9, 4)
    tables = {"a": list(range(0, 8)), "b": [20, 9, 33, 17], "c": [31, 8, 12, 30, 25, 26], "d": [15, 14, 13]}
    runner.execute([StepItem(tables["a"], 0, a[:17], False), StepItem(tables["b"], 0, b[:5], False),
                    StepItem(tables["c"], 0, c[:11], False), StepItem(tables["d"], 0, d, True)])
    logits = runner.execute([StepItem(tables["a"], 17, a[17:], True), StepItem(tables["d"], 9, [6], True),
                             StepItem(tables["b"], 5, b[5:], True), StepItem(tables["c"], 11, c[11:], True)])
    for row, tokens in zip(logits, (a, d + [6], b, c)):
        _, ref = tiny.reference_prefill(torch.tensor(tokens))
        assert (row - ref).abs().max().item() <= 1e-4 and row.argmax() == ref.argmax()
    assert not grouped or [g.count for g in made[-1][0]] == [3]


def test_four_concurrent_requests_are_batched_and_each_equals_generate(tiny):
    engine = LLMEngine(tiny, EngineConfig(block_size=8))
    prompts = [ids(n, seed) for seed, n in enumerate((37, 5, 20, 64))]
    assert_greedy(tiny, engine, prompts)
    assert engine.stats.decode_steps_batched >= 3 * (MAX - 1)     # decodes shared forward passes
    assert engine.stats.steps <= MAX + 1


def test_decodes_over_long_contexts_as_two_matmuls_equal_generate(tiny, monkeypatch):
    """Decodes past ONE_QUERY_KEYS keys take the matmul path (attention.one_query), batched, over blocks of 8."""
    from kvflow.engine import attention
    monkeypatch.setattr(attention, "ONE_QUERY_KEYS", 16)
    engine = LLMEngine(tiny, EngineConfig(block_size=8))
    assert_greedy(tiny, engine, [ids(n, 30 + n) for n in (9, 23, 41)])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("budget,block", [(7, 4), (16, 16), (3, 5)])
def test_a_small_token_budget_prefills_in_chunks_across_many_steps(tiny, budget, block, policy):
    engine = LLMEngine(tiny, EngineConfig(block_size=block, max_num_batched_tokens=budget, scheduling_policy=policy))
    prompts = [ids(36, 3), ids(12, 4)]
    assert_greedy(tiny, engine, prompts)
    assert engine.stats.steps >= 48 // budget


def test_resident_prefix_hits_reuse_blocks_and_change_no_token(tiny):
    engine = LLMEngine(tiny, EngineConfig(block_size=8))
    base = ids(40, 5)
    first = assert_greedy(tiny, engine, [base])[0]
    follow = [base + first.token_ids + ids(3, 6), base[:33] + ids(4, 7), base]
    outs = assert_greedy(tiny, engine, follow)
    assert [o.cached_tokens for o in outs] == [48, 32, 32]      # whole computed blocks, never the last token
    assert engine.stats.requests_by_hit["resident"] == 3


def test_identical_prompts_arriving_together_share_nothing_uncomputed(tiny):
    engine = LLMEngine(tiny, EngineConfig(block_size=4, max_num_batched_tokens=8))
    prompt = ids(18, 8)
    assert_greedy(tiny, engine, [prompt, prompt, prompt])


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_under_a_tiny_block_budget_recomputes_and_changes_no_token(tiny, policy):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=7, block_size=4, scheduling_policy=policy))
    assert_greedy(tiny, engine, [ids(9, 9), ids(10, 10)], max_tokens=14)
    assert engine.stats.preemptions >= 1
    assert engine.blocks.num_free == engine.num_blocks


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_one_step(tiny):
    engine = LLMEngine(tiny, EngineConfig(block_size=8, chunked_prefill=False, max_num_batched_tokens=40))
    assert_greedy(tiny, engine, [ids(30, 11), ids(25, 12)])


def test_without_prefix_caching_nothing_is_shared(tiny):
    engine = LLMEngine(tiny, EngineConfig(block_size=8, enable_prefix_caching=False))
    base = ids(40, 13)
    assert_greedy(tiny, engine, [base])
    assert assert_greedy(tiny, engine, [base])[0].cached_tokens == 0


def test_eos_stops_a_request_as_generate_does(tiny):
    engine = LLMEngine(tiny, EngineConfig())
    prompt = ids(12, 14)
    first = hf_greedy(tiny, prompt, 3)
    out = engine.generate([prompt], SamplingParams(max_tokens=8, stop_token_ids=[first[1]]))[0]
    assert out.token_ids == first[:2] and out.finish_reason == "stop"


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4), max_tokens=st.integers(1, 6),
       block=st.integers(1, 17), budget=st.integers(1, 48), spare=st.integers(0, 12), shared=st.booleans(),
       seed=st.integers(0, 2**16))
def test_any_block_size_budget_and_block_count_gives_generates_tokens(tiny, lengths, max_tokens, block, budget,
                                                                      spare, shared, seed, policy):
    base = ids(40, seed)
    prompts = [base[:n] if shared else ids(n, seed + i) for i, n in enumerate(lengths)]
    need = -(-(max(lengths) + max_tokens) // block)
    engine = LLMEngine(tiny, EngineConfig(block_size=block, max_num_batched_tokens=budget, num_blocks=need + spare,
                                          scheduling_policy=policy))
    assert_greedy(tiny, engine, prompts, max_tokens)
    assert engine.blocks.num_free == engine.num_blocks and not engine.has_unfinished()
