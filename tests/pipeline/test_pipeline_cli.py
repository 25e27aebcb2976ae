"""`kvflow bench pipeline` runs end to end (stages launched by kvflow itself, results checked exact) and refuses
bad options with one line."""

import json
import subprocess
import sys


def kvflow(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvflow", *args], capture_output=True, text=True, timeout=timeout)


def test_bench_pipeline_compares_one_and_two_stages_and_checks_every_configuration(tmp_path):
    out = kvflow("bench", "pipeline", "--stages", "1,2", "--model", "tiny", "--context", "256", "--chunk", "32",
                 "--query", "4", "--repeats", "1", "--rho", "1", "--handoff", "stage", "--json", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout)
    modes = [(p["stages"], p["mode"], p["handoff"]) for p in results["points"]]
    assert modes == [(1, "single", None), (2, "independent", None), (2, "sequential", "stage")]
    for p in results["points"]:
        assert p["max_abs_diff"] <= 1e-4 and p["argmax_ok"]
        assert p["ttft_s"] > 0 and p["lower_bound_s"] > 0 and "speedup_vs_1" in p
        assert len(p["per_stage"]) == p["stages"] and p["timeline"]
        assert p["measured_bound_s"] > 0 and p["vs_measured_bound"] == p["ttft_s"] / p["measured_bound_s"]
    # rho is defined once, from rates measured in this run: a stage's link is rho x its layers' measured rate
    rates = results["recompute_rate_bytes_per_s"]
    single = results["points"][0]
    assert single["bandwidths"] == [rates[str(results["model"]["layers"])]]
    assert results["splits"]["2"] and results["overhead"]["2"]["percent_of_kv"] > 0
    assert (tmp_path / "results.json").exists() and (tmp_path / "pipeline-timeline-rho1.png").stat().st_size > 0


def test_bad_bench_options_are_one_line_errors():
    for args, message in ((["--stages", "2"], "must include 1"), (["--stages", "1,x"], "bad --stages"),
                          (["--rho", "0"], "rho must be positive"), (["--handoff", "eager"], "bad --handoff"),
                          (["--split", "3,3", "--model", "tiny"], "split")):
        out = kvflow("bench", "pipeline", *args, timeout=120)
        assert out.returncode == 2, (args, out.stderr[-500:])
        assert out.stderr.strip().count("\n") == 0 and message in out.stderr, (args, out.stderr)
