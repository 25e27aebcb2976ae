"""vLLM's paged CPU blocks <-> canonical K/V: slots, the probed layout (K transposed or not), chunk alignment."""

import pytest
import torch

from kvflow.errors import ConfigError
from kvflow.integrations.paged import (PagedLayout, check_alignment, from_record, slot_mapping, split,
                                       to_record)
from tests.integrations.fakes import kv_layer, write_op

H, BS, D = 2, 32, 8


def test_a_positions_slot_is_its_block_times_block_size_plus_offset():
    blocks = [7, 3, 12]
    slots = slot_mapping(blocks, 30, 70, BS)
    assert slots.tolist() == [blocks[p // BS] * BS + p % BS for p in range(30, 70)]


@pytest.mark.parametrize("transposed", [True, False])
def test_the_probe_finds_whether_k_is_stored_transposed(transposed):
    layout = PagedLayout.probed(write_op(transposed), H, BS, D, torch.float32)
    assert layout.k_transposed == transposed


def test_on_the_vec_path_k_really_is_transposed_inside_the_block_and_v_is_not():
    cache = kv_layer(1, H, BS, D, fill=0.0)
    k = torch.arange(BS * H * D, dtype=torch.float32).view(BS, H, D)
    write_op(True)(k, k.clone(), *split(cache), torch.arange(BS))
    kc, vc = split(cache)
    assert torch.equal(kc[0, 1].reshape(D, BS), k[:, 1].T)
    assert torch.equal(vc[0, 1], k[:, 1])


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_what_the_op_writes_reads_back_as_canonical_kv(transposed, dtype):
    layout = PagedLayout.probed(write_op(transposed), H, BS, D, dtype)
    cache = kv_layer(10, H, BS, D).to(dtype)
    blocks = [4, 9, 1]
    k = torch.randn(3 * BS, H, D).to(dtype)
    v = torch.randn(3 * BS, H, D).to(dtype)
    layout.write(cache, slot_mapping(blocks, 0, 3 * BS, BS), k, v)
    got_k, got_v = layout.read(cache, blocks)
    assert torch.equal(got_k, k.transpose(0, 1)) and torch.equal(got_v, v.transpose(0, 1))


def test_a_layout_probed_for_the_wrong_path_reads_a_different_block():
    """The negative control: reading a vec-path cache as if K were not transposed gives other numbers."""
    right = PagedLayout.probed(write_op(True), H, BS, D, torch.float32)
    wrong = PagedLayout.probed(write_op(False), H, BS, D, torch.float32)
    cache = kv_layer(2, H, BS, D)
    k, v = torch.randn(BS, H, D), torch.randn(BS, H, D)
    right.write(cache, slot_mapping([1], 0, BS, BS), k, v)
    assert not torch.equal(wrong.read(cache, [1])[0], k.transpose(0, 1))
    assert torch.equal(wrong.read(cache, [1])[1], v.transpose(0, 1))


def test_a_record_is_one_chunk_of_one_layer_in_kvflows_canonical_shape():
    k, v = torch.randn(H, 64, D), torch.randn(H, 64, D)
    rec = to_record(k, v)
    assert rec.shape == (1, 2, H, 64, D)
    tk, tv = from_record(rec)
    assert torch.equal(tk, k.transpose(0, 1)) and torch.equal(tv, v.transpose(0, 1))


def test_a_probe_of_an_op_that_drops_values_is_refused():
    def lossy(key, value, key_cache, value_cache, slots):
        write_op(False)(key[:-1], value[:-1], key_cache, value_cache, slots[:-1])
    with pytest.raises(ConfigError, match="unknown cache layout"):
        PagedLayout.probed(lossy, H, BS, D, torch.float32)


@pytest.mark.parametrize("chunk,block,ok", [(256, 128, True), (128, 128, True), (512, 32, True),
                                            (256, 96, False), (64, 128, False)])
def test_a_pool_chunk_must_be_whole_vllm_blocks(chunk, block, ok):
    if ok:
        check_alignment(chunk, block)
    else:
        with pytest.raises(ConfigError, match="multiple of vLLM's block size"):
            check_alignment(chunk, block)


@pytest.mark.parametrize("transposed", [True, False])
def test_a_stated_layout_is_the_probed_one(transposed):
    probed = PagedLayout.probed(write_op(transposed), H, BS, D, torch.float32)
    stated = PagedLayout.fixed(write_op(transposed), H, BS, D, k_transposed=transposed)
    assert torch.equal(probed.gather_k, stated.gather_k) and torch.equal(probed.gather_v, stated.gather_v)
