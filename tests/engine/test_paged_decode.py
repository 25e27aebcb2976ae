"""The native paged decode op (engine/paged_decode.py) reads each decode's keys in place and gives SDPA's result over
the same keys: scattered blocks, GQA, windows, head sizes off the vector width, one sequence or many; an engine
with it gathers no decode K/V; the switch and a bad value."""

import pytest
import torch
import torch.nn.functional as F

from kvflow.engine import EngineConfig, LLMEngine, SamplingParams, paged_decode
from kvflow.errors import ConfigError
from tests.engine.helpers import hf_greedy, record_gathers

pytestmark = pytest.mark.skipif(not paged_decode.available(), reason="the native paged decode op is not built here")


def _case(b, hq, kvh, d, lengths, block_size=16, num_blocks=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, num_blocks * block_size, kvh, d, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()             # blocks anywhere, in no order
    width = max((n + block_size - 1) // block_size for n in lengths)
    tables, used = [], 0
    for n in lengths:
        own = order[used:used + (n + block_size - 1) // block_size]
        used += len(own)
        tables.append(own + [own[0]] * (width - len(own)))
    q = torch.randn(b, hq, d, generator=g)
    return q, kv, torch.tensor(tables), torch.tensor(lengths)


def _sdpa(q, kv, tables, lengths, block_size, scale, window):
    outs = []
    for i, n in enumerate(lengths.tolist()):
        slots = (tables[i].view(-1, 1) * block_size + torch.arange(block_size)).view(-1)[:n]
        lo = max(0, n - window) if window else 0
        k, v = kv[0, slots[lo:]].transpose(0, 1), kv[1, slots[lo:]].transpose(0, 1)          # [Hkv, n, D]
        outs.append(F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, scale=scale,
                                                   enable_gqa=q.shape[1] != k.shape[0]).squeeze(1))
    return torch.stack(outs)


@pytest.mark.parametrize("hq,kvh,d", [(9, 3, 64), (4, 4, 36), (8, 2, 128)])
@pytest.mark.parametrize("lengths", [[1], [700], [5, 17, 16, 300], [33] * 9 + [1000]])
@pytest.mark.parametrize("window", [None, 48])
def test_the_op_gives_sdpa_over_each_decodes_own_keys(hq, kvh, d, lengths, window):
    q, kv, tables, lens = _case(len(lengths), hq, kvh, d, lengths, seed=sum(lengths) + d)
    got = paged_decode.attend(q, kv, tables, lens, 16, d ** -0.5, window)
    want = _sdpa(q, kv, tables, lens, 16, d ** -0.5, window)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_long_decode_cut_in_pieces_across_threads_gives_sdpa(threads):
    """A lone long decode (and one among short ones) is cut into pieces merged by log-sum-exp; how many depends on
    the thread count, the result does not."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lengths in ([4000], [4000, 20, 300]):
            q, kv, tables, lens = _case(len(lengths), 9, 3, 64, lengths, num_blocks=300, seed=threads)
            got = paged_decode.attend(q, kv, tables, lens, 16, 0.125, None)
            assert (got - _sdpa(q, kv, tables, lens, 16, 0.125, None)).abs().max().item() <= 1e-5
    finally:
        torch.set_num_threads(before)


def test_the_op_refuses_a_length_beyond_its_table_or_a_block_beyond_the_cache():
    q, kv, tables, lens = _case(1, 4, 2, 32, [20])
    with pytest.raises(RuntimeError, match="outside the block table"):
        paged_decode.attend(q, kv, tables, torch.tensor([33]), 16, 0.2, None)
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_decode.attend(q, kv, torch.tensor([[0, 300]]), lens, 16, 0.2, None)


def test_an_engine_with_the_op_gathers_no_kv_for_decodes_or_first_chunks(tiny, monkeypatch):
    gathered = record_gathers(monkeypatch)
    engine = LLMEngine(tiny, EngineConfig(kv_budget=8 << 20))
    assert engine.batch_runner.native
    prompts = [[(7 * i + j) % 500 + 1 for j in range(40 + 30 * i)] for i in range(3)]
    got = engine.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert not gathered      # decodes read in place; the prompts' (first) chunks attend their own new K/V
    assert [c.token_ids for c in got] == [hf_greedy(tiny, p, 5, ignore_eos=True) for p in prompts]


def test_the_switch_and_a_bad_value(monkeypatch):
    monkeypatch.setenv("KVFLOW_DECODE_ATTENTION", "torch")
    assert not paged_decode.available()
    monkeypatch.setenv("KVFLOW_DECODE_ATTENTION", "cuda")
    with pytest.raises(ConfigError, match="KVFLOW_DECODE_ATTENTION"):
        paged_decode.available()
