"""Generated bad input never reaches the user as a traceback: every generated pool config, command line and
environment ends in exit 0 (fsck: 1 when it found bad records) or exit 2 with one ``error:`` line — the input
was accepted or refused, nothing in between. ``KVFLOW_BAD_INPUT_CASES`` sets how many cases (``make test``: 200;
``make reliability``: 2,000)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from kvflow.config import SECTIONS, load_section
from kvflow.cost.model import default_profile_path
from kvflow.errors import ConfigError

from .bad_input import Case, cases, run_case

CASES = int(os.environ.get("KVFLOW_BAD_INPUT_CASES", "200"))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tiny):
    path = tmp_path_factory.mktemp("checkpoint") / "tiny"
    tiny.hf_model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def profile_name(tiny):
    import torch
    return default_profile_path("tiny", tiny.fingerprint, torch.get_num_threads()).name


def _check(case: Case, checkpoint, profile_name) -> None:
    with tempfile.TemporaryDirectory(prefix="kvflow-bad-input-") as root:
        outcomes = run_case(case, Path(root), checkpoint, profile_name)
    for out in outcomes:
        allowed = (0, 1, 2) if "fsck" in case.argv else (0, 2)
        assert not out.problems(allowed), (case, out.problems(allowed), out.stderr[-2000:])


@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)
@given(case=cases())
def test_generated_input_is_accepted_or_refused_with_one_line(case, checkpoint, profile_name):
    _check(case, checkpoint, profile_name)


@pytest.mark.parametrize("case", [
    Case(["pool", "init"], config={"pool": {"index_dir": "idx", "devices": [{"type": "extent", "path": "d.img",
                                                                           "capacity": "infG"}]}}),
    Case(["pool", "probe", "--size", "abc"], config={"index_dir": "idx", "probe_bytes": "1M", "devices": [
        {"type": "extent", "path": "d.img", "capacity": "2M"}]}),
    Case(["pool", "stat"], env={"KVFLOW_POOL_CHECKPOINT_INTERVAL_S": "inf"},
         config={"index_dir": "idx", "devices": [{"type": "extent", "path": "d.img", "capacity": "1M"}]}),
    Case(["pool", "init"], config={"index_dir": "afile/idx", "devices": [
        {"type": "extent", "path": "d.img", "capacity": "1M"}]}),
    Case(["pool", "init"], config={"index_dir": "idx", "devices": [
        {"type": "memory", "capacity": "1M"}, {"type": "remote", "url": "redis://127.0.0.1:1", "timeout_s": 0.2}]}),
    Case(["pool", "init"], config={"index_dir": "", "devices": [{"type": "extent", "path": "d.img", "capacity": "1M"}]}),
    Case(["pool", "init"], config={"index_dir": "idx", "devices": [{"type": "memory", "capacity": 1000}]}),
    Case(["pool", "init"], config={"index_dir": "idx", "wal_compact_bytes": -1, "devices": [
        {"type": "memory", "capacity": "1M"}]}),
    Case(["pool", "probe", "--size", "-5M"], config={"index_dir": "idx", "devices": [
        {"type": "extent", "path": "d.img", "capacity": "2M"}]}),
    Case(["profile", "tiny"], env={"KVFLOW_TORCH_THREADS": "abc"}),
    Case(["profile", "tiny"], env={"KVFLOW_TORCH_THREADS": "99999"}),
    Case(["profile", "tiny"], env={"KVFLOW_HOME": "afile/home"}),
    Case(["profile", "tiny"], env={"KVFLOW_MALLOC": "tcmalloc"}),
    Case(["profile", "tiny"], env={"KVFLOW_LINEAR": "mkl"}),
    Case(["profile", "ck-truncated"]),
    Case(["profile", "tiny", "--show"], profile={"model": "tiny", "a": "fast"}),
    Case(["demo", "restore", "--model", "tiny", "--context", "300000000"]),
], ids=["capacity-infG", "size-abc", "interval-inf", "index-under-a-file", "remote-unreachable", "index-dir-empty",
        "capacity-1000", "wal-compact-negative", "probe-size-negative", "threads-abc", "threads-99999",
        "home-under-a-file", "malloc-tcmalloc", "linear-mkl", "truncated-safetensors", "profile-wrong-type",
        "context-300M"])
def test_the_reported_cases_are_one_line_errors(case, checkpoint, profile_name):
    with tempfile.TemporaryDirectory(prefix="kvflow-bad-input-") as root:
        (out,) = run_case(case, Path(root), checkpoint, profile_name)
    assert out.rc == 2 and not out.problems(), (out.problems(), out.stderr)


MEMORY = [{"type": "memory", "capacity": "1M"}]


@pytest.mark.parametrize("case", [
    Case(["pool", "stat"], config={"pool": {"index_dir": "idx", 1: 2, "zz": 3, "devices": MEMORY}}),
    Case(["pool", "stat"], config={"index_dir": "idx", "devices": [{"type": "memory", "capacity": "1M", 5: "x",
                                                                    "zz": 1}]}),
    Case(["pool", "stat"], config={"pool": {"index_dir": "idx", None: 1, 2.5: 1, "devices": MEMORY}}),
    Case(["profile", "tiny@layers=²"]),
    Case(["profile", "tiny@"]),
    Case(["bench", "pool", "--record-kib", "0"]),
    Case(["bench", "pool", "--record-kib", "-4"]),
    Case(["demo", "restore", "--model", "tiny", "--rho", "inf"]),
    Case(["demo", "restore", "--model", "tiny", "--rho", "1e400"]),
    Case(["profile", "tiny", "--seed", "99999999999999999999"]),
    Case(["profile", "tiny", "--max-position", "99999999999999999999"]),
    Case(["bench", "restore", "--model", "tiny", "--latency", "20"]),
    Case(["bench", "restore", "--model", "tiny", "--lengths", "99999999999"]),
    Case(["bench", "pipeline", "--rho", "nan"]),
    Case(["bench", "pipeline", "--threads", "99999"]),
    Case(["bench", "serve", "--model", "tiny", "--rate", "nan"]),
    Case(["bench", "serve", "--model", "tiny", "--block-size", "0"]),
    Case(["demo", "--model", "tiny", "--think", "inf"]),
    Case(["bench", "soak", "--duration", "nan"]),
    Case(["bench", "shared", "--caps", "inf,1,1"]),
], ids=["mixed-keys-in-pool", "mixed-keys-in-a-device", "null-and-float-keys", "layers-superscript-2",
        "empty-suffix", "record-kib-0", "record-kib-negative", "rho-inf", "rho-1e400", "seed-past-int64",
        "max-position-past-the-model", "latency-20s", "lengths-past-the-model", "pipeline-rho-nan",
        "pipeline-threads-99999", "workload-rate-nan", "block-size-0", "think-inf", "soak-duration-nan",
        "shared-caps-inf"])
def test_typos_that_used_to_crash_or_pass_are_refused_before_any_work(case, checkpoint, profile_name):
    """Issue 37's tracebacks and silent acceptances, and the scan of every numeric option after it: each is one
    line and exit 2, before the command reaches its real work."""
    with tempfile.TemporaryDirectory(prefix="kvflow-bad-input-") as root:
        (out,) = run_case(case, Path(root), checkpoint, profile_name)
    assert out.rc == 2 and not out.reached and not out.problems(), (out.problems(), out.stderr)


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_an_unknown_key_among_keys_of_mixed_types_is_one_config_error_in_any_section(section):
    module, _, name = SECTIONS[section].partition(":")
    cls = getattr(importlib.import_module(module), name)
    for keys in ({1: 2, "zz": 3}, {None: 1, "zz": 1}, {2.5: 1, True: 2, "a": 3}):
        with pytest.raises(ConfigError, match="unknown key"):
            load_section(cls, section, {section: keys}, env={})


def test_a_misspelled_variable_is_warned_about(checkpoint, profile_name):
    case = Case(["pool", "stat"], env={"KVFLOW_POOL_DURABILTY": "relaxed"})
    with tempfile.TemporaryDirectory(prefix="kvflow-bad-input-") as root:
        (out,) = run_case(case, Path(root), checkpoint, profile_name)
    assert "KVFLOW_POOL_DURABILTY is not a kvflow variable" in out.stderr
    assert "did you mean KVFLOW_POOL_DURABILITY?" in out.stderr


def test_thread_count_typos_end_as_one_line_not_a_signal(tmp_path):
    """In a real process: 99999 threads crashed the OpenMP runtime (a signal cannot be caught in-process)."""
    proc = subprocess.run([sys.executable, "-m", "kvflow", "profile", "tiny", "--max-position", "256"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KVFLOW_TORCH_THREADS": "99999", "KVFLOW_HOME": str(tmp_path)})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: KVFLOW_TORCH_THREADS")
