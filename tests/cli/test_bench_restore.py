"""`kvflow bench restore` is a real command: table, JSON, PNGs; every restore it times is exact."""

import json
import os
import subprocess
import sys


def run(*args, tmp_path):
    return subprocess.run([sys.executable, "-m", "kvflow", "bench", "restore", *args, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "KVFLOW_HOME": str(tmp_path / "home")})


def test_rho_and_length_sweeps_write_json_and_pngs(tmp_path):
    proc = run("--model", "tiny", "--context", "1024", "--rho", "1,8", "--lengths", "256,1024", "--repeats", "1",
               "--json", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    points = result["rho_sweep"]
    assert [p["rho"] for p in points[:2]] == [1.0, 8.0] and points[2]["pool"].startswith("disk")
    for p in points + result["length_sweep"]:
        rows = {r["strategy"]: r for r in p["rows"]}
        assert set(rows) == {"recompute", "load", "load-layerwise", "cake", "token", "layer", "staircase",
                             "cacheflow"}
        assert all(r["max_abs_diff"] <= 1e-4 and r["argmax_ok"] and r["ttft_s"] > 0 for r in rows.values())
        assert p["speedups"]["best_other"] in rows
    acc = result["acceptance"]
    assert 0 < acc["rho1_cacheflow_vs_cake"] and acc["max_abs_diff"] <= 1e-4
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
    assert set(batch["modes"]) == {"cacheflow/batch", "cake/fcfs", "token/fcfs", "cacheflow/fcfs"}
    # the whole-batch bound is a bound: no measured schedule finishes its last request before it
    assert 0 < batch["lower_bound_s"] <= min(m["max"] for m in batch["modes"].values()) * 1.05
    assert "whole-batch T*" in proc.stdout
    assert (tmp_path / "out" / "batch.png").stat().st_size > 10_000
