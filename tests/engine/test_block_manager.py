"""Block manager properties: no block is owned twice, refcounts count the block tables holding a block, freed
blocks keep their prefix cached until they are reused (LRU), and a hit never covers the last prompt token."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.engine.block_manager import BlockManager
from kvflow.engine.sampling import SamplingParams
from kvflow.engine.sequence import Sequence

BS = 4


def seq(i, tokens):
    return Sequence(i, list(tokens), len(tokens), SamplingParams())


def check_invariants(bm: BlockManager, live: list[Sequence]):
    held = {}
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table)             # a table never holds a block twice
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == held.get(block.block_id, 0)
        assert (block.block_id in bm.free) == (block.ref_count == 0)
    for h, b in bm.cached.items():
        assert bm.blocks[b].hash == h
    assert len(bm.free) + len(held) == bm.num_blocks


def compute_all(bm, s):
    s.num_computed = s.num_tokens
    bm.commit(s)


ops = st.lists(st.tuples(st.sampled_from(["add", "free", "grow"]), st.integers(0, 3), st.integers(1, 30)),
               min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=ops)
def test_random_allocations_and_frees_keep_every_invariant(ops):
    bm = BlockManager(12, BS)
    prefixes = [[1] * 40, [2] * 40, list(range(40)), [1] * 8 + [3] * 32]   # shared and diverging prefixes
    live: list[Sequence] = []
    for n, (op, which, length) in enumerate(ops):
        if op == "add":
            s = seq(n, prefixes[which][:length])
            if bm.can_allocate(s):
                s.num_computed = bm.allocate(s)
                assert s.num_computed % BS == 0 and s.num_computed < s.num_tokens
                assert s.token_ids[:s.num_computed] == prefixes[which][:s.num_computed]
                compute_all(bm, s)
                live.append(s)
        elif op == "free" and live:
            bm.free_seq(live.pop(which % len(live)))
        elif op == "grow" and live:
            s = live[which % len(live)]
            s.token_ids.append(7)
            if bm.can_append(s):
                bm.append(s)
                compute_all(bm, s)
            else:
                s.token_ids.pop()
        check_invariants(bm, live)
        for s in [*live, seq(-1, prefixes[which][:length])]:     # kept hashes match as hashing the tokens does
            assert bm.match(s) == bm.match_prefix(s.token_ids)


def test_the_version_moves_when_a_prefix_is_cached_or_evicted_and_only_then():
    bm = BlockManager(4, BS)
    a = seq(0, range(9))
    bm.allocate(a)
    v = bm.version
    a.num_computed = 4
    bm.commit(a)
    assert bm.version == v + 1                   # one block became a cached prefix
    bm.commit(a)
    assert bm.version == v + 1                   # nothing new
    bm.free_seq(a)
    assert bm.version == v + 1                   # freed, still cached
    b = seq(1, [9] * 16)
    bm.allocate(b)                               # takes every block: the cached one is evicted
    assert bm.version == v + 2 and bm.match(seq(2, range(9))) == ([], [])


def test_a_freed_prefix_stays_cached_and_is_hit_again():
    bm = BlockManager(8, BS)
    a = seq(0, range(13))
    bm.allocate(a)
    compute_all(bm, a)
    blocks = list(a.block_table)
    bm.free_seq(a)
    b = seq(1, list(range(13)) + [99])
    assert bm.allocate(b) == 12                  # three full blocks cached; the fourth was partial
    assert b.block_table[:3] == blocks[:3]


def test_free_blocks_are_reused_least_recently_freed_first_and_lose_their_hash():
    bm = BlockManager(4, BS)
    a, b = seq(0, [1] * 8), seq(1, [2] * 5)
    for s in (a, b):
        bm.allocate(s)
        compute_all(bm, s)
    bm.free_seq(a)                                # a's blocks freed first: they go first
    bm.free_seq(b)
    c = seq(2, [3] * 8)
    bm.allocate(c)
    assert bm.match_prefix([1] * 9) == ([], [])      # a's prefix evicted
    assert len(bm.match_prefix([2] * 5)[0]) == 1   # b's survives
    assert bm.evictions == 2


def test_a_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(8, BS)
    a = seq(0, range(8))
    bm.allocate(a)
    compute_all(bm, a)
    assert len(bm.match_prefix(list(range(8)))[0]) == 1
    assert len(bm.match_prefix(list(range(9)))[0]) == 2


def test_a_block_still_being_prefilled_is_not_a_hit():
    bm = BlockManager(8, BS)
    a = seq(0, range(12))
    bm.allocate(a)
    a.num_computed = 4                            # chunked prefill: only block 0 computed so far
    bm.commit(a)
    assert len(bm.match_prefix(list(range(12)))[0]) == 1


@settings(max_examples=100, deadline=None)
@given(ops=ops, order=st.randoms(use_true_random=False))
def test_freed_by_predicts_what_freeing_those_sequences_in_turn_puts_in_the_free_queue(ops, order):
    bm = BlockManager(12, BS)
    prefixes = [[1] * 40, [2] * 40, list(range(40)), [1] * 8 + [3] * 32]   # shared prefixes: blocks held twice
    live: list[Sequence] = []
    for n, (op, which, length) in enumerate(ops):
        s = seq(n, prefixes[which][:length])
        if op == "add" and bm.can_allocate(s):
            s.num_computed = bm.allocate(s)
            compute_all(bm, s)
            live.append(s)
        elif op == "free" and live:
            bm.free_seq(live.pop(which % len(live)))
    order.shuffle(live)
    predicted, before, got = bm.freed_by(live), len(bm.free), []
    for s in live:
        bm.free_seq(s)
        got.append(len(bm.free) - before)
    assert predicted == got
