"""The model's shape is the one source of its sizes: the KV bytes it counts are the bytes the caches hold, the
advisor's shape of a preset is the runner's, and every name of a dtype means one torch dtype and one size."""

import pytest
import torch

from kvflow.advisor import load_shape
from kvflow.engine.paged_cache import PagedKVCache
from kvflow.errors import ConfigError, ModelError
from kvflow.model.dtypes import TABLE, itemsize, parse_dtype, sized


def test_kv_bytes_per_token_are_the_bytes_a_cache_holds_per_token(tiny):
    cache = tiny.new_cache(8)
    held = sum(t.numel() * t.element_size() for t in cache.keys + cache.values) // 8
    assert tiny.shape.kv_bytes_per_token(tiny.dtype) == held == tiny.kv_bytes_per_token()
    paged = PagedKVCache(tiny.num_layers, 3, 16, tiny.kv_heads, tiny.head_dim, torch.bfloat16)
    assert 3 * 16 * tiny.shape.kv_bytes_per_token("bf16") == paged.kv.numel() * paged.kv.element_size()
    per_layer = tiny.shape.kv_bytes_per_token_layer("float16")
    assert tiny.shape.kv_bytes_per_token("float16") == tiny.num_layers * per_layer


@pytest.mark.parametrize("name", ["tiny", "qwen2.5-0.5b@layers=2"])
def test_the_runner_and_the_advisor_read_one_shape_of_a_preset(name):
    from kvflow import load_model
    assert load_model(name).shape == load_shape(name)


def test_every_name_of_a_dtype_is_one_torch_dtype_of_one_size():
    for d in TABLE:
        assert sized(d.name, "x") == sized(d.short, "x") == itemsize(d.torch) == d.torch.itemsize == d.itemsize
        if d.computes:
            assert parse_dtype(d.name) is parse_dtype(d.short) is d.torch


def test_fp8_sizes_a_kv_cache_but_is_no_dtype_to_compute_in():
    assert sized("fp8", "--kv-dtype") == 1
    with pytest.raises(ModelError, match="float32, bfloat16, float16"):
        parse_dtype("float8")
    with pytest.raises(ConfigError, match="--kv-dtype 'int3'"):
        sized("int3", "--kv-dtype")
