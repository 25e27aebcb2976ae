"""The short kill -9 campaign of ``make test`` (the full one: ``make reliability``): writers killed at random
moments, four in a row per pool, in both durability modes. No acknowledged put is lost (kill -9 keeps the page
cache, so relaxed keeps them too), no wrong record is served, fsck is clean after every recovery."""

import pytest

from .campaign import kill_trials, passed


@pytest.mark.slow
@pytest.mark.parametrize("durability", ["strict", "relaxed"])
def test_kill9_loses_no_acknowledged_put_and_serves_nothing_wrong(tmp_path, durability):
    trials = kill_trials(tmp_path, durability, trials=12, seed=11)
    failed = [t for t in trials if not passed(t)]
    assert not failed, failed
    assert sum(t.acked for t in trials) > 0
