"""One OpenMP team per process (kvflow/threads.py): the engine thread computes with the configured threads, every
helper thread that may touch tensors runs torch single-threaded, set-up runs on a thread that ends."""

import threading
from collections import Counter

import pytest
import torch

from kvflow.pool.write_queue import WriteQueue
from kvflow.threads import compute_threads, in_fresh_thread, single_threaded, single_threaded_run, use_compute_threads

from .helpers import client, make_app, run


def test_in_fresh_thread_returns_or_raises_on_the_caller_from_another_thread():
    caller = threading.get_ident()
    assert in_fresh_thread(lambda a, b=0: (a + b, threading.get_ident() != caller), 2, b=3) == (5, True)
    with pytest.raises(ZeroDivisionError):
        in_fresh_thread(lambda: 1 / 0)


def test_set_up_in_a_fresh_thread_computes_with_the_compute_threads_even_after_a_helper_set_one():
    seen = []
    t = threading.Thread(target=single_threaded_run(lambda: seen.append(torch.get_num_threads())))
    t.start()
    t.join()                            # a helper has set torch's count to 1 (new threads would inherit it)
    assert seen == [1]
    assert in_fresh_thread(torch.get_num_threads) == compute_threads()


@pytest.mark.skipif(compute_threads() < 2, reason="one compute thread: nothing to lose")
def test_the_computing_thread_keeps_its_count_when_a_helper_starts_before_its_first_op():
    """torch applies the last count any thread set to a thread's first op: the engine thread that set its count,
    then saw a pool reader start (which sets 1) before its first step, ran the whole server single-threaded."""
    counted, helper_done, seen = threading.Event(), threading.Event(), []

    def engine_thread():
        use_compute_threads()
        counted.set()
        helper_done.wait()
        seen.append(torch.get_num_threads())          # its first op comes after the helper's set

    def helper():
        counted.wait()
        single_threaded()
        helper_done.set()

    threads = [threading.Thread(target=engine_thread), threading.Thread(target=helper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [compute_threads()]


def test_the_pool_writer_thread_runs_torch_single_threaded():
    seen = []
    q = WriteQueue(lambda items: seen.append(torch.get_num_threads()) or len(items), 4, Counter())
    q.offer({"k": torch.zeros(4)})
    q.close()
    assert seen == [1]


def test_the_engine_loop_thread_computes_with_the_compute_threads(tiny):
    app, engine = make_app(tiny)
    seen = []
    step = engine.step

    def spy():
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return step()
    engine.step = spy

    async def go():
        async with client(app) as c:
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
            assert r.status_code == 200
    run(go())
    assert seen and set(seen) == {("kvflow-engine", compute_threads())}


def test_restorations_run_inside_the_step_by_default(tiny):
    from kvflow.engine import EngineConfig
    assert EngineConfig().async_restore is False   # a restore worker computing beside the step is a second team
