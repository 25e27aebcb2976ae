"""Packed attention: per-sequence SDPA on one step's packed queries equals each sequence's own attention; without
the step's segments it is transformers' sdpa; the model's attention setting is back after every step."""

import types

import torch

from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
from kvflow.engine.attention import Segment, packed_attention, segment_mask
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
    segs = [Segment(0, 3, 0, 6, {None: segment_mask(3, 3, None)}),
            Segment(3, 4, 6, 9, {None: segment_mask(2, 1, None)})]
    out, _ = packed_attention(MODULE, q, k, v, None, scaling=0.25, kvflow_segments=segs, kvflow_windows=[None])
    k_rep, v_rep = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    mask_a = torch.arange(6).view(1, -1) <= torch.arange(3, 6).view(-1, 1)
    a = torch.nn.functional.scaled_dot_product_attention(q[:, :, :3], k_rep[:, :, :6], v_rep[:, :, :6],
                                                         attn_mask=mask_a, scale=0.25)
    b = torch.nn.functional.scaled_dot_product_attention(q[:, :, 3:], k_rep[:, :, 6:], v_rep[:, :, 6:], scale=0.25)
    assert torch.allclose(out, torch.cat([a, b], 2).transpose(1, 2), atol=1e-6)


def test_a_window_hides_keys_older_than_the_window():
    m = segment_mask(4, 2, window=3)
    assert m.tolist() == [[False, False, True, True, True, False], [False, False, False, True, True, True]]
    assert segment_mask(0, 5, None) is None and segment_mask(7, 1, None) is None


def test_the_model_keeps_its_attention_implementation_after_a_step(tiny):
    before = tiny.hf_model.config._attn_implementation
    LLMEngine(tiny, EngineConfig(kv_budget=1 << 20)).generate([ids(9, 1), ids(4, 2)], SamplingParams(max_tokens=2))
    assert tiny.hf_model.config._attn_implementation == before
