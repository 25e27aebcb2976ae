"""The workload matrix's pieces that need no server: the generators' seeded determinism and reuse structure, the
cell verdict against issue 32's goals, the plan and its bad names (`kvflow bench matrix` itself needs vLLM)."""

import json
import math

import pytest

from kvflow.bench.matrix import (QUICK, RATIO_KEYS, SHAPES, CellPlan, MatrixOptions, cell_of, cold_floor, diagnostics,
                                 estimate_s, plan, reason, verdict)
from kvflow.cli.main import main
from kvflow.demo.chat import ChatWorkload, longest_history_tokens, sessions, working_set_tokens


def _prompts(kind: str, seed: int = 0, **kw) -> list:
    return sessions(ChatWorkload.of(kind, seed=seed, **kw))


@pytest.mark.parametrize("kind", ["longfirst", "prefix", "random", "chat", "docqa", "agent"])
def test_every_workload_is_the_same_for_a_seed_and_another_for_another_seed(kind):
    assert _prompts(kind, 1) == _prompts(kind, 1)
    assert _prompts(kind, 1) != _prompts(kind, 2)


def test_longfirst_sends_one_long_first_turn_then_short_follow_ups_evenly_spaced():
    ss = _prompts("longfirst", users=4, rounds=3, first_tokens=4096, user_tokens=100, rate=2.0)
    assert [s.arrival_s for s in ss] == [0.0, 0.5, 1.0, 1.5]                    # 0.5 s apart, as the issue's
    for s in ss:
        assert s.keep_history and s.system is None                               # each follow-up extends its history
        assert len(s.turns[0][1]) >= 4095 and all(74 <= len(c) <= 125 for _, c, _ in s.turns[1:])
    assert len({s.turns[0][1] for s in ss}) == 4                                 # users share nothing


def test_prefix_repeats_a_few_shared_prefixes_each_with_its_own_suffixes():
    ss = _prompts("prefix", docs=3, rounds=4, system_tokens=300, user_tokens=40)
    assert len(ss) == 12 and not any(s.keep_history for s in ss)
    assert len({s.system for s in ss}) == 3 and all(299 <= len(s.system) <= 300 for s in ss)
    assert len({s.turns[0][1] for s in ss}) == 12                                # every suffix differs
    for prefix in {s.system for s in ss}:                                        # the first use of each is round 0
        assert sorted(s.first_round for s in ss if s.system == prefix) == [0, 1, 2, 3]
    assert [s.arrival_s for s in ss] == sorted(s.arrival_s for s in ss)


def test_random_prompts_share_no_prefix():
    ss = _prompts("random", users=20, user_tokens=64)
    texts = [s.turns[0][1] for s in ss]
    assert len(ss) == 20 and all(s.system is None and len(s.turns) == 1 for s in ss)
    assert len({t[:8] for t in texts}) == 20                                     # not even a first word in common


@pytest.mark.parametrize("kind", ["longfirst", "prefix", "random"])
def test_the_longest_sequence_bound_holds_and_fits_in_the_working_set(kind):
    w = ChatWorkload.of(kind, **SHAPES[kind].params, seed=5)
    longest = max(sum(len(c) + 16 for _, c, _ in s.turns) + len(s.system or "") for s in sessions(w))
    assert longest <= longest_history_tokens(w) <= working_set_tokens(w)


def _ratios(p99: float, mean: float, tok_s: float) -> dict:
    return {"ttft_p99_s": p99, "ttft_mean_s": mean, "output_tok_s": tok_s}


def test_a_cell_meets_its_goals_only_within_every_bound():
    assert verdict("random", "all", _ratios(1.0, 1.0, 0.9)).met
    assert verdict("chat", "all", _ratios(0.5, 0.9, 1.2)).met
    missed = verdict("chat", "all", _ratios(1.01, 0.8, 0.89))
    assert not missed.met and len(missed.misses) == 2 and "P99" in missed.misses[0]
    assert not verdict("docqa", "all", _ratios(math.nan, 0.5, 1.0)).met           # a server failed everything


def test_reused_histories_at_the_quarter_budget_need_p99_at_most_0_3x():
    assert not verdict("longfirst", "quarter", _ratios(0.31, 0.5, 1.0)).met
    assert verdict("longfirst", "quarter", _ratios(0.3, 0.5, 1.0)).met
    assert verdict("random", "quarter", _ratios(0.9, 0.9, 1.0)).met                # nothing reused: 1.0x
    assert verdict("prefix", "all", _ratios(0.9, 0.9, 1.0)).met                     # everything resident: 1.0x


def test_a_cell_over_rounds_is_met_missed_or_inside_the_noise_and_shows_its_median_and_spread():
    from types import SimpleNamespace
    from kvflow.demo.chat import TurnRecord
    side = {"cached_share": 0.5, "itl_p50_s": 0.05, "errors": 0}

    def round_(kv_first: bool, p99: float, mean: float, tok_s: float):
        ratios = {k: 1.0 for k in RATIO_KEYS} | _ratios(p99, mean, tok_s)
        kv = ([TurnRecord(0, 0, 100, 0, 4, p99)], {**side, "p99": p99}, {})
        return kv_first, kv, ([TurnRecord(0, 0, 100, 0, 4, 1.0)], side, {}), ratios

    def cell(*rounds):
        return cell_of(CellPlan("chat", "all", "light", 0.5), SimpleNamespace(kv_tokens=100, working_set_tokens=100),
                       list(rounds), 0.5)
    met = cell(round_(True, 0.9, 0.8, 1.1), round_(False, 0.95, 0.9, 1.0))
    assert met.verdict.met and met.verdict.label == "met" and met.ratio("ttft_p99_s") == "0.93 (0.90-0.95)"
    noise = cell(round_(True, 0.92, 0.8, 1.1), round_(False, 1.08, 0.9, 1.0), round_(True, 1.02, 0.9, 1.0))
    assert not noise.verdict.met and noise.verdict.noise and noise.verdict.label == "noise"
    assert noise.ratios["ttft_p99_s"] == 1.02 and noise.spread["ttft_p99_s"] == [0.92, 1.08]
    assert noise.kvflow["p99"] == 1.02                        # the median round's summaries and requests
    assert "inside the noise" in noise.why()["missed"] and "P99 TTFT 1.02x" in noise.why()["missed"]
    missed = cell(round_(True, 1.2, 0.8, 1.1), round_(False, 1.3, 0.9, 1.0))
    assert not missed.verdict.met and not missed.verdict.noise and missed.verdict.label == "MISSED"
    one = cell(round_(True, 1.05, 0.8, 1.1))
    assert one.verdict.label == "MISSED" and one.ratio("ttft_p99_s") == 1.05 and len(one.to_json()["rounds"]) == 1


def test_a_missed_cell_names_its_measured_differences():
    diag = {"kvflow_cached": 0.3, "vllm_cached": 0.6, "itl_p50_ratio": 2.0, "kvflow_itl_p50_ms": 120.0,
            "vllm_itl_p50_ms": 60.0, "restores": 3, "swaps": 0, "preemptions": 2, "kvflow_errors": 0,
            "vllm_errors": 0}
    text = reason(diag)
    assert "less reuse: cached 0.30 vs 0.60" in text and "slower steps: ITL P50 120 vs 60 ms" in text
    assert "loads 0, restores 3, swaps 0, preemptions 2" in text and "queueing" not in text
    same = reason({**diag, "kvflow_cached": 0.6, "itl_p50_ratio": 1.0, "kvflow_itl_p50_ms": 60.0})
    assert same.startswith("same reuse and step speed: queueing") and "less reuse" not in same
    slow = {"user": 5, "round": 0, "ttft_s": 4.78, "prompt_tokens": 594, "cached_tokens": 16}
    assert "slowest: a cold prompt (user 5 turn 0, 16 of 594 tokens cached) at 4.78 s" in reason(
        {**diag, "kvflow_slowest": slow})
    assert "a reused prompt" in reason({**diag, "kvflow_slowest": {**slow, "cached_tokens": 500}})


def test_the_slowest_request_is_taken_from_the_records_that_succeeded():
    from kvflow.demo.chat import TurnRecord
    side = {"cached_share": 0.5, "itl_p50_s": 0.05, "errors": 1}
    records = [TurnRecord(0, 0, 100, 0, 4, 1.5), TurnRecord(1, 0, 100, 0, 0, 9.0, error="500"),
               TurnRecord(1, 1, 120, 96, 4, 2.5)]
    diag = diagnostics(side, side, {}, records)
    assert diag["kvflow_slowest"]["user"] == 1 and diag["kvflow_slowest"]["ttft_s"] == 2.5


def test_the_cold_floor_is_the_slowest_prompt_neither_server_had_cached_at_the_faster_servers_time():
    """Reuse does not shorten a prompt both servers compute from scratch: the floor is the slowest such prompt at the
    TTFT of whichever server was faster for it, over the peer's P99; a prompt either had cached (a tenth of it or
    more) or that failed on either does not count."""
    from kvflow.demo.chat import TurnRecord
    mine = [TurnRecord(0, 0, 500, 16, 4, 0.9), TurnRecord(1, 0, 400, 0, 4, 0.5), TurnRecord(0, 1, 560, 500, 4, 3.0),
            TurnRecord(2, 0, 450, 0, 4, 9.0, error="500")]
    peer = [TurnRecord(0, 0, 500, 0, 4, 0.7), TurnRecord(1, 0, 400, 0, 4, 0.6), TurnRecord(0, 1, 560, 0, 4, 2.8),
            TurnRecord(2, 0, 450, 0, 4, 5.0)]
    floor = cold_floor(mine, peer, 2.8)
    assert (floor["user"], floor["round"]) == (0, 0) and floor["ttft_s"] == 0.7
    assert floor["ratio"] == 0.7 / 2.8
    assert "cold floor 0.25x vLLM's P99 (user 0 turn 0" in reason({
        "kvflow_cached": 0.6, "vllm_cached": 0.6, "itl_p50_ratio": 1.0, "kvflow_itl_p50_ms": 60.0,
        "vllm_itl_p50_ms": 60.0, "restores": 0, "swaps": 0, "preemptions": 0, "kvflow_errors": 0,
        "vllm_errors": 0, "cold_floor": floor})
    assert cold_floor(mine[2:3], peer[2:3], 2.8) is None and cold_floor(mine, peer, float("nan")) is None


def test_the_plan_groups_cells_by_workload_and_budget_and_quick_is_small():
    cells = plan(MatrixOptions(workloads=("longfirst", "random"), budgets=("quarter",)))
    assert [(c.workload, c.budget, c.level) for c in cells] == [
        ("longfirst", "quarter", "light"), ("longfirst", "quarter", "saturated"),
        ("random", "quarter", "light"), ("random", "quarter", "saturated")]
    quick = plan(MatrixOptions(quick=True))
    assert {c.workload for c in quick} == set(QUICK) and {c.budget for c in quick} == {"quarter"}
    assert estimate_s(MatrixOptions(quick=True), quick, 0.55) < estimate_s(MatrixOptions(), plan(MatrixOptions()),
                                                                            0.55)


@pytest.mark.parametrize("args", [["--workloads", "poetry"], ["--budgets", "half"], ["--rates", "fast"],
                                  ["--quick", "--workloads", "chat"], ["--repeats", "0"]])
def test_bad_matrix_options_are_one_line_and_exit_2(args, capsys):
    assert main(["bench", "matrix", *args]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("workload", ["longfirst", "prefix", "random"])
def test_the_new_workloads_run_through_bench_serve_end_to_end(workload, tmp_path):
    assert main(["bench", "serve", "--configs", "resident", "--workload", workload, "--users", "2", "--rounds", "2",
                 "--docs", "2", "--rate", "50", "--first-tokens", "64", "--system-tokens", "32", "--user-tokens",
                 "8", "--answer-tokens", "2", "--think", "0", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "results.json").read_text())["runs"]["resident"]["summary"]
    assert summary["errors"] == 0 and summary["requests"] == {"longfirst": 4, "prefix": 4, "random": 2}[workload]


def test_request_latency_is_send_to_last_token_and_each_cell_reports_its_ratio():
    """A stream that paused mid-answer and a request that queued before its first token both show in the request
    latency (TurnRecord.e2e_s); the summary gives its P99 and mean, the cell its ratio beside the TTFT ones."""
    from types import SimpleNamespace
    from kvflow.demo.chat import TurnRecord, summarize
    paused = TurnRecord(0, 0, 100, 0, 4, ttft_s=0.1, itl_s=[0.05, 5.0, 0.05], e2e_s=5.2)
    queued = TurnRecord(1, 0, 100, 0, 4, ttft_s=5.0, itl_s=[0.05, 0.05, 0.05], e2e_s=5.15)
    failed = TurnRecord(2, 0, 100, 0, 0, error="ReadError")
    s = summarize([paused, queued, failed], wall_s=6.0)
    assert 5.19 < s["e2e_p99_s"] <= 5.2 and math.isclose(s["e2e_mean_s"], 5.175) and s["errors"] == 1

    kv, vl = summarize([paused], 6.0), summarize([queued], 6.0)
    ratios = {k: 1.0 for k in RATIO_KEYS} | {"e2e_p99_s": 0.53}
    c = cell_of(CellPlan("docqa", "quarter", "saturated", 8.0), SimpleNamespace(kv_tokens=100, working_set_tokens=400),
                [(True, ([paused], kv, {}), ([queued], vl, {}), ratios)], 0.5)
    assert c.row()["latency P99 ÷"] == 0.53 and "e2e_p99_s" in c.to_json()["ratios"]
