"""Packed attention: per-sequence SDPA on one step's packed queries equals each sequence's own attention; without
the step's segments it is transformers' sdpa; the model's attention setting is back after every step."""

import types

import pytest
import torch
import torch.nn.functional as F

from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
from kvflow.engine.attention import Segment, groups_of_decodes, packed_attention, segment_mask
from kvflow.engine.paged_cache import PagedKVCache
from tests.engine.helpers import ids

MODULE = types.SimpleNamespace(layer_idx=0, num_key_value_groups=4, is_causal=True, training=False)


def qkv(t, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 8, t, 16, generator=g), torch.randn(1, 2, k, 16, generator=g),
            torch.randn(1, 2, k, 16, generator=g))


def test_without_segments_it_is_transformers_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    q, k, v = qkv(5, 5)
    ours, _ = packed_attention(MODULE, q, k, v, None, scaling=0.25)
    theirs, _ = sdpa_attention_forward(MODULE, q, k, v, None, scaling=0.25)
    assert torch.equal(ours, theirs)


def test_each_segment_attends_only_to_its_own_keys():
    q, k, v = qkv(4, 9)                  # A: positions 3..5 over keys 0..5; B: position 2 over keys 0..2
    cache = PagedKVCache(1, 9, 1, 2, 16)  # one layer, blocks of one token: A's keys in slots 0..5, B's in 6..8
    cache.write(0, torch.arange(9), k, v)
    segs = [Segment(0, 3, 3, torch.arange(0, 6)), Segment(3, 4, 2, torch.arange(6, 9))]
    out, _ = packed_attention(MODULE, q, k[:, :, 3:6], v[:, :, 3:6], None, scaling=0.25, kvflow_segments=segs,
                              kvflow_windows=[None], kvflow_cache=cache)
    k_rep, v_rep = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    mask_a = torch.arange(6).view(1, -1) <= torch.arange(3, 6).view(-1, 1)
    a = torch.nn.functional.scaled_dot_product_attention(q[:, :, :3], k_rep[:, :, :6], v_rep[:, :, :6],
                                                         attn_mask=mask_a, scale=0.25)
    b = torch.nn.functional.scaled_dot_product_attention(q[:, :, 3:], k_rep[:, :, 6:], v_rep[:, :, 6:], scale=0.25)
    assert torch.allclose(out, torch.cat([a, b], 2).transpose(1, 2), atol=1e-6)


@pytest.mark.parametrize("window", [None, 4])
def test_a_decode_over_scattered_blocks_equals_sdpa_over_its_keys(window, monkeypatch):
    """One query gathered from out-of-order blocks (block size 4, a partial last block) and run as two matmuls:
    SDPA over the same keys, its window applied."""
    from kvflow.engine import attention
    monkeypatch.setattr(attention, "ONE_QUERY_KEYS", 1)
    q, k, v = qkv(1, 11, seed=3)         # position 10 over keys 0..10, in blocks 5, 2, 0 (3 of 4 used)
    cache = PagedKVCache(1, 6, 4, 2, 16)
    cache.write(0, cache.slots([5, 2, 0], 0, 11), k, v)
    segs = [Segment(0, 1, 10, cache.blocks([5, 2, 0], 11))]
    out, _ = packed_attention(MODULE, q, k[:, :, 10:], v[:, :, 10:], None, scaling=0.25, kvflow_segments=segs,
                              kvflow_windows=[window], kvflow_cache=cache)
    seen = 0 if window is None else 11 - window
    ref = F.scaled_dot_product_attention(q, k[:, :, seen:], v[:, :, seen:], scale=0.25, enable_gqa=True)
    assert (out - ref.transpose(1, 2)).abs().max() <= 1e-6


@pytest.mark.parametrize("window", [None, 5])
def test_decodes_attended_as_one_group_equal_each_ones_own_attention(window):
    """Three decodes over 11, 6 and 1 keys in scattered blocks, padded to the longest and masked, in one SDPA call:
    each row is the decode's own attention over its keys (its window applied)."""
    cache = PagedKVCache(1, 12, 4, 2, 16)
    tables, ends = [[5, 2, 0], [7, 11], [3]], [11, 6, 1]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 8, 3, 16, generator=g)
    own = []
    for i, (table, end) in enumerate(zip(tables, ends)):
        k, v = torch.randn(1, 2, end, 16, generator=g), torch.randn(1, 2, end, 16, generator=g)
        cache.write(0, cache.slots(table, 0, end), k, v)
        seen = 0 if window is None else max(0, end - window)
        own.append(F.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, seen:], v[:, :, seen:], scale=0.25,
                                                  enable_gqa=True))
    groups = groups_of_decodes(ends, tables, 4, 12, max_keys=1 << 20, bytes_per_key=2 * 2 * 16 * 4, device="cpu")
    assert len(groups) == 1 and groups[0].keys == 12
    out, _ = packed_attention(MODULE, q, None, None, None, scaling=0.25, kvflow_segments=[], kvflow_windows=[window],
                              kvflow_cache=cache, kvflow_decodes=groups)
    assert (out - torch.cat(own, 2).transpose(1, 2)).abs().max() <= 1e-6


def test_a_group_of_decodes_gathers_within_its_byte_and_key_limits(monkeypatch):
    """Groups are consecutive decodes (longest first) whose padded keys stay within GROUP_BYTES of gathered
    K/V and the engine's longest sequence; a decode longer than the limit alone is a group of one."""
    from kvflow.engine import attention
    monkeypatch.setattr(attention, "GROUP_BYTES", 100 * 10)          # 100 keys of 10 bytes
    ends = [120, 40, 33, 30, 20, 17, 3]
    tables = [list(range(0, 8)), [8, 9, 10], [11, 12, 13], [14, 15], [16, 17], [18, 19], [20]]
    groups = groups_of_decodes(ends, tables, 16, 64, max_keys=1 << 20, bytes_per_key=10, device="cpu")
    assert [(g.q0, g.count, g.keys) for g in groups] == [(0, 1, 128), (1, 2, 48), (3, 3, 32), (6, 1, 16)]
    assert all(g.count == 1 or g.count * g.keys <= 100 for g in groups)
    assert [g.count for g in groups_of_decodes(ends, tables, 16, 64, max_keys=64, bytes_per_key=1,
                                               device="cpu")] == [1, 1, 1, 2, 2]


def test_a_window_hides_keys_older_than_the_window():
    m = segment_mask(4, 2, window=3)
    assert m.tolist() == [[False, False, True, True, True, False], [False, False, False, True, True, True]]
    assert segment_mask(0, 5, None) is None and segment_mask(7, 1, None) is None


def test_the_model_keeps_its_attention_implementation_after_a_step(tiny):
    before = tiny.hf_model.config._attn_implementation
    LLMEngine(tiny, EngineConfig(kv_budget=1 << 20)).generate([ids(9, 1), ids(4, 2)], SamplingParams(max_tokens=2))
    assert tiny.hf_model.config._attn_implementation == before


def test_a_step_holds_one_sequences_or_one_groups_gathered_kv_at_a_time(tiny, monkeypatch):
    """Packed attention gathers each sequence's keys (or one group of short decodes') just before its SDPA and frees
    them after: a step batching many decodes never holds more than the longest sequence's K/V of one layer or one
    group's GROUP_BYTES (what bounds the reserve). The copying path: without the native ops."""
    import weakref

    monkeypatch.setenv("KVFLOW_DECODE_ATTENTION", "torch")
    monkeypatch.setenv("KVFLOW_CHUNK_ATTENTION", "torch")

    from kvflow.engine import attention

    live, peak, sizes, groups = [0], [0], [], []
    gather, gather_padded = PagedKVCache.gather, PagedKVCache.gather_padded

    def counted(k, v, into):
        n = k.numel() + v.numel()
        into.append(n)
        live[0] += n
        peak[0] = max(peak[0], live[0])
        for t in (k, v):                # the callback must not hold the tensor
            weakref.finalize(t, lambda half=n // 2: live.__setitem__(0, live[0] - half))
        return k, v

    monkeypatch.setattr(PagedKVCache, "gather", lambda self, layer, blocks, end, first=None:
                        counted(*gather(self, layer, blocks, end), sizes))          # always the copy: counted
    monkeypatch.setattr(PagedKVCache, "gather_padded", lambda self, *a: counted(*gather_padded(self, *a), groups))
    monkeypatch.setattr(attention, "GROUP_BYTES", 400 * 2 * tiny.kv_heads * tiny.head_dim * 4)   # 400 keys
    # chunks of 256: each long prompt continues a chunk (a prompt's first chunk attends its own new K/V, ungathered)
    engine = LLMEngine(tiny, EngineConfig(kv_budget=8 << 20, max_num_batched_tokens=256))
    engine.generate([ids(300 + 40 * i, i) for i in range(6)] + [ids(40, 9), ids(50, 10)], SamplingParams(max_tokens=3))
    per_key = 2 * tiny.kv_heads * tiny.head_dim
    longest_decode = (300 + 40 * 5 + 3 + 15) // 16 * 16                  # a group of one: its padded blocks
    assert len(sizes) > 6 * tiny.num_layers and len(groups) > 3 * tiny.num_layers
    assert max(groups) <= per_key * max(400, longest_decode)
    assert peak[0] <= max(sizes + groups)


def test_a_long_chunk_runs_in_row_blocks_with_the_same_result(monkeypatch):
    """A chunk's rows go to SDPA in blocks bounded by MASK_ELEMENTS; each row's softmax is its own, so the output is
    the one-call output."""
    from kvflow.engine import attention
    monkeypatch.setattr(attention, "splits_at_the_chunk", lambda *a: False)   # the masked path (windows take it)
    q, k, v = qkv(40, 100)                 # 40 queries at positions 60..99 over keys 0..99
    cache = PagedKVCache(1, 100, 1, 2, 16)
    cache.write(0, torch.arange(100), k, v)
    segs = [Segment(0, 40, 60, torch.arange(100))]
    whole, _ = packed_attention(MODULE, q, k, v, None, scaling=0.25, kvflow_segments=segs, kvflow_windows=[None],
                                kvflow_cache=cache)
    monkeypatch.setattr(attention, "MASK_ELEMENTS", 700)     # 7 rows of 100 keys per call
    assert len(attention.row_blocks(60, 40)) == 6
    blocks, _ = packed_attention(MODULE, q, k, v, None, scaling=0.25, kvflow_segments=segs, kvflow_windows=[None],
                                 kvflow_cache=cache)
    assert torch.allclose(whole, blocks, atol=1e-6)


@pytest.mark.parametrize("hq,kvh,start,n", [(8, 2, 100, 37), (4, 4, 1, 2), (14, 2, 1024, 512)])
def test_a_continuing_chunk_as_prefix_plus_diagonal_equals_one_masked_call(hq, kvh, start, n):
    """Prefix keys seen whole + the chunk's own keys causal, merged by log-sum-exp: the masked softmax, GQA or not."""
    from kvflow.engine.attention import prefix_plus_diagonal, splits_at_the_chunk
    g = torch.Generator().manual_seed(start)
    q = torch.randn(1, n, hq, 32, generator=g).transpose(1, 2)      # transformers' layout: not contiguous
    k, v = (torch.randn(1, kvh, start + n, 32, generator=g) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=segment_mask(start, n, None), enable_gqa=hq != kvh,
                                         scale=0.2)
    assert splits_at_the_chunk(q, start, n, None)
    assert not splits_at_the_chunk(q, start, n, 64) and not splits_at_the_chunk(q, 0, n, None)
    assert (prefix_plus_diagonal(q, k, v, start, 0.2) - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("table,end,run", [([3, 4, 5], 11, 3), ([3, 4, 5, 9], 11, 3), ([5, 2, 0], 11, None),
                                           ([0, 1, 3], 11, None), ([7], 1, 7)])
def test_a_gather_over_consecutive_blocks_is_a_view_equal_to_the_copy(table, end, run, monkeypatch):
    """Blocks with consecutive ids are read in place (views, nothing copied; from VIEW_MIN_TOKENS positions, 1
    here); any other table is copied; both give the same K/V. Only the blocks that hold [0, end) count (a table's
    spare last block does not break the run)."""
    from kvflow.engine import paged_cache
    monkeypatch.setattr(paged_cache, "VIEW_MIN_TOKENS", 1)
    q, k, v = qkv(1, end, seed=5)
    cache = PagedKVCache(1, 10, 4, 2, 16)
    cache.write(0, cache.slots(table, 0, end), k, v)
    assert cache.run_start(table, end) == run
    blocks = cache.blocks(table, end)
    copied = cache.gather(0, blocks, end)
    assert torch.equal(copied[0], k) and torch.equal(copied[1], v)
    if run is not None:
        viewed = cache.gather(0, blocks, end, run)
        assert torch.equal(viewed[0], k) and torch.equal(viewed[1], v)
        assert viewed[0].untyped_storage().data_ptr() == cache.kv.untyped_storage().data_ptr()


@pytest.mark.parametrize("window", [None, 6])
def test_chunks_attended_as_one_group_equal_each_ones_own_attention(window):
    """Three chunks continuing their sequences (5 queries from position 9, 2 from 3, 4 from 12) over scattered
    blocks, padded to the widest and the longest and masked, in one SDPA call: each row is its chunk's own causal
    attention over its keys (its window applied)."""
    from kvflow.engine.attention import groups_of_segments
    cache = PagedKVCache(1, 16, 4, 2, 16)
    spans, tables = [(9, 5), (3, 2), (12, 4)], [[5, 2, 0, 9], [7, 11], [3, 1, 14, 6]]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 8, 11, 16, generator=g)
    own, segs, q0 = [], [], 0
    for (start, n), table in zip(spans, tables):
        end = start + n
        k, v = torch.randn(1, 2, end, 16, generator=g), torch.randn(1, 2, end, 16, generator=g)
        cache.write(0, cache.slots(table, 0, end), k, v)
        own.append(F.scaled_dot_product_attention(q[:, :, q0:q0 + n], k, v, attn_mask=segment_mask(start, n, window),
                                                  scale=0.25, enable_gqa=True))
        segs.append(Segment(q0, q0 + n, start, cache.blocks(table, end)))
        q0 += n
    groups, alone = groups_of_segments(segs, tables, 4, 16, max_keys=1 << 20, bytes_per_key=1, device="cpu")
    assert alone == [] and len(groups) == 1 and (groups[0].count, groups[0].width, groups[0].keys) == (3, 5, 16)
    out, _ = packed_attention(MODULE, q, None, None, None, scaling=0.25, kvflow_segments=alone,
                              kvflow_windows=[window], kvflow_cache=cache, kvflow_groups=groups)
    assert (out - torch.cat(own, 2).transpose(1, 2)).abs().max() <= 1e-6


def test_only_short_continuing_chunks_are_grouped_within_the_limits(monkeypatch):
    """A prompt's first chunk, a decode, a chunk over VIEW_MIN_TOKENS keys or over GROUP_CHUNK_ELEMENTS queries x
    keys stays alone, and so does a chunk that is the only candidate; a group keeps its padded keys within the
    byte limit and its padded rows within twice its own."""
    from kvflow.engine import attention
    from kvflow.engine.attention import groups_of_segments
    monkeypatch.setattr(attention, "GROUP_CHUNK_ELEMENTS", 64 * 64)

    def seg(q0, n, start):
        return Segment(q0, q0 + n, start, torch.arange((start + n + 15) // 16))

    tables = [list(range(200))] * 8
    segs = [seg(0, 40, 0), seg(40, 1, 30), seg(41, 30, 3000), seg(71, 60, 200), seg(131, 10, 50)]
    assert groups_of_segments(segs, tables, 16, 512, 1 << 20, 1, "cpu") == ([], segs)    # one candidate: alone
    segs = [seg(0, 10, 50), seg(10, 12, 40), seg(22, 8, 30), seg(30, 40, 100), seg(70, 11, 45)]
    groups, alone = groups_of_segments(segs, tables, 16, 512, 1 << 20, 1, "cpu")
    assert [(g.count, g.width, g.keys) for g in groups] == [(4, 12, 64)] and alone == [segs[3]]
    assert [int(x) for x in groups[0].starts] == [50, 45, 40, 30]      # longest context first
    monkeypatch.setattr(attention, "GROUP_BYTES", 130)                  # 130 keys of one byte: two chunks a group
    groups, alone = groups_of_segments(segs, tables, 16, 512, 1 << 20, 1, "cpu")
    assert [g.count for g in groups] == [2, 2] and alone == [segs[3]]
