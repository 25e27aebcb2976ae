"""The native chunk attention op (model/chunk_attention.py) gives SDPA's result over each chunk's own keys — causal
from its start, GQA, windows, several chunks of a step at once read in place from scattered blocks, keys in strided
tensors — gives a query the same bits whatever chunk it comes in, refuses what it cannot read, is what an engine's and a runner's chunks go through (no K/V gathered, tokens
equal ``generate``), and has a switch."""

import pytest
import torch
import torch.nn.functional as F

from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
from kvflow.errors import ConfigError
from kvflow.model import chunk_attention
from tests.engine.helpers import hf_greedy, record_gathers

pytestmark = pytest.mark.skipif(not chunk_attention.available(), reason="the native chunk op is not built here")


def _want(q, k, v, start, scale, window):
    """fp64 SDPA with an explicit mask: q [n, Hq, D] at positions start.., k, v [start + n, Hkv, D] -> [n, Hq, D]."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    qpos, kpos = torch.arange(start, start + n).view(-1, 1), torch.arange(start + n).view(1, -1)
    seen = kpos <= qpos
    if window:
        seen &= (qpos - kpos) < window
    kk, vv = (t.transpose(0, 1).double().repeat_interleave(g, 0) for t in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1).double(), kk, vv, attn_mask=seen,
                                          scale=scale).transpose(0, 1).float()


def _paged(chunks, hkv, d, block_size=16, seed=0):
    """Chunks (start, n) with keys scattered over a cache's blocks: their tables, the cache layer, and each chunk's
    dense K/V."""
    g = torch.Generator().manual_seed(seed)
    need = [(s + n + block_size - 1) // block_size for s, n in chunks]
    order = torch.randperm(sum(need) + 5, generator=g).tolist()
    kv = torch.randn(2, len(order) * block_size, hkv, d, generator=g)
    tables, dense, used = [], [], 0
    for (s, n), nb in zip(chunks, need):
        own = order[used:used + nb]
        used += nb
        slots = (torch.tensor(own).view(-1, 1) * block_size + torch.arange(block_size)).view(-1)[:s + n]
        dense.append((kv[0, slots], kv[1, slots]))
        tables.append(own + [own[0]] * (max(need) - nb))
    return kv, torch.tensor(tables), dense


@pytest.mark.parametrize("hq,kvh,d", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (12, 2, 16)])
@pytest.mark.parametrize("window", [None, 48])
def test_every_chunk_of_a_step_gets_sdpa_over_its_own_keys(hq, kvh, d, window):
    chunks = [(0, 1), (0, 300), (288, 44), (17, 5), (1000, 130), (5, 1)]
    kv, tables, dense = _paged(chunks, kvh, d, seed=hq + d)
    g = torch.Generator().manual_seed(d)
    qs = [torch.randn(n, hq, d, generator=g) for _, n in chunks]
    offsets = torch.tensor([0] + [sum(n for _, n in chunks[:i + 1]) for i in range(len(chunks))])
    got = chunk_attention.paged(torch.cat(qs), kv, tables, torch.tensor([s for s, _ in chunks]), offsets, 16,
                                d ** -0.5, window)
    for i, ((s, n), q, (k, v)) in enumerate(zip(chunks, qs, dense)):
        want = _want(q, k, v, s, d ** -0.5, window)
        assert (got[offsets[i]:offsets[i + 1]] - want).abs().max().item() <= 2e-5
        one = chunk_attention.dense(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                    v.transpose(0, 1).unsqueeze(0), s, d ** -0.5, window)[0]    # strided keys
        assert (one - want).abs().max().item() <= 2e-5


@pytest.mark.parametrize("window", [0, 300])
def test_a_querys_result_is_the_same_bits_whatever_chunk_it_comes_in(window):
    """Tiles at fixed key positions, rows that never mix: a prompt attended whole, in chunks of any size, or as one
    of a step's chunks read from scattered blocks gives every query the same bits (what makes chunked, restored and
    served prefills equal the full prefill exactly)."""
    n, hq, kvh, d = 1100, 6, 2, 64
    g = torch.Generator().manual_seed(window)
    q, k, v = torch.randn(n, hq, d, generator=g) * 2, torch.randn(n, kvh, d, generator=g) * 2, \
        torch.randn(n, kvh, d, generator=g)
    whole = torch.ops.kvflow.chunk_attention(q, k, v, 0, 0.125, window)
    for cuts in ([0, 1, 17, 300, 301, 1099, 1100], [0, 129, 640, 1100], [0, 1024, 1100]):
        for a, b in zip(cuts, cuts[1:]):
            assert torch.equal(torch.ops.kvflow.chunk_attention(q[a:b].contiguous(), k[:b], v[:b], a, 0.125, window),
                               whole[a:b])
    kv, tables, _ = _paged([(0, n)], kvh, d, seed=5)          # the same keys scattered over a cache's blocks
    slots = (tables[0].view(-1, 1) * 16 + torch.arange(16)).view(-1)[:n]
    kv[0, slots], kv[1, slots] = k, v
    got = chunk_attention.paged(torch.cat([q[:300], q[300:]]), kv, torch.cat([tables, tables]),
                                torch.tensor([0, 300]), torch.tensor([0, 300, n]), 16, 0.125, window or None)
    assert torch.equal(got, whole)


def test_long_chunks_take_the_long_work_items_and_agree_too():
    chunks = [(4500, 200)]                      # more than 4,096 keys: 128 query positions an item
    kv, tables, dense = _paged(chunks, 2, 64, seed=3)
    q = torch.randn(200, 6, 64, generator=torch.Generator().manual_seed(4))
    got = chunk_attention.paged(q, kv, tables, torch.tensor([4500]), torch.tensor([0, 200]), 16, 0.125, None)
    assert (got - _want(q, *dense[0], 4500, 0.125, None)).abs().max().item() <= 2e-5


def test_the_op_refuses_what_it_cannot_read():
    kv, tables, _ = _paged([(0, 20)], 2, 32)
    q = torch.randn(20, 4, 32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        chunk_attention.paged(q, kv, torch.tensor([[0, 10_000]]), torch.tensor([0]), torch.tensor([0, 20]), 16, 0.2,
                              None)
    with pytest.raises(RuntimeError, match="outside its block table"):
        chunk_attention.paged(q, kv, tables, torch.tensor([100]), torch.tensor([0, 20]), 16, 0.2, None)
    with pytest.raises(RuntimeError, match="offsets"):
        chunk_attention.paged(q, kv, tables, torch.tensor([0]), torch.tensor([0, 19]), 16, 0.2, None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.kvflow.chunk_attention(torch.randn(3, 2, 36), torch.randn(3, 1, 36), torch.randn(3, 1, 36), 0,
                                         0.2, 0)
    assert not chunk_attention.fits(36) and chunk_attention.fits(64, torch.zeros(1))
    assert not chunk_attention.fits(64, torch.zeros(1, dtype=torch.bfloat16))


def test_an_engines_chunks_are_read_in_place_and_its_tokens_equal_generate(tiny, monkeypatch):
    gathered = record_gathers(monkeypatch)
    engine = LLMEngine(tiny, EngineConfig(kv_budget=8 << 20, max_num_batched_tokens=64))
    assert engine.batch_runner.native_chunks
    base = [(5 * j) % 500 + 1 for j in range(150)]
    prompts = [base + [(7 * i + j) % 500 + 1 for j in range(10 + 20 * i)] for i in range(3)] + [base[:90]]
    got = engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))     # chunked, prefixes shared
    assert not gathered
    assert [c.token_ids for c in got] == [hf_greedy(tiny, p, 4, ignore_eos=True) for p in prompts]


def test_the_switch_and_a_bad_value(monkeypatch):
    monkeypatch.setenv("KVFLOW_CHUNK_ATTENTION", "torch")
    assert not chunk_attention.available()
    monkeypatch.setenv("KVFLOW_CHUNK_ATTENTION", "sdpa")
    with pytest.raises(ConfigError, match="KVFLOW_CHUNK_ATTENTION"):
        chunk_attention.available()
