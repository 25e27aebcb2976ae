import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.chunks import chunk_keys, layer_groups, prefix_hashes

FP = "0123456789abcdef" * 2


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 50000), min_size=0, max_size=300), chunk=st.integers(1, 64))
def test_only_full_chunks_get_keys(ids, chunk):
    assert len(prefix_hashes(ids, FP, chunk)) == len(ids) // chunk


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 50000), min_size=8, max_size=200), pos=st.integers(0, 199), chunk=st.integers(1, 32))
def test_changing_one_token_changes_that_chunk_and_every_later_key(ids, pos, chunk):
    pos %= len(ids)
    other = list(ids)
    other[pos] += 1
    a, b = prefix_hashes(ids, FP, chunk), prefix_hashes(other, FP, chunk)
    changed_from = pos // chunk
    assert a[:changed_from] == b[:changed_from]
    assert all(x != y for x, y in zip(a[changed_from:], b[changed_from:]))


def test_keys_depend_on_model_chunk_size_layer_range_and_kind():
    ids = torch.arange(512)
    base = chunk_keys(ids, FP, 256, [(0, 2)])[0][0]
    assert chunk_keys(ids, "f" * 32, 256, [(0, 2)])[0][0].digest != base.digest
    assert chunk_keys(ids, FP, 128, [(0, 2)])[1][0].digest != base.digest
    assert chunk_keys(ids, FP, 256, [(0, 1)])[0][0].digest != base.digest
    assert chunk_keys(ids, FP, 256, [(0, 2)], kind="act")[0][0].digest != base.digest
    assert chunk_keys(ids, FP, 256, [(0, 2)])[0][0] == base  # deterministic
    assert base.tokens == (0, 256) and chunk_keys(ids, FP, 256, [(0, 2)])[1][0].tokens == (256, 512)


def test_tensor_and_list_token_ids_give_the_same_keys():
    ids = list(range(1000, 1600))
    assert prefix_hashes(ids, FP, 100) == prefix_hashes(torch.tensor(ids), FP, 100)


def test_layer_groups_cover_all_layers_once():
    assert layer_groups(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert layer_groups(4, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
