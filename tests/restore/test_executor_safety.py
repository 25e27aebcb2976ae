"""The executor fails loudly and leaves nothing behind: a compute-side exception stops and joins the I/O thread, a
wait that never ends is a StallError naming what stalled, and a grid cell filled twice or never is an AssertionError
before the query runs."""

import dataclasses
import threading

import pytest
import torch

from kvflow import KVPool, Restorer
from kvflow.config import unknown_env
from kvflow.errors import ConfigError, KVFlowError
from kvflow.executor import Board, Executor, ExecutorConfig, Job, StallError
from kvflow.executor.cells import Cells
from kvflow.executor.io import IOSide, Reads
from kvflow.executor.sync import Sync
from kvflow.pipeline.stage_link import StageLink
from kvflow.planner.plan import ComputeStep, LoadStep, Plan
from tests.restore.test_executor_io import CountingPool
from tests.restore.test_restore_exactness import assert_exact, ids, synthetic_cost

C = 32
pytestmark = pytest.mark.timeout(120)     # a hang is a failure, not a stuck suite


def executor_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("kvflow-io", "kvflow-fetch", "kvflow-inputs"))]


def stored(tiny, chunks: int = 6, pool=None):
    pool = pool or KVPool.memory("64M", chunk_tokens=C, devices=2)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
    context = ids(C * chunks, 11)
    restorer.store(context)
    return pool, restorer, context


class BlockingPool(CountingPool):
    """Every get_many waits for ``release`` (a device that stopped answering)."""

    def __init__(self, pool):
        super().__init__(pool, delay=0.0)
        self.release = threading.Event()

    def get_many(self, keys):
        self.release.wait(60)
        return super().get_many(keys)


# -- a compute-side exception ----------------------------------------------------------------------------------------
# nth: a call every interleaving of the two sides makes (a dynamic meet may leave every chunk to I/O on a busy
# machine, so only its first compute call — a grid step or the query — is certain)
@pytest.mark.parametrize("strategy, nth", [("layer", 1), ("staircase", 1), ("cake", 1), ("token", 1),
                                           ("load-layerwise", 2)])
def test_a_compute_side_exception_surfaces_stops_the_io_thread_and_leaves_the_pool_usable(tiny, monkeypatch,
                                                                                          strategy, nth):
    inner, _, context = stored(tiny, chunks=8)
    pool = CountingPool(inner, delay=0.005)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
    pool.set_throttle(restorer.cost.short_context_rate(C))   # rho ~ 1: plans compute and load (the query: last)
    calls = {"n": 0}
    run_layers = tiny.run_layers

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == nth:
            raise RuntimeError("kernel failed")
        return run_layers(*args, **kwargs)

    monkeypatch.setattr(tiny, "run_layers", failing)
    with pytest.raises(RuntimeError, match="kernel failed"):
        restorer.restore(context, ids(4, 12), strategy)
    assert executor_threads() == [], "the I/O thread and its fetch threads must be joined before the error surfaces"
    assert pool.now == 0, "no read may outlive the run"
    monkeypatch.setattr(tiny, "run_layers", run_layers)
    query = ids(4, 12)
    assert_exact(tiny, restorer.restore(context, query, strategy), context, query)   # the pool is still usable


def test_the_io_side_issues_no_read_once_stopped(tiny):
    pool, restorer, context = stored(tiny)
    plan, keys, _ = restorer.plan(context, 1, "load")
    jobs = [Job(plan, keys, torch.cat([context, ids(1, 3)]), tiny.new_cache(plan.context_len + 1))]
    calls = []
    counting = CountingPool(pool, delay=0.0)
    counting.get_many = lambda ks: calls.append(len(ks)) or pool.get_many(ks)
    sync = Sync(stall_s=5.0, origin=0.0)
    sync.stop.set()
    IOSide(counting, sync, jobs, [Board(plan)]).run([(0, s) for s in plan.loads])
    assert calls == [] and sync.io_done.is_set() and not sync.io_error

    sync = Sync(stall_s=5.0, origin=0.0)
    first = threading.Event()

    def stop_on_first(ks):
        sync.stop.set()            # the compute side fails while the first read is in the pool
        first.set()
        return pool.get_many(ks)

    counting.get_many = lambda ks: calls.append(len(ks)) or stop_on_first(ks)
    side = IOSide(counting, sync, jobs, [Board(plan)])
    side.run([(0, s) for s in plan.loads])
    assert first.is_set() and 1 <= len(calls) <= side.depth < len(plan.loads), \
        "only the reads issued before the stop was seen may run"
    assert executor_threads() == []


def test_reads_not_started_are_cancelled_and_a_stuck_read_is_left_on_a_daemon_thread():
    gate, started = threading.Event(), threading.Event()
    reads = Reads(lambda keys: started.set() or (gate.wait(30) and keys), depth=1)
    first, second, third = reads.submit([1]), reads.submit([2]), reads.submit([3])
    assert started.wait(30)
    left = reads.close(timeout=0.0)
    assert second.cancelled() and third.cancelled() and not first.cancelled()
    assert [t.daemon for t in left] == [True]
    gate.set()
    assert first.result(timeout=30) == [1]
    for t in left:
        t.join(30)
    assert executor_threads() == []


# -- deadlines -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["load", "cacheflow"])
def test_a_pool_read_that_never_returns_is_a_stall_error_naming_the_load_and_its_devices(tiny, strategy):
    inner, _, context = stored(tiny)
    pool = BlockingPool(inner)
    restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
    restorer.executor = Executor(tiny, pool, ExecutorConfig(stall_timeout_s=1.0))   # an unthrottled pool: plans load
    try:
        with pytest.raises(KVFlowError, match=r"load of request 0 chunks? [\d-]+ layers? [\d-]+ did not return "
                                              r"within 1 s.*pool device.*memory") as err:
            restorer.restore(context, ids(3, 4), strategy)
        assert isinstance(err.value, StallError)
    finally:
        pool.release.set()           # the stuck reads end; their daemon threads with them
    for t in threading.enumerate():
        if t.name.startswith("kvflow-fetch"):
            t.join(30)
    assert executor_threads() == []
    restorer.executor = Executor(tiny, pool)
    query = ids(3, 4)
    assert_exact(tiny, restorer.restore(context, query, strategy), context, query)


def test_a_stage_input_that_never_comes_is_a_stall_error(tiny):
    gate = threading.Event()

    class Silent(StageLink):
        def inputs(self, a, b):
            gate.wait(60)
            return None

    L, n = tiny.num_layers, 2
    plan = Plan("recompute", n * C, 1, C, L - 1, (L - 1,) * n, compute=(ComputeStep((0, n * C), (0, L - 1)),),
                loads=(), layer_offset=1)
    executor = Executor(tiny, KVPool.memory("8M", chunk_tokens=C), ExecutorConfig(stall_timeout_s=0.2))
    try:
        with pytest.raises(StallError, match="stage input .*tokens 0-64 entering model layer 1"):
            executor.run(plan, [[] for _ in range(n)], ids(n * C + 1, 5), link=Silent())
    finally:
        gate.set()
    for t in threading.enumerate():
        if t.name.startswith("kvflow-inputs"):
            t.join(30)
    assert executor_threads() == []


def test_the_stall_timeout_comes_from_the_executor_section_and_the_environment(tiny, monkeypatch):
    assert ExecutorConfig.load({"executor": {"stall_timeout_s": 7}}, env={}).stall_timeout_s == 7.0
    monkeypatch.setenv("KVFLOW_EXECUTOR_STALL_TIMEOUT_S", "0.5")
    assert Executor(tiny, None).config.stall_timeout_s == 0.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(ConfigError, match="stall_timeout_s"):
            ExecutorConfig.load(env={"KVFLOW_EXECUTOR_STALL_TIMEOUT_S": bad})
    assert unknown_env({"KVFLOW_EXECUTOR_STALL_TIMEOUT_S": "1"}) == []     # a variable kvflow reads: no warning


# -- every cell exactly once -----------------------------------------------------------------------------------------
def broken(tiny, monkeypatch, make_plan):
    """Run a hand-made plan over a stored context; returns (error, starts of every run_layers call)."""
    pool, restorer, context = stored(tiny, chunks=3)
    plan, keys, _ = restorer.plan(context, 2, "recompute")
    starts = []
    run_layers = tiny.run_layers

    def recording(cache, hidden, start, layers):
        starts.append(start)
        return run_layers(cache, hidden, start, layers)

    monkeypatch.setattr(tiny, "run_layers", recording)
    with pytest.raises(AssertionError) as err:
        Executor(tiny, pool).run(make_plan(plan), keys, torch.cat([context, ids(2, 9)]))
    assert executor_threads() == []
    return str(err.value), starts, plan


def test_a_cell_filled_twice_is_caught_before_the_query_runs(tiny, monkeypatch):
    L = tiny.num_layers

    def twice(plan):   # recompute all three chunks, and load chunk 1's top layer as well
        return dataclasses.replace(plan, loads=(LoadStep((1, 2), (L - 1, L)),))

    message, starts, plan = broken(tiny, monkeypatch, twice)
    assert f"grid cell (chunk 1, layer {L - 1}) was filled 2 times" in message
    assert all(s < plan.grid_tokens for s in starts), "the query must not run over a wrong grid"


def test_a_cell_never_filled_is_caught_before_the_query_runs(tiny, monkeypatch):
    L = tiny.num_layers

    def hole(plan):    # chunk 0 recomputed, chunk 2 loaded, chunk 1's layers 1.. by nobody
        return dataclasses.replace(plan, split=(L, 1, 0), compute=(ComputeStep((0, 2 * C), (0, 1)),
                                                                   ComputeStep((0, C), (1, L))),
                                   loads=(LoadStep((2, 3), (0, L)),))

    message, starts, plan = broken(tiny, monkeypatch, hole)
    assert "grid cell (chunk 1, layer 1) was never filled" in message
    assert all(s < plan.grid_tokens for s in starts)


def test_a_pipelined_query_checks_each_layer_before_running_it(tiny, monkeypatch):
    L = tiny.num_layers

    def hole_at_top(plan):   # load everything layer by layer, but never chunk 2's top layer
        loads = tuple(LoadStep((0, 3), (layer, layer + 1)) for layer in range(L - 1)) + (LoadStep((0, 2), (L - 1, L)),)
        return dataclasses.replace(plan, split=(0, 0, 0), compute=(), loads=loads, pipelined_query=True)

    message, starts, plan = broken(tiny, monkeypatch, hole_at_top)
    assert f"grid cell (chunk 2, layer {L - 1}) was never filled" in message
    assert starts.count(plan.grid_tokens) == L - 1, "the query ran the layers below the hole, not the one with it"


def test_a_fallback_rewrites_its_chunk_so_refilled_cells_count_once():
    cells = Cells(2, 3)
    cells.fill((0, 2), (0, 2))          # lower layers computed
    cells.fill((0, 1), (2, 3))          # chunk 0's top layer loaded; chunk 1's load missed
    with pytest.raises(AssertionError, match=r"\(chunk 1, layer 2\) was never filled"):
        cells.check()
    cells.refill_row(1)                 # the fallback recomputes chunk 1 through every layer
    cells.check()
    cells.fill((0, 1), (1, 2))
    with pytest.raises(AssertionError, match=r"\(chunk 0, layer 1\) was filled 2 times"):
        cells.check()
