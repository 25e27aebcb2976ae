"""One rule for "the cost profile for this model": the saved profile is used while its grid reached half the
positions asked; beyond that, or with no file, the model is profiled now (with the threads asked) and saved."""

from types import SimpleNamespace

import pytest
import torch

from kvflow.cost import CostModel, cost_profile, saved_profile
from kvflow.cost import profiler

RUNNER = SimpleNamespace(name="tiny", fingerprint="ab" * 16, device=torch.device("cpu"), num_layers=4)


def fitted(max_position: int, threads: int) -> CostModel:
    return CostModel("tiny", RUNNER.fingerprint, threads, 1e-4, 3e-8, 4e-3, 5e-4, 0.02, 512, 4,
                     fit={"max_position": max_position, "held_out_median_rel_error": 0.01,
                          "train_points": 18, "layers_measured": 4, "seconds": 1.0})


@pytest.fixture
def profiled(monkeypatch, tmp_path):
    monkeypatch.setenv("KVFLOW_HOME", str(tmp_path))
    runs = []

    def fake(runner, *, max_position, repeats, progress=None, **grid):
        runs.append((max_position, torch.get_num_threads()))
        return fitted(max_position, torch.get_num_threads())
    monkeypatch.setattr(profiler, "profile", fake)
    return runs


def test_a_profile_is_measured_once_and_then_read_back(profiled):
    assert saved_profile(RUNNER, 4096) is None
    first = cost_profile(RUNNER, 4096)
    assert cost_profile(RUNNER, 4096) == first and len(profiled) == 1


def test_a_saved_profile_serves_up_to_twice_its_grid_and_is_measured_again_beyond(profiled):
    cost_profile(RUNNER, 4096)
    assert saved_profile(RUNNER, 8192).fit["max_position"] == 4096          # half the positions asked: still fits
    assert saved_profile(RUNNER, 8194) is None
    assert cost_profile(RUNNER, 16384).fit["max_position"] == 16384
    assert [p for p, _ in profiled] == [4096, 16384]


def test_a_profile_for_other_threads_is_its_own_and_leaves_the_callers_threads(profiled):
    before = torch.get_num_threads()
    cost_profile(RUNNER, 1024, threads=1)
    assert torch.get_num_threads() == before and profiled == [(1024, 1)]
    assert saved_profile(RUNNER, 1024, threads=1) is not None
    if before != 1:
        assert saved_profile(RUNNER, 1024) is None
