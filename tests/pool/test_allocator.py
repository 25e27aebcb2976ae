"""The extent allocator: aligned, non-overlapping extents; exact free-space accounting; coalescing."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.pool.allocator import ExtentAllocator, round_up

ALIGN = 4096
ops = st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(1, 64 * ALIGN)),
                         st.tuples(st.just("free"), st.integers(0, 10**6))), max_size=120)


def check_invariants(a: ExtentAllocator) -> None:
    used = sorted(a.used.items())
    free = a.free_extents()
    for start, n in used + free:
        assert start % ALIGN == 0 and n % ALIGN == 0 and n > 0 and start + n <= a.capacity
    spans = sorted(used + free)
    assert all(s + n <= t for (s, n), (t, _) in zip(spans, spans[1:])), "extents overlap"
    assert sum(n for _, n in spans) == a.capacity, "used + free must tile the device"
    assert a.used_bytes == sum(n for _, n in used) and a.free_bytes == sum(n for _, n in free)
    assert all(s + n < t for (s, n), (t, _) in zip(free, free[1:])), "adjacent free extents must be coalesced"


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 256).map(lambda u: u * ALIGN + 123), script=ops)
def test_random_alloc_free_keeps_extents_disjoint_aligned_and_accounted(capacity, script):
    a = ExtentAllocator(capacity, ALIGN)
    live = []
    for op, arg in script:
        if op == "alloc":
            start = a.alloc(arg)
            if start is None:
                assert a.largest_free < round_up(arg, ALIGN)
            else:
                live.append(start)
        elif live:
            a.free(live.pop(arg % len(live)))
        check_invariants(a)
    for start in live:
        a.free(start)
    assert a.free_extents() == ([(0, a.capacity)] if a.capacity else [])


@settings(max_examples=100, deadline=None)
@given(script=ops)
def test_rebuilding_from_used_extents_gives_the_same_free_space(script):
    a = ExtentAllocator(128 * ALIGN, ALIGN)
    live = []
    for op, arg in script:
        if op == "alloc":
            if (s := a.alloc(arg)) is not None:
                live.append(s)
        elif live:
            a.free(live.pop(arg % len(live)))
    b = ExtentAllocator.from_used(a.capacity, ALIGN, list(a.used.items()))
    assert b.free_extents() == a.free_extents() and b.used == a.used and b.free_bytes == a.free_bytes
    check_invariants(b)


def test_from_used_rejects_overlapping_or_unaligned_extents():
    import pytest
    with pytest.raises(ValueError, match="overlaps"):
        ExtentAllocator.from_used(16 * ALIGN, ALIGN, [(0, 2 * ALIGN), (ALIGN, ALIGN)])
    with pytest.raises(ValueError, match="unaligned"):
        ExtentAllocator.from_used(16 * ALIGN, ALIGN, [(100, ALIGN)])
    with pytest.raises(ValueError, match="outside"):
        ExtentAllocator.from_used(16 * ALIGN, ALIGN, [(15 * ALIGN, 2 * ALIGN)])


def test_best_fit_reuses_a_hole_of_the_exact_size():
    a = ExtentAllocator(10 * ALIGN, ALIGN)
    a.alloc(ALIGN)
    y = a.alloc(3 * ALIGN)
    a.alloc(ALIGN)
    a.free(y)
    assert a.alloc(3 * ALIGN) == y and a.alloc(1) == 5 * ALIGN


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=40), order=st.randoms(use_true_random=False),
       want=st.integers(1, 48))
def test_frees_needed_is_the_shortest_prefix_of_frees_after_which_an_extent_fits(sizes, order, want):
    a = ExtentAllocator(48 * ALIGN, ALIGN)
    starts = [s for n in sizes if (s := a.alloc(n * ALIGN)) is not None]
    order.shuffle(starts)
    for s in starts[: len(starts) // 3]:          # some holes to start with
        a.free(s)
    starts = starts[len(starts) // 3:]
    before = (dict(a.used), a.free_extents())
    n = a.frees_needed(iter(starts), want * ALIGN)
    assert (dict(a.used), a.free_extents()) == before, "frees_needed changes nothing"
    fits = [a.largest_free >= want * ALIGN]       # fits[i]: after freeing the first i starts
    for s in starts:
        a.free(s)
        fits.append(a.largest_free >= want * ALIGN)
    if n is None:
        assert not any(fits)
    else:
        assert fits[n] and not any(fits[:n])
