"""The command line: real commands in a subprocess; user errors are one line on stderr, exit code 2."""

import json
import os
import subprocess
import sys

import pytest


def kvflow(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "kvflow", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(proc, needle):
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0] and needle in errors[0], proc.stderr  # progress may precede
    assert "Traceback" not in proc.stderr + proc.stdout


def test_help_lists_the_commands():
    proc = kvflow("--help")
    assert proc.returncode == 0
    for cmd in ("models", "profile", "demo", "bench"):
        assert cmd in proc.stdout


def test_models_json_has_kv_bytes_per_dtype():
    proc = kvflow("models", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert {"tiny", "qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b", "mistral-7b"} <= set(rows)
    qwen = rows["qwen2.5-0.5b"]
    assert qwen["layers"] == 24 and 480e6 < qwen["parameters"] < 500e6
    assert qwen["kv_bytes_per_token"]["float32"] == 2 * 24 * 2 * 64 * 4 == 2 * qwen["kv_bytes_per_token"]["bfloat16"]


@pytest.mark.parametrize("args, needle", [
    (["profile", "no-such-model"], "unknown model"),
    (["profile", "/no/such/dir"], "no such checkpoint"),
    (["profile", "tiny@layers=99"], "layers"),
    (["profile", "tiny", "--bogus"], "--bogus"),
    (["demo", "restore", "--model", "nosuch"], "unknown model"),
    (["demo", "restore", "--rho", "-1"], "--rho"),
    (["demo", "restore", "--dtype", "int3"], "dtype"),
    (["profile", "tiny", "--dtype", "float8"], "dtype"),
    (["bench", "restore", "--rho", "a,b"], "--rho"),
    (["nosuchcommand"], "nosuchcommand"),
])
def test_bad_input_is_one_clear_line_and_exit_2(args, needle):
    assert_one_line_error(kvflow(*args), needle)


def test_profile_show_prints_the_fit_and_held_out_error(tmp_path):
    env = {"KVFLOW_HOME": str(tmp_path)}
    proc = kvflow("profile", "tiny", "--show", "--max-position", "1024", "--repeats", "1", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "held-out median rel. error" in proc.stdout and "held-out points" in proc.stdout
    saved = list((tmp_path / "profiles").glob("tiny-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["fit"]["held_out_points"]
    again = kvflow("profile", "tiny", "--show", env=env)        # shows the saved fit without re-profiling
    assert again.returncode == 0 and str(saved[0].name) in again.stdout.replace("\n", "")


def test_demo_json_restores_exactly_with_every_strategy(tmp_path):
    proc = kvflow("demo", "restore", "--model", "tiny", "--context", "1024", "--json", "--out", str(tmp_path / "demo"),
                  env={"KVFLOW_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {r["strategy"] for r in rows} == {"recompute", "load", "load-layerwise", "cake", "token", "layer",
                                              "staircase", "cacheflow"}
    for r in rows:
        assert r["ttft_s"] > 0 and r["max_abs_diff"] <= 1e-4 and r["argmax_ok"], r
    assert (tmp_path / "demo" / "timeline.png").stat().st_size > 10_000
