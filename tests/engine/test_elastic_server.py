"""The elastic reserve behind the server: `kvflow serve --elastic-reserve` reaches EngineConfig, /metrics reports
take-backs and blocks moved, and `kvflow bench elastic` refuses bad input with one line (exit 2)."""

import pytest

from kvflow.cli.main import main
from kvflow.server.build import build_engine
from tests.engine.helpers import ids
from tests.server.helpers import client, make_app, run


def test_build_engine_turns_the_elastic_reserve_on_only_when_asked():
    engine, _ = build_engine("tiny", {"engine": {"num_blocks": 16, "elastic_blocks": 4, "activation_reserve": 1}},
                             elastic_reserve=True)
    assert engine.elastic is not None and engine.elastic.stats.lent_blocks == 4
    plain, _ = build_engine("tiny", {"engine": {"num_blocks": 16, "activation_reserve": 1}})
    assert plain.elastic is None


def test_metrics_report_the_take_backs_and_blocks_moved(tiny):
    app, engine = make_app(tiny, kv_budget=0, num_blocks=12, block_size=4, max_num_batched_tokens=8,
                           elastic_reserve=True, elastic_blocks=6, activation_reserve=1)

    async def go():
        async with client(app) as c:
            first = await c.post("/v1/completions", json={"model": "tiny", "prompt": ids(14, 1), "max_tokens": 12,
                                                          "temperature": 0, "ignore_eos": True})
            second = await c.post("/v1/completions", json={"model": "tiny", "prompt": ids(9, 2), "max_tokens": 2,
                                                           "temperature": 0, "ignore_eos": True})
            return first, second, (await c.get("/metrics")).text
    first, second, text = run(go())
    assert first.status_code == second.status_code == 200
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln.startswith("kvflow_elastic")}
    assert lines["kvflow_elastic_reserve_blocks"] == 6
    assert lines["kvflow_elastic_lends_total"] >= 1 and lines["kvflow_elastic_takebacks_total"] >= 1
    assert lines["kvflow_elastic_takeback_failures_total"] == 0
    assert "kvflow_elastic_blocks_moved_total" in lines and "kvflow_elastic_takeback_p99_seconds" in lines


@pytest.mark.parametrize("args,message", [(["--budgets", "256,x"], "comma-separated"),
                                          (["--budgets", "0,512"], "positive"),
                                          (["--small-budget", "4096"], "below the largest"),
                                          (["--repeats", "0"], "--repeats")])
def test_bench_elastic_refuses_bad_input_with_one_line(capsys, args, message):
    assert main(["bench", "elastic", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err and "Traceback" not in err


def test_serve_has_the_elastic_flag(capsys):
    assert main(["serve", "--help"]) == 0
    assert "--elastic-reserve" in capsys.readouterr().out
