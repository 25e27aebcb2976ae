"""`kvflow bench restore` is a real command: table, JSON, PNGs; every restore it times is exact."""

import json
import os
import statistics
import subprocess
import sys

import pytest


def run(*args, tmp_path):
    return subprocess.run([sys.executable, "-m", "kvflow", "bench", "restore", *args, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "KVFLOW_HOME": str(tmp_path / "home")})


def test_rho_and_length_sweeps_write_json_and_pngs(tmp_path):
    proc = run("--model", "tiny", "--context", "1024", "--rho", "1,8", "--lengths", "256,1024", "--repeats", "1",
               "--latency", "0.001", "--json", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    points = result["rho_sweep"]
    assert [(p["rho"], p["latency_s"]) for p in points[:3]] == [(1.0, 0.0), (8.0, 0.0), (1.0, 0.001)]
    assert points[3]["pool"].startswith("disk")
    # rho is defined once per context: the link is rho x the KV bytes/s of recomputing that context, measured in the
    # run (the short-context rate is reported beside it)
    assert result["rho_basis"] == "context" and result["recompute_rate_mib_s"] > 0
    rate = result["context_recompute_rate_mib_s"]["1024"] * 2**20
    assert points[0]["link_bytes_per_s"] == pytest.approx(rate) and points[1]["link_bytes_per_s"] == pytest.approx(8 * rate)
    for p in points + result["length_sweep"]:
        rows = {r["strategy"]: r for r in p["rows"]}
        assert set(rows) == {"recompute", "load", "load-layerwise", "cake", "token", "layer", "staircase",
                             "cacheflow"}
        assert all(r["max_abs_diff"] <= 1e-4 and r["argmax_ok"] and r["ttft_s"] > 0 for r in rows.values())
        # cacheflow against the fastest other strategy of the point, and the ratio is of those two medians
        others = {s: r["ttft_s"] for s, r in rows.items() if s != "cacheflow"}
        assert p["speedups"]["best_other"] == min(others, key=others.get)
        assert p["speedups"]["cacheflow_vs_best_other"] == pytest.approx(
            rows["cacheflow"]["ttft_s"] / others[p["speedups"]["best_other"]])
        # how far the point resolves a difference is reported beside the ratio: the median over strategies of
        # max / min of one strategy's repeats (one repeat: 1; the disk point always repeats at least 7 times)
        spreads = [max(r["ttft_runs"]) / min(r["ttft_runs"]) for r in rows.values()]
        assert p["speedups"]["repeat_spread"] == pytest.approx(statistics.median(spreads))
        assert p["speedups"]["same_plan_as_best"] == (rows["cacheflow"]["chose"] == p["speedups"]["best_other"])
        # one measured bound per point, the same for every strategy, reported beside the model's
        assert len({r["measured_bound_s"] for r in rows.values()}) == 1
        assert all(r["vs_measured_bound"] == pytest.approx(r["ttft_s"] / r["measured_bound_s"]) for r in rows.values())
        assert all(r["model_bound_s"] > 0 for r in rows.values())
        # every repeat's plan is recorded (cacheflow's choice may change between repeats), the median's among them
        assert all(len(r["plan_runs"]) == len(r["ttft_runs"]) and r["plan"] in r["plan_runs"] for r in rows.values())
    acc = result["acceptance"]                # the headline figures are the rho = 1 point's own ratios
    assert acc["headline_rho"] == 1.0 and acc["max_abs_diff"] <= 1e-4
    rho1 = {r["strategy"]: r for r in points[0]["rows"]}
    assert acc["rho1_cacheflow_vs_cake"] == pytest.approx(rho1["cacheflow"]["ttft_s"] / rho1["cake"]["ttft_s"])
    assert acc["rho1_cacheflow_vs_measured_bound"] == rho1["cacheflow"]["vs_measured_bound"]
    for png in ("rho-sweep.png", "length-sweep.png", "timeline.png"):
        assert (tmp_path / "out" / png).stat().st_size > 10_000
    assert json.loads((tmp_path / "out" / "restore.json").read_text())["model"] == "tiny"


def test_batch_mode_compares_schedulers(tmp_path):
    proc = run("--model", "tiny", "--batch", "3", "--repeats", "1", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "batch-aware / FCFS cake" in proc.stdout
    result = json.loads((tmp_path / "out" / "restore-batch.json").read_text())
    (batch,) = result["batches"]
    assert len(batch["lengths"]) == 3 and batch["max_abs_diff"] <= 1e-4
    assert set(batch["modes"]) == {"cacheflow/batch", "cacheflow/sjf", "cacheflow/fcfs", "cake/fcfs"}
    assert all(set(m) == {"mean", "p50", "p90", "p99", "max"} for m in batch["modes"].values())
    assert batch["measured_bound_s"] > 0 and batch["model_bound_s"] > 0 and set(batch["batch_vs_sjf"]) >= {"mean"}
    assert "P99 of a batch of 8 or fewer is its maximum" in proc.stdout
    assert "measured whole-batch bound" in proc.stdout
    assert (tmp_path / "out" / "batch.png").stat().st_size > 10_000
