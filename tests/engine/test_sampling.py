"""Sampling values are validated; seeded sampling is reproducible wherever a request runs; stop strings, stop
token ids and max_tokens end a request with the right finish_reason."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.engine import EngineConfig, LLMEngine, RequestError, SamplingError, SamplingParams
from kvflow.engine.sampling import sample
from kvflow.engine.tokenizer import ByteTokenizer
from tests.engine.helpers import break_sampling_of_seed, hf_greedy, ids


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-1), dict(temperature=-0.1),
                                 dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(seed="x"),
                                 dict(stop_token_ids=[-1]), dict(stop=[""]), dict(temperature=float("nan")),
                                 dict(seed=-1), dict(seed=2**64)])
def test_out_of_range_sampling_values_are_clear_errors(bad):
    with pytest.raises(SamplingError):
        SamplingParams(**bad)


def test_top_k_one_is_greedy_and_a_seed_repeats_its_draws():
    logits = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1), torch.Generator()) == int(logits.argmax())
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3)
    draws = [[sample(logits, p, g) for _ in range(5)] for g in (p.generator(), p.generator())]
    assert draws[0] == draws[1]
    top = set(torch.topk(logits, 50).indices.tolist())
    assert all(t in top for t in draws[0])


@settings(max_examples=200, deadline=None)
@given(temperature=st.floats(min_value=0.0, max_value=100.0, exclude_min=True) | st.sampled_from([5e-324, 1e-300]),
       top_p=st.floats(min_value=0.0, max_value=1.0, exclude_min=True) | st.sampled_from([5e-324, 1e-300]),
       top_k=st.integers(min_value=-1, max_value=2**40), scale=st.sampled_from([1e-30, 1.0, 1e4, 1e30]),
       seed=st.integers(min_value=0, max_value=2**32))
def test_every_value_validate_admits_samples_a_token_and_never_raises(temperature, top_p, top_k, scale, seed):
    logits = torch.randn(300, generator=torch.Generator().manual_seed(seed)) * scale
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    token = sample(logits, p, p.generator())
    assert 0 <= token < 300
    if top_p < 1e-30 or (temperature < 1e-30 and scale >= 1.0) or top_k == 1:    # all mass on the largest logit
        assert token == int(logits.argmax())


def test_a_request_that_fails_inside_a_step_ends_alone_and_its_step_mates_are_served(tiny, monkeypatch):
    """One request's own failure (here its sampler) gives it finish_reason "error"; the others in the same steps
    finish exactly as generate does."""
    seed = break_sampling_of_seed(monkeypatch)
    engine = LLMEngine(tiny)
    good = [engine.add_request(ids(12, s), SamplingParams(max_tokens=5)) for s in (1, 2)]
    bad = engine.add_request(ids(10, 3), SamplingParams(max_tokens=5, temperature=1.0, seed=seed))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.seq_id, []).append(out)
    assert outs[bad][-1].finish_reason == "error" and "sampler broke" in outs[bad][-1].error
    assert engine.stats.failed == 1
    for seq_id, seed in zip(good, (1, 2)):
        assert [t for o in outs[seq_id] for t in o.new_token_ids] == hf_greedy(tiny, ids(12, seed), 5)
        assert outs[seq_id][-1].error is None
    assert engine.blocks.usage == 0.0


def test_seeded_requests_draw_the_same_tokens_alone_or_batched(tiny):
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    alone = LLMEngine(tiny).generate([ids(20, 1)], p)[0].token_ids
    batched = LLMEngine(tiny).generate([ids(9, 2), ids(20, 1), ids(30, 3)], p)[1].token_ids
    assert alone == batched


def test_a_stop_string_cuts_the_text_and_stops(tiny):
    tok = ByteTokenizer(1024)
    engine = LLMEngine(tiny, tokenizer=tok)
    prompt = ids(10, 4)
    free = tok.decode(hf_greedy(tiny, prompt, 12))
    stop = free[3:5]
    out = engine.generate([prompt], SamplingParams(max_tokens=12, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == free[:free.find(stop)]


def test_max_tokens_ends_with_length(tiny):
    out = LLMEngine(tiny).generate([ids(5, 5)], SamplingParams(max_tokens=3))[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


@pytest.mark.parametrize("prompt,params", [([], SamplingParams()), ([5000], SamplingParams()),
                                           (list(range(100)), SamplingParams(max_tokens=1000))])
def test_requests_the_engine_cannot_serve_are_rejected_at_admission(tiny, prompt, params):
    engine = LLMEngine(tiny, EngineConfig(max_model_len=512))
    with pytest.raises(RequestError):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_a_request_larger_than_the_whole_block_budget_is_rejected(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=2, block_size=4))
    with pytest.raises(RequestError, match="KV budget"):
        engine.add_request(ids(6, 6), SamplingParams(max_tokens=4))


def test_byte_tokenizer_round_trips_text_and_marks_high_ids():
    tok = ByteTokenizer(1024)
    assert tok.decode(tok.encode("héllo ✓")) == "héllo ✓"
    assert tok.decode([104, 300, 105]) == "h<|300|>i"
