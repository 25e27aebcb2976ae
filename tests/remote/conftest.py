"""Fixtures of the remote-tier tests: a 3-master Redis cluster and a single Redis server on loopback, started for
the module that uses them and always torn down. Every test here skips (with the reason) without redis-server."""

import pytest

from kvflow.pool.redis_local import RedisProcs, redis_available


def _start(**kw) -> RedisProcs:
    if (why := redis_available()) is not None:
        pytest.skip(why)
    return RedisProcs(**kw).start()


@pytest.fixture(scope="module")
def cluster():
    rp = _start(masters=3, cluster=True)
    try:
        yield rp
    finally:
        rp.stop()


@pytest.fixture
def fresh_cluster():
    """A cluster of its own (the test kills or restarts nodes)."""
    rp = _start(masters=3, cluster=True)
    try:
        yield rp
    finally:
        rp.stop()


@pytest.fixture
def server():
    rp = _start(masters=1, cluster=False)
    try:
        yield rp
    finally:
        rp.stop()
