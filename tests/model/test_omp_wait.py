"""kvflow's processes run libgomp with kvflow's short spin count (governed by kvflow/spin.py) unless the caller chose
a policy (kvflow/threads.py); a child of a kvflow process is governed too; the vLLM peer keeps its own default."""

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")
VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KVFLOW_OMP_SPIN")


def _policy(env_extra: dict) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in VARS} | env_extra | {"PYTHONPATH": SRC}
    code = ("import kvflow, os; from kvflow import threads; "
            "print([os.environ.get(k) for k in %r] + [threads.SPIN_GOVERNED])" % (VARS,))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True, timeout=300).stdout.strip()


def test_importing_kvflow_sets_its_governed_spin_count_unless_the_caller_chose():
    from kvflow.threads import SPIN_COUNT
    assert _policy({}) == f"[None, '{SPIN_COUNT}', '{SPIN_COUNT}', True]"
    assert _policy({"OMP_WAIT_POLICY": "PASSIVE"}) == "['PASSIVE', None, None, False]"
    assert _policy({"GOMP_SPINCOUNT": "10000"}) == "[None, '10000', None, False]"


def test_a_child_of_a_kvflow_process_is_governed_too():
    from kvflow.threads import SPIN_COUNT
    inherited = {"GOMP_SPINCOUNT": "3000", "KVFLOW_OMP_SPIN": "3000"}       # an older kvflow's count: ours now
    assert _policy(inherited) == f"[None, '{SPIN_COUNT}', '{SPIN_COUNT}', True]"
    assert _policy(inherited | {"GOMP_SPINCOUNT": "50"}) == "[None, '50', '3000', False]"   # the caller's count


def test_the_vllm_peer_does_not_inherit_kvflows_wait_policy(monkeypatch):
    from kvflow import threads
    from kvflow.integrations.vllm_server import _own_env
    monkeypatch.setattr(threads, "WAIT_POLICY_OURS", True)
    env = _own_env(Path("/venv"), {"GOMP_SPINCOUNT": "3000", "KVFLOW_OMP_SPIN": "3000"}, "0-1", 1)
    assert not set(VARS) & set(env)
    monkeypatch.setattr(threads, "WAIT_POLICY_OURS", False)          # the caller's own choice goes through
    assert _own_env(Path("/venv"), {"OMP_WAIT_POLICY": "ACTIVE"}, "0-1", 1)["OMP_WAIT_POLICY"] == "ACTIVE"
