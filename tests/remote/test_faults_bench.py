"""`kvflow bench faults`, short, on loopback: under each fault every request of both engines succeeds with the
tokens of a fresh prefill, and building and closing the engines leaves no thread or cluster connection behind."""

import pytest

from kvflow.bench import faults
from kvflow.pool.redis_local import redis_available

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(redis_available() is not None, reason=str(redis_available()))]


def test_every_request_succeeds_exactly_under_each_fault_and_nothing_leaks():
    out = faults.run(faults=list(faults.FAULTS), convs=2, rounds=3, context=128, turn=16, answer=3, timeout_s=0.3,
                     slow_ms=10, model="tiny", progress=lambda s: None)
    for s, ph in zip(out["summary"], out["phases"]):
        assert s["succeeded"] == s["requests"] == 6 and s["wrong_tokens"] == 0, s
        assert ph["before"] == ph["after"] and ph["serving"]["connections"] > 0, ph["fault"]
    assert out["summary"][0]["cached_tokens"] > 0            # the fault-free rounds restored through the cluster
