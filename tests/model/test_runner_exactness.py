"""Every way of assembling a KV cache range by range equals one fresh full prefill (fp32, <= 1e-4, same argmax)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import max_abs_diff_kv, small_runner

TOL = 1e-4
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def families(tiny):
    return {
        "llama": tiny,
        "qwen2": small_runner("qwen2"),
        "mistral-sliding": small_runner("mistral", sliding_window=48),
    }


def _ids(n: int, seed: int = 0, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _assert_exact(runner, cache, length, logits, ids):
    ref_kv, ref_logits = runner.reference_prefill(ids)
    assert max_abs_diff_kv(cache.layer_kv(length), ref_kv, window_ok=any(runner._windows)) <= TOL
    assert (logits - ref_logits).abs().max().item() <= TOL
    assert logits.argmax() == ref_logits.argmax()


@SETTINGS
@given(n=st.integers(2, 300), frac=st.floats(0.0, 1.0), family=st.sampled_from(["llama", "qwen2", "mistral-sliding"]))
def test_token_split_equals_full_prefill(families, n, frac, family):
    runner = families[family]
    ids = _ids(n, n)
    a = min(n - 1, int(frac * n))
    cache = runner.new_cache(n)
    if a:
        runner.prefill_range(cache, ids[:a], 0)
    hidden = runner.prefill_range(cache, ids[a:], a)
    _assert_exact(runner, cache, n, runner.logits(hidden), ids)


@SETTINGS
@given(n=st.integers(2, 300), cut=st.integers(0, 4), pieces=st.integers(1, 4),
       family=st.sampled_from(["llama", "qwen2", "mistral-sliding"]))
def test_layer_split_equals_full_prefill(families, n, cut, pieces, family):
    """Lower layers for all tokens at once, upper layers token piece by token piece from the boundary hidden state."""
    runner = families[family]
    ids = _ids(n, n + 1)
    cache = runner.new_cache(n)
    boundary = runner.run_layers(cache, runner.embed(ids), 0, (0, cut))
    step = -(-n // pieces)
    for a in range(0, n, step):
        out = runner.run_layers(cache, boundary[:, a:a + step], a, (cut, runner.num_layers))
    _assert_exact(runner, cache, n, runner.logits(out), ids)


@SETTINGS
@given(n=st.integers(8, 300), chunk=st.integers(4, 96), data=st.data())
def test_staircase_mix_equals_full_prefill(families, n, chunk, data):
    """Per chunk a different number of lower layers is computed first (non-increasing over chunks); the missing
    upper layers are filled afterwards from the boundary hidden states. Any such staircase is exact."""
    runner = families["llama"]
    L = runner.num_layers
    ids = _ids(n, chunk)
    bounds = list(range(0, n, chunk)) + [n]
    splits = sorted(data.draw(st.lists(st.integers(0, L), min_size=len(bounds) - 1, max_size=len(bounds) - 1)),
                    reverse=True)
    cache = runner.new_cache(n)
    boundary = {}
    for (a, b), s in zip(zip(bounds, bounds[1:]), splits):
        boundary[a] = runner.run_layers(cache, runner.embed(ids[a:b]), a, (0, s))
    for (a, b), s in zip(zip(bounds, bounds[1:]), splits):  # fill the rest, chunk order, upper layers
        out = runner.run_layers(cache, boundary[a], a, (s, L))
    _assert_exact(runner, cache, n, runner.logits(out), ids)


@SETTINGS
@given(n=st.integers(4, 300), stage=st.integers(1, 3), chunk=st.integers(8, 128))
def test_layer_range_from_stored_boundary_activations(families, n, stage, chunk):
    """A pipeline stage owning layers [stage, L) restores its KV alone from the stored hidden state entering
    layer ``stage`` (chunk by chunk), without running the earlier layers."""
    runner = families["llama"]
    ids = _ids(n, stage)
    full = runner.new_cache(n)
    stored_boundary = runner.run_layers(full, runner.embed(ids), 0, (0, stage)).clone()
    runner.run_layers(full, stored_boundary, 0, (stage, runner.num_layers))
    ref_kv, _ = runner.reference_prefill(ids)

    stage_cache = runner.new_cache(n)
    for a in range(0, n, chunk):
        runner.run_layers(stage_cache, stored_boundary[:, a:a + chunk], a, (stage, runner.num_layers))
    restored = stage_cache.layer_kv(n)[stage:]
    assert max_abs_diff_kv(restored, ref_kv[stage:]) <= TOL


def test_query_after_restored_cache_gives_reference_logits(tiny):
    ids = _ids(400, 7, 1024)
    context, query = ids[:350], ids[350:]
    restored = tiny.prefill(context, capacity=400, chunk=128).cache
    block = restored.read_block((0, 350), (0, tiny.num_layers))
    fresh = tiny.new_cache(400)
    fresh.write_block(block, (0, 350), (0, tiny.num_layers))   # "loaded" from elsewhere
    logits = tiny.logits(tiny.prefill_range(fresh, query, 350))
    _, ref = tiny.reference_prefill(ids)
    assert (logits - ref).abs().max().item() <= TOL and logits.argmax() == ref.argmax()


def test_kv_block_round_trip_layout(tiny):
    cache = tiny.prefill(_ids(100, 3, 1024)).cache
    block = cache.read_block((10, 60), (1, 3))
    assert block.shape == tiny.block_shape(50, 2) == (2, 2, tiny.kv_heads, 50, tiny.head_dim)
    other = tiny.new_cache(100)
    other.write_block(block, (10, 60), (1, 3))
    assert torch.equal(other.keys[2][0, :, 10:60], cache.keys[2][0, :, 10:60])
    assert torch.equal(other.values[1][0, :, 10:60], cache.values[1][0, :, 10:60])


def _three_chunks_exact(runner, ids):
    """61 tokens prefilled as chunks [0, 40), [40, 60), [60, 61): the logits and KV are the full prefill's."""
    cache = runner.new_cache(61)
    runner.prefill_range(cache, ids[:40], 0)
    runner.prefill_range(cache, ids[40:60], 40)
    _assert_exact(runner, cache, 61, runner.logits(runner.prefill_range(cache, ids[60:], 60)), ids)


def test_a_continuing_chunk_attends_without_a_mask_except_under_a_window(families, monkeypatch):
    """torch's path: chunks at start > 0 of windowless layers take the prefix + diagonal split (model/attention.py);
    a chunk from position 0, a single query and sliding-window layers keep SDPA — and the model's attention setting
    is kvflow's."""
    from kvflow.model import attention
    monkeypatch.setenv("KVFLOW_CHUNK_ATTENTION", "torch")
    calls = []
    real = attention.prefix_plus_diagonal
    monkeypatch.setattr(attention, "prefix_plus_diagonal", lambda *a: calls.append(a[3]) or real(*a))
    for family, want in (("llama", [40] * 4), ("mistral-sliding", [])):
        runner, ids = families[family], _ids(61, 7)
        assert runner.config._attn_implementation == attention.NAME
        calls.clear()
        _three_chunks_exact(runner, ids)
        assert calls == want, family


def test_with_the_native_op_every_chunk_and_the_full_prefill_go_native_and_agree_bit_for_bit(families, monkeypatch):
    """The native chunk op (model/chunk_attention.py) takes every chunk of a windowless layer — from position 0, on
    a prefix, a single query — and the full prefill too (no mask: model/attention.py), so chunked and full give the
    same KV and logits bit for bit; sliding-window layers, whose full prefill has a mask, keep SDPA."""
    from kvflow.model import attention, chunk_attention
    if not chunk_attention.available():
        pytest.skip("the native chunk op is not built here")
    calls, real = [], chunk_attention.dense
    monkeypatch.setattr(chunk_attention, "dense", lambda q, k, v, start, *a: calls.append(start) or
                        real(q, k, v, start, *a))
    monkeypatch.setattr(attention, "prefix_plus_diagonal", None)        # never reached
    for family, want in (("llama", [0] * 4 + [40] * 4 + [60] * 4 + [0] * 4), ("mistral-sliding", [])):
        runner, ids = families[family], _ids(61, 7)
        calls.clear()
        _three_chunks_exact(runner, ids)
        assert calls == want, family


PACKED = dict(layers=2, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def packed_families():
    """Shapes whose every projection is packed for oneDNN (model/linear.py: 512 x 512 and up), as a real model's."""
    return {family: small_runner(family, **PACKED) for family in ("llama", "qwen2")}


def test_a_model_claims_bit_for_bit_only_where_every_projection_is_packed_and_no_window_slides(packed_families):
    """``ModelRunner.bit_for_bit`` (what the tests' bound reads): the packed shapes, yes where the native op and
    oneDNN are here; projections too small to pack (F.linear) or a sliding window, no."""
    from kvflow.model import chunk_attention, linear
    here = chunk_attention.available() and linear.available() and linear.mode() == "onednn"
    assert all(r.bit_for_bit == here for r in packed_families.values())
    assert not small_runner("llama", layers=2).bit_for_bit                 # hidden 128: nothing packs
    assert not small_runner("mistral", **PACKED, sliding_window=48).bit_for_bit


@SETTINGS
@given(sizes=st.lists(st.integers(1, 100), min_size=1, max_size=4), family=st.sampled_from(["llama", "qwen2"]))
def test_with_the_native_op_any_chunking_gives_the_full_prefills_bits(packed_families, sizes, family):
    """A query's attention does not depend on the chunk it comes in (csrc/chunk_attention.cpp), the layers compute
    alike on every path (model/layer.py) and a packed projection gives a row the same bits whatever shares its call
    (model/linear.py): chunks of any sizes, lone tokens included, give the full prefill's KV and logits exactly.
    (The small shapes above keep MKL's F.linear and torch's SiLU, whose rows of a short or odd-sized call can round
    differently: those agree within the bound, not bit for bit.)"""
    runner = packed_families[family]
    if not runner.bit_for_bit:                 # the test above: it is wherever this host has the op and oneDNN
        pytest.skip("the native chunk op or oneDNN is not here")
    n = sum(sizes)
    ids = _ids(n, n + 1)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    cache = runner.new_cache(n)
    for a, b in zip(bounds, bounds[1:]):
        hidden = runner.prefill_range(cache, ids[a:b], a)
    ref_kv, ref_logits = runner.reference_prefill(ids)
    assert all(torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in zip(cache.layer_kv(n), ref_kv))
    assert torch.equal(runner.logits(hidden), ref_logits)
