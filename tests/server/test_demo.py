"""`make demo`'s job (`kvflow demo`, on tiny: the real model's run takes minutes) and `kvflow bench second-turn` at
tiny sizes, and the embedded defaults that `kvflow serve` shares with the demo (a pool under ./.kvflow/)."""

import json

import pytest

from kvflow.cli.main import main
from tests.engine.helpers import synthetic_cost

TINY_CHAT = ["--model", "tiny", "--text", "random", "--users", "2", "--rounds", "3", "--rate", "50", "--system-tokens", "96", "--user-tokens", "8",
             "--answer-tokens", "3", "--think", "0.2", "--kv-share", "0.05", "--repeats", "1"]


@pytest.fixture
def no_profiling(monkeypatch):
    monkeypatch.setattr("kvflow.cli.restore_cmds.ensure_cost", lambda runner, n: synthetic_cost(runner))


def test_the_demo_job_prints_the_ttft_table_writes_json_and_png_and_its_tokens_are_exact(
        tmp_path, monkeypatch, capsys, no_profiling):
    monkeypatch.chdir(tmp_path)                          # the defaults: pools under ./.kvflow/, results under runs/
    assert main(["demo", *TINY_CHAT]) == 0
    printed = capsys.readouterr().out
    for needle in ("recompute", "cacheflow", "ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "resident", "pool",
                   "miss", "equal to transformers' greedy generate"):
        assert needle in printed, needle
    (folder,) = (tmp_path / "runs").glob("demo-*")
    res = json.loads((folder / "demo.json").read_text())
    assert set(res["runs"]) == {"recompute", "cacheflow"}
    for run in res["runs"].values():
        assert run["summary"]["requests"] == 6 and run["summary"]["errors"] == 0
        assert all(t["output_tokens"] == 3 for t in run["turns"])
        split = run["hit_split"]
        assert split["resident"] + split["pool"] + split["miss"] == pytest.approx(1.0)
    assert res["kv_budget_tokens"] < res["working_set_tokens"] or res["kv_share"] < 1
    assert res["exact"]["all_equal"] and len(res["exact"]["turns"]) == 3
    assert (folder / "ttft_cdf.png").stat().st_size > 0
    assert (tmp_path / ".kvflow" / "demo").is_dir() and not list((tmp_path / ".kvflow" / "demo").iterdir())


def test_the_demo_on_written_text_shows_a_readable_exchange_and_its_served_tokens_are_exact(
        tmp_path, monkeypatch, capsys, no_profiling):
    from kvflow.demo import texts
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--model", "tiny", "--users", "2", "--rounds", "2", "--rate", "50", "--answer-tokens", "4",
                 "--think", "0.1", "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    last_question = texts.questions(0, 2)[-1]
    assert "question:" in printed and "answer:" in printed and last_question[:40] in printed
    (folder,) = (tmp_path / "runs").glob("demo-*")
    res = json.loads((folder / "demo.json").read_text())
    assert res["workload"]["text"] == "written" and res["exchange"]["question"] == last_question
    assert res["exact"]["all_equal"] and all(t["same_prompt"] and t["served_in_run_equal"]
                                             for t in res["exact"]["turns"])
    assert all(run["summary"]["errors"] == 0 for run in res["runs"].values())


def test_written_conversations_give_every_user_a_history_of_its_own_and_keep_the_workloads_shape():
    from kvflow.demo import texts
    from kvflow.demo.chat import ChatWorkload, sessions
    from kvflow.errors import KVFlowError

    w = ChatWorkload(users=len(texts.CONVERSATIONS) + 2, rounds=6, text="written", seed=3)
    got = sessions(w)
    assert len({s.system for s in got}) == len(got)               # no two users share a prefix
    for u, s in enumerate(got):
        asked = texts.conversation(u, 3).questions
        assert [t[1] for t in s.turns] == list(asked) + list(texts.FOLLOW_UPS[:6 - len(asked)])
        assert texts.conversation(u, 3).document in s.system
    random_text = sessions(ChatWorkload(users=w.users, rounds=6, seed=3))
    assert [s.arrival_s for s in got] == [s.arrival_s for s in random_text]   # the same Poisson arrivals
    assert sessions(w) == got and sessions(ChatWorkload(users=w.users, rounds=6, text="written", seed=4)) != got
    assert w.ignore_eos is False and ChatWorkload().ignore_eos is True
    with pytest.raises(KVFlowError):
        ChatWorkload("docqa", text="written").validate()


@pytest.mark.parametrize("args", [["demo", "--users", "0"], ["demo", "--kv-share", "9"], ["demo", "--repeats", "0"],
                                  ["demo", "--model", "nosuch"], ["demo", "--text", "poems"], ["bench", "second-turn", "--rho", "0"],
                                  ["bench", "second-turn", "--history", "10"],
                                  ["bench", "second-turn", "--model", "nosuch"]])
def test_bad_demo_and_second_turn_options_are_one_line_and_exit_2(args, tmp_path, capsys, no_profiling):
    assert main(args + ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("error:") and "Traceback" not in "\n".join(err)


def test_second_turn_restores_the_evicted_history_from_the_pool_with_both_strategies(tmp_path, no_profiling):
    assert main(["bench", "second-turn", "--history", "192", "--user-tokens", "8", "--answer-tokens", "2",
                 "--repeats", "2", "--pool-dir", str(tmp_path / "pools"), "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "second_turn.json").read_text())
    assert res["pool"].startswith("extent") and not list((tmp_path / "pools").iterdir())
    assert res["rho"] == 1 and res["link_bytes_per_s"] == pytest.approx(res["recompute_rate_bytes_per_s"])
    assert res["evicted_history_tokens"] >= 192
    for name in ("recompute", "cacheflow"):
        row = res["rows"][name]
        assert len(row["ttft_runs"]) == 2 and row["ttft_s"] > 0 and row["exact"]
        assert row["resident_hit_tokens"] == 0 and row["pool_hit_tokens"] >= 192   # all of it came from the pool
        assert all(r["restores"] >= 1 for r in res["runs"][name])
    cf, rc = res["rows"]["cacheflow"], res["rows"]["recompute"]      # the ratio of the medians, and of each repeat
    assert res["cacheflow_vs_recompute"] == pytest.approx(cf["ttft_s"] / rc["ttft_s"])
    assert res["cacheflow_vs_recompute_each_repeat"] == pytest.approx(
        [c / r for c, r in zip(cf["ttft_runs"], rc["ttft_runs"])])
    assert (tmp_path / "second_turn.png").stat().st_size > 0


def test_kvflow_serve_without_a_config_sizes_its_kv_and_keeps_a_pool_under_dot_kvflow(tmp_path, monkeypatch):
    import inspect

    import uvicorn

    import kvflow.model.runner
    from kvflow.cli.serve_cmds import serve as serve_cmd
    from kvflow.model import catalog
    from kvflow.server import build

    assert inspect.signature(build.serve).parameters["model"].default == build.DEFAULT_MODEL == catalog.DEFAULT
    assert inspect.signature(serve_cmd).parameters["model"].default.default == catalog.DEFAULT   # bare kvflow serve
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kvflow.model.runner, "free_memory", lambda device: 2 * 2**30)     # auto KV: a share of 2 GiB
    built, served = [], []
    real = build.build_engine
    monkeypatch.setattr(build, "build_engine", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(kw))
    build.serve("tiny")                     # the embedded defaults on the small preset (the real model: bench startup)
    engine, _ = built[0]
    try:
        assert engine.runner.name == "tiny" and served[0]["port"] == 8000
        assert engine.kv_sizing is not None and engine.kv_sizing.available == 2 * 2**30
        assert engine.pool is not None and engine.pool.chunk_tokens == build.DEFAULT_CHUNK_TOKENS
        assert (tmp_path / ".kvflow" / "pool" / "kv.img").is_file()
        assert (tmp_path / ".kvflow" / "pool" / "index").is_dir()
    finally:
        engine.close()
        engine.pool.pool.close()
