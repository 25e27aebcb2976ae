"""Sampling values are validated; seeded sampling is reproducible wherever a request runs; stop strings, stop
token ids and max_tokens end a request with the right finish_reason."""

import pytest
import torch

from kvflow.engine import EngineConfig, LLMEngine, RequestError, SamplingError, SamplingParams
from kvflow.engine.sampling import sample
from kvflow.engine.tokenizer import ByteTokenizer
from tests.engine.helpers import hf_greedy, ids


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
