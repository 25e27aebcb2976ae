"""The executor's I/O side keeps the pool's devices busy: reads run ahead of the ones landing (a read of one layer's
records, or of an odd number of them, does not spread evenly over the devices), yet every cell is filled once,
busy time is counted once, and the dynamic meet never loses a chunk to a read issued too early."""

import threading
import time

import pytest
import torch

from kvflow import KVPool, Restorer
from kvflow.planner import STRATEGIES
from tests.restore.test_restore_exactness import assert_exact, ids, synthetic_cost


class CountingPool:
    """Delegates to a pool; each get_many takes at least ``delay`` seconds and the most calls in flight at once is
    recorded."""

    def __init__(self, pool: KVPool, delay: float = 0.01):
        self._pool, self._delay = pool, delay
        self._lock = threading.Lock()
        self.now = self.most = 0

    def __getattr__(self, name):
        return getattr(self._pool, name)

    @property
    def parallelism(self) -> int:
        return self._pool.parallelism

    def get_many(self, keys):
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(self._delay)
            return self._pool.get_many(keys)
        finally:
            with self._lock:
                self.now -= 1


def filled_cells(out, chunk):
    return sorted((i, layer) for e in out.timeline if e.kind in ("compute", "load", "fallback")
                  for i in range(e.tokens[0] // chunk, e.tokens[1] // chunk) for layer in range(*e.layers))


@pytest.mark.parametrize("strategy", ["load-layerwise", "layer", "load", "staircase"])
def test_static_reads_run_ahead_and_stay_exact(tiny, strategy):
    pool = CountingPool(KVPool.memory("64M", chunk_tokens=32, devices=2))
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
    context, query = ids(32 * 7 + 3, 1), ids(5, 2)
    restorer.store(context)
    out = restorer.restore(context, query, strategy)
    assert_exact(tiny, out, context, query)
    if sum(1 for e in out.timeline if e.kind == "load") >= 2:
        assert pool.most >= 2, "the next read must be issued before the previous one lands"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("rho", [0.3, 1.0, 4.0])
def test_every_cell_is_filled_once_and_load_time_is_counted_once(tiny, strategy, rho):
    pool = CountingPool(KVPool.memory("64M", chunk_tokens=32, devices=2), delay=0.002)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
    context, query = ids(32 * 9, 3), ids(4, 4)
    restorer.store(context)
    pool.set_throttle(rho * restorer.cost.short_context_rate(32) * 20)
    out = restorer.restore(context, query, strategy)
    assert_exact(tiny, out, context, query)
    assert filled_cells(out, 32) == [(i, layer) for i in range(9) for layer in range(tiny.num_layers)]
    loads = sorted((e for e in out.timeline if e.kind == "load"), key=lambda e: e.start)
    for before, after in zip(loads, loads[1:]):
        assert before.end <= after.start + 1e-9, "load events overlap: busy time would be counted twice"
    assert out.timings.io_busy_s <= out.timings.restore_s + 1e-6


def test_a_read_that_fails_in_flight_ends_the_restore_with_its_error(tiny):
    class Failing(CountingPool):
        calls = 0

        def get_many(self, keys):
            Failing.calls += 1
            if Failing.calls == 2:
                raise OSError("device went away")
            return super().get_many(keys)

    pool = Failing(KVPool.memory("64M", chunk_tokens=32, devices=2))
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
    context = ids(32 * 6, 5)
    restorer.store(context)
    with pytest.raises(OSError, match="went away"):
        restorer.restore(context, ids(3, 6), "load")
    assert pool.now == 0, "no read may outlive the restore"
    restorer.restore(context, ids(3, 6), "load")   # the executor is usable again
    assert torch.isfinite(restorer.restore(context, ids(3, 6), "cacheflow").logits).all()


def test_dynamic_claims_run_ahead_only_far_from_the_meet():
    from kvflow.executor import Board
    from kvflow.planner.plan import Plan

    plan = Plan("token", 10 * 32, 1, 32, 4, (0,) * 10, compute=(), loads=(), dynamic_meet=True)
    board = Board(plan)
    board.lo, board.hi = 3, 10
    assert board.claim((9, 10), reading=True, now=1.0) == "load"      # far: issue it now
    assert (board.hi, board.in_flight, board.io_started) == (9, 1, 1.0)
    board.hi = 5                                                     # two chunks left: near
    assert board.claim((4, 5), reading=True, now=2.0) is None         # wait for our read to land
    assert board.hi == 5
    assert board.claim((4, 5), reading=False, now=2.0) == "load"      # only another request's read: go
    board.lo = 5
    assert board.claim((3, 4), reading=False, now=3.0) == "skip"      # compute got there first
