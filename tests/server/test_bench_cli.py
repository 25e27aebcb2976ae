"""`kvflow bench decode` and `kvflow bench serve` run end to end on tiny settings and write JSON + PNG; bad options
are one error line and exit 2."""

import json

import pytest

from kvflow.cli.main import main


def test_bench_decode_reports_the_same_tokens_batched_and_alone(tmp_path, capsys):
    assert main(["bench", "decode", "--sequences", "3", "--prompt-len", "4", "--max-tokens", "4",
                 "--repeats", "1", "--out", str(tmp_path), "--json"]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["same_tokens"] is True and res["sequences"] == 3
    # the speedup is the decode rate together over the rate one at a time, of the median round (one round here)
    assert res["decode_speedup"] == pytest.approx(res["together_decode_tok_s"] / res["one_at_a_time_decode_tok_s"])
    assert res["decode_speedup_each"] == pytest.approx([res["decode_speedup"]])


def test_bench_decode_against_a_peer_reports_kvflow_over_the_peer_per_round_median_and_spread():
    from kvflow.bench.decode_peer import _row
    ours = [{"tpot_s": 0.10, "tok_s": 40.0, "ttft_s": 1.0}, {"tpot_s": 0.12, "tok_s": 30.0, "ttft_s": 2.0},
            {"tpot_s": 0.30, "tok_s": 10.0, "ttft_s": 3.0}]
    theirs = [{"tpot_s": 0.20, "tok_s": 20.0, "ttft_s": 2.0}, {"tpot_s": 0.10, "tok_s": 30.0, "ttft_s": 2.0},
              {"tpot_s": 0.15, "tok_s": 20.0, "ttft_s": 1.0}]
    row = _row(8, ours, theirs, "vllm")
    assert row["batch"] == 8 and row["kvflow_tpot_ms"] == pytest.approx(120) and row["vllm_tpot_ms"] == pytest.approx(150)
    assert row["tpot_ratio"] == pytest.approx(1.2) and row["tpot_ratio_spread"] == "0.50-2.00"   # 0.5, 1.2, 2.0
    assert row["kvflow_ttft_ms"] == pytest.approx(2000) and row["ttft_ratio"] == pytest.approx(1.0)   # 0.5, 1, 3
    assert row["ttft_ratio_spread"] == "0.50-3.00"
    assert row["tok_s_ratio"] == pytest.approx(1.0) and row["tok_s_ratio_spread"] == "0.50-2.00"  # 2, 1, 0.5


def test_bench_serve_drives_a_multi_round_chat_through_the_openai_client(tmp_path):
    assert main(["bench", "serve", "--configs", "resident", "--users", "2", "--rounds", "2", "--rate", "50",
                 "--repeats", "2",
                 "--system-tokens", "16", "--user-tokens", "8", "--answer-tokens", "3", "--think", "0",
                 "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    run = res["runs"]["resident"]
    assert run["summary"]["requests"] == 8 and run["summary"]["errors"] == 0 and len(run["rounds"]) == 2
    assert all(t["output_tokens"] == 3 for t in run["turns"])
    assert run["hit_split"]["resident"] > 0                  # the second turn reuses the first turn's blocks
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 0


def test_bench_serve_shows_each_rounds_turns_as_they_finish(tmp_path, capsys):
    assert main(["bench", "serve", "--configs", "resident", "--users", "2", "--rounds", "2", "--rate", "50",
                 "--repeats", "2", "--system-tokens", "16", "--user-tokens", "8", "--answer-tokens", "2",
                 "--think", "0", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "resident (round 1/2)" in err and "resident (round 2/2)" in err and "4/4" in err


def test_every_turn_is_counted_once_when_a_session_fails_early():
    import asyncio

    from kvflow.demo.chat import ChatWorkload, run_chat
    seen = []
    w = ChatWorkload.of("chat", users=2, rounds=3, rate=50.0, system_tokens=8, user_tokens=4, answer_tokens=2,
                        think_s=0.0)
    records, _ = asyncio.run(run_chat("http://127.0.0.1:9/v1", "tiny", w, on_turn=lambda d, t: seen.append((d, t))))
    assert seen[0] == (0, 6) and seen[-1] == (6, 6)         # nothing listens there: each session fails on its first
    assert all(r.error for r in records) and len(records) == 2


@pytest.mark.parametrize("args", [["bench", "serve", "--configs", "magic"], ["bench", "serve", "--users", "0"],
                                  ["bench", "serve", "--configs", "cacheflow+lifo"],
                                  ["bench", "serve", "--workload", "poetry"],
                                  ["bench", "serve", "--url", "http://127.0.0.1:9/v1"],
                                  ["bench", "decode", "--sequences", "1"],
                                  ["bench", "decode", "--peer", "sglang"],
                                  ["bench", "decode", "--peer", "vllm", "--batches", "0,8"],
                                  ["bench", "decode", "--peer", "vllm", "--max-tokens", "1"],
                                  ["bench", "decode", "--peer", "vllm", "--peer-venv", "/nonexistent/venv"],
                                  ["bench", "startup", "--model", "/nonexistent/checkpoint", "--no-peer"],
                                  ["bench", "startup", "--model", "tiny", "--peer-venv", "/nonexistent/venv"],
                                  ["serve", "--port", "70000"]])
def test_bad_options_are_one_line_and_exit_2(args, capsys, tmp_path):
    assert main(args + (["--out", str(tmp_path)] if args[0] == "bench" else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_bench_serve_restores_from_a_throttled_pool_on_disk(tmp_path, monkeypatch, tiny):
    from tests.engine.helpers import synthetic_cost
    monkeypatch.setattr("kvflow.cli.restore_cmds.ensure_cost", lambda runner, n: synthetic_cost(runner))
    # writes reach the pool asynchronously (never on the TTFT path): think time between turns lets them land, and
    # three rounds give every user two chances at a pool hit, so the test does not hang on a race with the write queue
    assert main(["bench", "serve", "--configs", "cacheflow", "--users", "3", "--rounds", "3", "--rate", "50",
                 "--system-tokens", "64", "--user-tokens", "8", "--answer-tokens", "2", "--think", "1",
                 "--kv-share", "0.05", "--chunk-tokens", "16", "--pool-dir", str(tmp_path / "pool"),
                 "--rho", "100", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["rho"] == 100 and res["pool"].startswith("extent")
    run = res["runs"]["cacheflow"]
    assert run["summary"]["errors"] == 0 and run["hit_split"]["pool"] > 0
    assert (tmp_path / "pool" / "serve-cacheflow" / "kv.img").exists()


def test_bench_soak_serves_every_valid_request_and_refuses_every_bad_one(tmp_path):
    assert main(["bench", "soak", "--clients", "2", "--duration", "4", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["valid"] > 0 and res["valid_errors"] == 0
    assert res["bad"] > 0 and res["bad_other"] == 0 and res["bad_4xx"] == res["bad"]
    assert res["rss_samples"]


@pytest.mark.parametrize("workload", ["docqa", "agent"])
def test_bench_serve_document_qa_and_agent_workloads_reuse_their_shared_prefixes(tmp_path, workload):
    assert main(["bench", "serve", "--workload", workload, "--configs", "resident", "--users", "2", "--rounds", "2",
                 "--rate", "20", "--docs", "2", "--doc-min", "40", "--doc-max", "60", "--system-tokens", "48",
                 "--user-tokens", "8", "--tool-tokens", "16", "--answer-tokens", "2", "--think", "0",
                 "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "results.json").read_text())["runs"]["resident"]
    assert run["summary"]["errors"] == 0 and run["summary"]["requests"] == 4
    assert run["hit_split"]["resident"] > 0


def test_the_chat_workload_defaults_to_vllms_multi_turn_shape_and_the_others_keep_theirs():
    from kvflow.demo.chat import CHAT_SHAPE, ChatWorkload
    chat = ChatWorkload.of("chat", users=8, rounds=None, think_s=None)
    assert (chat.rounds, chat.system_tokens, chat.user_tokens, chat.answer_tokens, chat.think_s) == (
        CHAT_SHAPE["rounds"], 1024, 128, 96, 2.0)
    assert ChatWorkload.of("chat", rounds=3).rounds == 3                  # a value given wins
    assert ChatWorkload.of("docqa", rounds=None).rounds == ChatWorkload().rounds


def test_a_burst_waits_for_the_servers_to_go_idle_and_gives_up_at_its_timeout(monkeypatch):
    """wait_idle on scripted CPU counters and a scripted clock: no real time is read or slept."""
    from types import SimpleNamespace

    from kvflow import stats

    clock = [0.0]                           # stats' own clock only (the time module itself is left alone)
    monkeypatch.setattr(stats, "time", SimpleNamespace(monotonic=lambda: clock[0],
                                                       sleep=lambda s: clock.__setitem__(0, clock[0] + s)))

    def windows_busy(n: int):               # the processes use a whole core for n windows, then nothing
        monkeypatch.setattr(stats, "cpu_seconds", lambda pid: min(clock[0], n * 0.25) / 2)   # two pids: half each

    for busy, waited in ((0, 0.25), (3, 1.0)):
        clock[0] = 0.0
        windows_busy(busy)
        assert stats.wait_idle([1, 2], window_s=0.25, timeout_s=10) == pytest.approx(waited)
    clock[0] = 0.0
    windows_busy(1000)                                                       # never idle: the timeout ends it
    assert stats.wait_idle([1, 2], window_s=0.25, timeout_s=2) == pytest.approx(2.0)
