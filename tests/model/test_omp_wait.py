"""kvflow's processes run libgomp with OMP_WAIT_POLICY=PASSIVE unless the caller chose (kvflow/threads.py); the
vLLM peer is started with its own default, not ours."""

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _policy(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env_extra | {"PYTHONPATH": SRC}
    code = "import kvflow, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_importing_kvflow_makes_idle_openmp_workers_sleep_unless_the_caller_chose():
    assert _policy({}) == "PASSIVE"
    assert _policy({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


def test_the_vllm_peer_does_not_inherit_kvflows_wait_policy(monkeypatch):
    from kvflow import threads
    from kvflow.integrations.vllm_server import _own_env
    monkeypatch.setattr(threads, "WAIT_POLICY_OURS", True)
    assert "OMP_WAIT_POLICY" not in _own_env(Path("/venv"), {"OMP_WAIT_POLICY": "PASSIVE"}, "0-1", 1)
    monkeypatch.setattr(threads, "WAIT_POLICY_OURS", False)          # the caller's own choice goes through
    assert _own_env(Path("/venv"), {"OMP_WAIT_POLICY": "ACTIVE"}, "0-1", 1)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_caller_s_own_spin_count_is_its_choice_too():
    assert _policy({"GOMP_SPINCOUNT": "10000"}) == "None"            # libgomp's default policy with that spin
