"""The meet's last group (kvflow.planner.group): when the I/O side claims its remaining chunks as one group loaded
layer by layer, and what the one simulator predicts for it."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.planner import Request, predict
from kvflow.planner.group import MeetState, _meet_end, group_end, stop_point
from kvflow.planner.simulate import SimJob, simulate, simulate_plan
from tests.planner.test_planner import C, L, planner


def state(lo=10, hi=16, chunk_compute=0.1, chunk_io=0.02, query=(0.03, 0.1), **kw) -> MeetState:
    n = max(hi, 32)
    prefix = [i * chunk_compute for i in range(n + 1)]
    return MeetState(prefix, kw.pop("speed", 1.0), lo, hi, kw.pop("compute_free", 0.0), kw.pop("io_free", 0.0),
                     chunk_io, *query, kw.pop("num_layers", 4))


def test_far_from_the_end_the_meet_goes_on():
    assert stop_point(state(lo=0, hi=200, chunk_compute=0.1, chunk_io=0.1)) is None


def test_a_fast_link_stops_the_compute_side_early_so_the_query_runs_while_the_group_lands():
    """3 chunks left, loads 5x faster than recompute: the meet would end at 0.05 s and run the whole query (0.1 s)
    alone; leaving all 3 to the I/O side, loaded layer by layer, ends the query at 0.135 s — the best stop is now."""
    s = state(lo=10, hi=13, chunk_compute=0.1, chunk_io=0.02, query=(0.03, 0.1))
    assert stop_point(s) == 10
    assert group_end(s, s.hi, s.io_free, 3) == pytest.approx(0.135)


def test_the_compute_side_keeps_claiming_while_its_next_chunk_still_pays():
    """Slow loads: the I/O side could not load 12 chunks before the compute side recomputes most of them."""
    m = stop_point(state(lo=0, hi=12, chunk_compute=0.05, chunk_io=0.1, query=(0.01, 0.03)))
    assert m is None or m >= 6


def test_a_slow_link_keeps_the_cell_meet():
    assert stop_point(state(lo=10, hi=13, chunk_compute=0.1, chunk_io=0.4, query=(0.03, 0.1))) is None


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(0, 40), span=st.integers(0, 80), cc=st.floats(1e-3, 1.0), io=st.floats(1e-4, 1.0),
       q1=st.floats(1e-4, 0.5), layers=st.integers(1, 32), speed=st.floats(0.3, 3.0),
       cfree=st.floats(0, 1), iofree=st.floats(0, 1))
def test_a_stop_point_lies_in_the_unclaimed_chunks_and_beats_the_meet(lo, span, cc, io, q1, layers, speed, cfree,
                                                                     iofree):
    s = MeetState([i * cc for i in range(lo + span + 1)], speed, lo, lo + span, cfree, iofree, io, q1,
                  q1 * layers * 0.8, layers)
    m = stop_point(s)
    if m is not None:
        assert lo <= m < lo + span
        assert group_end(s, s.hi, s.io_free, s.hi - m) < _meet_end(s, s.hi, s.io_free)


@settings(max_examples=40, deadline=None)
@given(rho=st.sampled_from([0.25, 0.5, 1, 2, 4, 8]), n=st.integers(1, 64), q=st.sampled_from([8, 32, 200]))
def test_the_group_is_taken_only_where_the_simulator_finds_it_no_slower(rho, n, q):
    """The one simulator prices a pipelined meet with the executor's own decision: where no group is claimed the
    prediction is the cell meet's; where one is, the meet is no slower than the same steps without it (by more
    than one chunk's imbalance, the granularity a group gives up)."""
    p = planner(rho)
    token = p.plan("token", Request(n * C + 7, q, n))
    assert token.pipelined_query and token.chunk_compute_s and token.query_s
    flat = predict(replace(token, pipelined_query=False), p.cost, p.io)
    one_chunk = p.cost.step_time(((n - 1) * C, n * C), L) + p.io.read_time(L)
    assert token.predicted.ttft_s <= flat.ttft_s + one_chunk + 1e-9


def test_at_fast_links_the_group_hides_the_query_the_meet_runs_alone():
    for rho in (2, 4, 8):
        p = planner(rho)
        token = p.plan("token", Request(32 * C + 100, 30, 32))
        flat = predict(replace(token, pipelined_query=False), p.cost, p.io)
        query_alone = p.cost.step_time(token.suffix, L)
        assert token.predicted.ttft_s < flat.ttft_s - 0.3 * query_alone


@settings(max_examples=20, deadline=None)
@given(rho=st.sampled_from([1, 4, 8]), n=st.integers(2, 40))
def test_a_pipelined_meet_is_predicted_the_same_alone_and_as_a_batch_of_one(rho, n):
    p = planner(rho)
    token = p.plan("token", Request(n * C + 7, 8, n))
    (sim,) = simulate([SimJob(token)], [(0, s) for s in token.compute], [(0, s) for s in token.loads], [0], p.cost,
                      p.io.read_time)
    assert sim.ttft_s == pytest.approx(simulate_plan(token, p.cost, p.io.read_time).ttft_s)
    assert sim.ttft_s == pytest.approx(token.predicted.ttft_s)


def exhaustive_stop_point(s: MeetState) -> int | None:
    """Every stop priced: what stop_point's pruned search must agree with."""
    if s.hi <= s.lo or s.chunk_io_s <= 0:
        return None
    from kvflow.planner.group import MAX_GROUP, _meet_point
    if s.hi - _meet_point(s, s.hi, s.io_free) > MAX_GROUP:
        return None
    best, end = None, _meet_end(s, s.hi, s.io_free) - 1e-3 * s.query_s
    for m in range(max(s.lo, s.hi - MAX_GROUP), s.hi):
        t = group_end(s, s.hi, s.io_free, s.hi - m)
        if t < end:
            best, end = m, t
    return best


@settings(max_examples=400, deadline=None)
@given(lo=st.integers(0, 40), span=st.integers(0, 80), cc=st.floats(1e-3, 1.0), io=st.floats(1e-4, 1.0),
       q1=st.floats(1e-4, 0.5), layers=st.integers(1, 32), speed=st.floats(0.3, 3.0),
       cfree=st.floats(0, 1), iofree=st.floats(0, 1), growth=st.floats(0, 0.1))
def test_the_pruned_search_finds_the_stop_every_stop_priced_finds(lo, span, cc, io, q1, layers, speed, cfree, iofree,
                                                                  growth):
    prefix = [0.0]
    for i in range(lo + span):                  # later chunks cost more (attention), as in a real profile
        prefix.append(prefix[-1] + cc * (1 + growth * i))
    s = MeetState(prefix, speed, lo, lo + span, cfree, iofree, io, q1, q1 * layers * 0.8, layers)
    assert stop_point(s) == exhaustive_stop_point(s)
