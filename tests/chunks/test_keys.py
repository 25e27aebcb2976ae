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


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 50000), min_size=0, max_size=200), chunk=st.integers(2, 32),
       pos=st.integers(0, 199))
def test_a_tail_key_names_exactly_its_tokens_and_everything_before_them(ids, chunk, pos):
    """The partial chunk after the full ones gets one key per layer group over tokens [k*c, n): none on a chunk
    boundary; never a full chunk's key; another token anywhere (or one token more or less) is another key."""
    from kvflow.chunks.keys import tail_keys
    keys = tail_keys(ids, FP, chunk, [(0, 2), (2, 3)])
    k = len(ids) // chunk
    if len(ids) % chunk == 0:
        assert keys == []
        return
    assert [key.tokens for key in keys] == [(k * chunk, len(ids))] * 2 and keys[0].layers == (0, 2)
    full = {key.digest for row in chunk_keys(ids + [0] * chunk, FP, chunk, [(0, 2), (2, 3)]) for key in row}
    assert not full & {key.digest for key in keys}
    other = list(ids)
    other[pos % len(ids)] += 1
    assert tail_keys(other, FP, chunk, [(0, 2), (2, 3)])[0].digest != keys[0].digest
    shorter = tail_keys(ids[:-1], FP, chunk, [(0, 2), (2, 3)])
    assert not shorter or shorter[0].digest != keys[0].digest
    assert tail_keys(torch.tensor(ids), FP, chunk, [(0, 2), (2, 3)]) == keys
    groups = [(0, 2), (2, 3)]
    assert chunk_keys(ids, FP, chunk, groups, tail=True) == chunk_keys(ids, FP, chunk, groups) + [keys]
