"""The run-time meet guard (plans with chunk_compute_s / chunk_io_s): the compute side gives a chunk to the I/O side
when the I/O side would load it sooner — judged with the speeds measured in the run — and plans without the guard
meet exactly as before."""

from kvflow.executor import Board
from kvflow.planner.plan import Plan

C = 16


def plan(**guard) -> Plan:
    return Plan("token", 10 * C, 1, C, 4, (4,) * 10, compute=(), loads=(), dynamic_meet=True, **guard)


def board(p: Plan, hi: int, io_chunk_s: float, speed: float = 1.0) -> Board:
    b = Board(p)
    b.hi, b.io_chunk_s = hi, io_chunk_s
    b.compute_actual, b.compute_predicted = speed, 1.0
    return b


GUARDED = dict(chunk_compute_s=(0.01,) * 5 + (0.2,) * 5, chunk_io_s=0.05)


def test_a_chunk_the_io_side_would_load_sooner_is_left_to_it():
    p = plan(**GUARDED)
    # step [4, 8) with the I/O pointer at 8: chunk 7 would take compute 0.61 s, the I/O side 0.05 s ... chunk 5: 0.21
    # vs 0.15 -> only chunk 4 is worth recomputing, and that is the compute side's last step
    assert board(p, hi=8, io_chunk_s=0.05).guard(4 * C, 8 * C, 0.0) == (5 * C, True)


def test_a_compute_side_faster_than_planned_claims_more():
    p = plan(**GUARDED)
    assert board(p, hi=8, io_chunk_s=0.05, speed=0.1).guard(4 * C, 8 * C, 0.0) == (7 * C, True)
    assert board(p, hi=8, io_chunk_s=0.05, speed=0.01).guard(4 * C, 8 * C, 0.0) == (8 * C, False)


def test_the_load_in_flight_counts_before_the_io_side_reaches_a_chunk():
    p = plan(chunk_compute_s=(0.01,) * 5 + (0.08,) * 5, chunk_io_s=0.05)
    b = board(p, hi=6, io_chunk_s=0.05)
    b.in_flight = b.in_flight_chunks = 1
    b.io_started = 0.0      # chunk 6's load just began: the I/O side reaches chunk 5 at 0.05 + 0.05 > 0.09
    assert b.guard(4 * C, 6 * C, 0.0) == (6 * C, False)
    b.io_started = -0.05    # it is landing now: chunk 5 would be loaded at 0.05 < 0.09, so compute leaves it
    assert b.guard(4 * C, 6 * C, 0.0) == (5 * C, True)
    b.in_flight = b.in_flight_chunks = 2   # reads run ahead: one more chunk is queued behind the landing one -> 0.10 > 0.09
    assert b.guard(4 * C, 6 * C, 0.0) == (6 * C, False)


def test_without_guard_data_or_before_any_load_landed_the_plan_stands():
    assert board(plan(), hi=8, io_chunk_s=0.05).guard(4 * C, 8 * C, 0.0) == (8 * C, False)
    p = plan(**GUARDED)
    assert board(p, hi=8, io_chunk_s=0.0).guard(4 * C, 8 * C, 0.0) == (8 * C, False)
