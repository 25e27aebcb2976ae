"""The test cluster itself: three masters answering on loopback, every hash slot served, and nothing left behind."""

import os

from kvflow.pool.redis_local import RedisProcs, redis_available
import pytest


@pytest.mark.skipif(redis_available() is not None, reason=str(redis_available()))
def test_a_cluster_serves_every_slot_and_leaves_no_process_or_directory_behind():
    rp = RedisProcs(masters=3).start()
    pids, folder = [p.pid for p in rp.procs.values()], rp.dir
    try:
        info = rp._cli("cluster", "info", port=rp.ports[0]).stdout
        assert "cluster_state:ok" in info and "cluster_slots_assigned:16384" in info and "cluster_size:3" in info
    finally:
        rp.stop()
    assert not os.path.exists(folder)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
