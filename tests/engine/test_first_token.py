"""The first-token scheduling policy: a request without a token yet swaps decoding sequences out to the pool when it
cannot get its blocks, so its first token does not wait for their answers to end; the swapped ones come back
through restoration and every output still equals generate."""

import pytest

from kvflow import KVPool, Restorer
from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
from kvflow.errors import ConfigError
from tests.engine.helpers import hf_greedy, ids, synthetic_cost


def engine(tiny, policy: str, num_blocks: int = 14, **cfg) -> LLMEngine:
    restorer = Restorer(tiny, KVPool.memory("64M", chunk_tokens=8), cost=synthetic_cost(tiny))
    return LLMEngine(tiny, EngineConfig(num_blocks=num_blocks, block_size=4, scheduling_policy=policy,
                                        enable_prefix_caching=False, **cfg),    # a swapped prefix comes from the pool
                     restorer=restorer)


def late_arrival(eng: LLMEngine, steps_before: int = 20):
    """A decodes 30 tokens; B (6 blocks of prompt) arrives after ``steps_before`` steps, when A holds 10 of the 14
    blocks. Returns both prompts, their tokens and the step at which each got its first / last token."""
    a, b = ids(20, 1), ids(21, 2)
    tokens, first, last = {}, {}, {}
    sa = eng.add_request(a, SamplingParams(max_tokens=30, ignore_eos=True))
    step, sb = 0, None
    while eng.has_unfinished():
        if step == steps_before:
            sb = eng.add_request(b, SamplingParams(max_tokens=4, ignore_eos=True))
        for out in eng.step():
            tokens.setdefault(out.seq_id, []).extend(out.new_token_ids)
            first.setdefault(out.seq_id, step)
            last[out.seq_id] = step
        step += 1
        eng.pool.flush()             # the swapped sequence's chunks are in the pool before it is looked up
    return (a, b), (tokens[sa], tokens[sb]), (first[sa], first[sb]), (last[sa], last[sb])


@pytest.mark.parametrize("policy", ["first-token", "remaining-work"])
def test_a_first_token_swaps_a_decoder_out_and_every_token_still_equals_generate(tiny, policy):
    eng = engine(tiny, policy)
    (a, b), (ta, tb), (_, first_b), (last_a, _) = late_arrival(eng)
    assert eng.stats.swaps == 1
    assert first_b < last_a                       # B's first token came before A's answer ended
    assert ta == hf_greedy(tiny, a, 30, ignore_eos=True) and tb == hf_greedy(tiny, b, 4, ignore_eos=True)
    assert eng.pool.counters["restores"] + eng.pool.counters["loads"] >= 1     # A came back through the pool
    eng.close()


def test_fcfs_makes_the_late_request_wait_for_the_decoder_to_finish(tiny):
    eng = engine(tiny, "fcfs")
    (a, b), (ta, tb), (_, first_b), (last_a, _) = late_arrival(eng)
    assert eng.stats.swaps == 0 and first_b > last_a
    assert ta == hf_greedy(tiny, a, 30, ignore_eos=True) and tb == hf_greedy(tiny, b, 4, ignore_eos=True)
    eng.close()


@pytest.mark.parametrize("policy", ["first-token", "remaining-work"])
def test_nobody_is_swapped_when_swapping_could_not_make_room(tiny, policy):
    eng = engine(tiny, policy, num_blocks=14)
    eng.add_request(ids(20, 1), SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        eng.step()
    seq = eng.scheduler.running[0]                 # holds 6 blocks, 8 free
    big = ids(30, 3)                               # 8 blocks: 1 free + A's 6 would not hold it
    eng.blocks.take(list(eng.blocks.free)[:7])     # a stand-in for blocks held elsewhere (not a swappable decoder)
    eng.add_request(big, SamplingParams(max_tokens=1))
    eng.step()
    assert eng.stats.swaps == 0 and seq in eng.scheduler.running


@pytest.mark.parametrize("policy", ["first-token", "remaining-work"])
def test_a_sequence_is_swapped_at_most_max_swaps_times(tiny, policy):
    eng = engine(tiny, policy, max_swaps=0)
    (a, b), (ta, tb), _, _ = late_arrival(eng)
    assert eng.stats.swaps == 0
    assert ta == hf_greedy(tiny, a, 30, ignore_eos=True) and tb == hf_greedy(tiny, b, 4, ignore_eos=True)
    eng.close()


@pytest.mark.parametrize("bad", [{"scheduling_policy": "lifo"}, {"max_swaps": -1}, {"starvation_factor": 0.5}])
def test_a_bad_policy_is_a_config_error(bad):
    with pytest.raises(ConfigError):
        EngineConfig(**bad).validate()


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@pytest.mark.parametrize("policy", ["first-token", "remaining-work"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(9, 40), min_size=2, max_size=4), arrivals=st.lists(st.integers(0, 12), min_size=4,
       max_size=4), max_tokens=st.integers(2, 12), spare=st.integers(0, 6), max_swaps=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_any_arrivals_under_a_tight_budget_swap_and_still_give_generates_tokens(tiny, lengths, arrivals, max_tokens,
                                                                                 spare, max_swaps, seed, policy):
    need = -(-(max(lengths) + max_tokens) // 4)
    eng = engine(tiny, policy, num_blocks=need + spare, max_swaps=max_swaps)
    prompts = [ids(n, seed + i) for i, n in enumerate(lengths)]
    tokens, added, step = {}, {}, 0
    while len(added) < len(prompts) or eng.has_unfinished():
        for i, p in enumerate(prompts):
            if i not in added and arrivals[i] <= step:
                added[i] = eng.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for out in eng.step():
            tokens.setdefault(out.seq_id, []).extend(out.new_token_ids)
        step += 1
    assert [tokens[added[i]] for i in range(len(prompts))] == [hf_greedy(tiny, p, max_tokens, ignore_eos=True)
                                                                    for p in prompts]
    assert eng.blocks.num_free == eng.num_blocks
    eng.close()
