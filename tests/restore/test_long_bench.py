"""The long-context benchmark's measuring rules (docs/BENCHMARKS.md, long contexts): rho against each context's own
recompute, recompute run once at length, paired ratios over interleaved repeats, planners timed at 128K."""

import math

import pytest

from kvflow.bench import restore_bench as rb
from kvflow.stats import paired_ratio
from tests.engine.helpers import synthetic_cost


def test_paired_ratio_cancels_drift_shared_by_a_pair():
    drift = [1.0, 3.0, 0.5, 2.0, 1.5]                    # the machine slows and recovers between repeats
    a = [0.5 * d for d in drift]
    b = [1.0 * d * (1 + 0.01 * (-1) ** i) for i, d in enumerate(drift)]
    pr = paired_ratio(a, b)
    assert pr.pairs == 5 and pr.lo < pr.ratio < pr.hi
    assert 0.49 < pr.lo and pr.hi < 0.51 and pr.excludes_one()


def test_paired_ratio_of_one_pair_has_no_interval():
    pr = paired_ratio([2.0], [1.0])
    assert pr.ratio == pytest.approx(2.0) and math.isnan(pr.lo) and math.isnan(pr.hi) and not pr.excludes_one()


def test_rho_one_moves_a_context_in_its_own_recompute_time_and_recompute_runs_once_at_length(tiny):
    n = 512
    bench = rb.make_bench(tiny, synthetic_cost(tiny), [n], rho_basis="context", once_from=n)
    try:
        rate = bench.set_link("memory", 1.0, key=n)
        first, diff, ok = bench.first_recompute[n]
        assert rate == pytest.approx(n * tiny.kv_bytes_per_token() / first.timings.ttft_s)
        assert diff <= 1e-4 and ok
        rows = rb.measure(bench, "memory", n, ["recompute", "cacheflow", "cake"], 2, lambda s: None, "test")
        assert rows["recompute"]["runs"] == 1 and rows["recompute"]["ttft_runs"] == [first.timings.ttft_s]
        assert rows["cacheflow"]["runs"] == rows["cake"]["runs"] == 2
        assert all(r["max_abs_diff"] <= 1e-4 and r["argmax_ok"] for r in rows.values())
        assert rb.speedups(rows)["paired"]["cake"]["pairs"] == 2
        assert bench.set_link("memory", 1.0) == pytest.approx(bench.recompute_rate)     # no context: short basis
    finally:
        bench.close()


def test_every_planner_plans_a_128k_context_and_the_batch_scheduler_8_of_32k(tiny):
    out = rb.planning_at_length(tiny, synthetic_cost(tiny), [131072], repeats=1)
    (point,) = out["lengths"]
    assert point["cells"] == 512 * tiny.num_layers
    assert {r["strategy"] for r in point["rows"]} == set(rb.STRATEGIES)
    assert all(r["predicted_ttft_s"] > 0 and r["plan_s"] > 0 for r in point["rows"])
    assert out["batch"]["requests"] == 8 and out["batch"]["first_ttft_s"] > 0
