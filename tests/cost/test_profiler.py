"""The profiler measures a model in the dtype it computes in: ``kvflow profile --dtype`` picks the compute dtype,
and every one of them profiles on the CPU (fp32 stays the default there)."""

import pytest
import torch

from kvflow import load_model
from kvflow.cost import profiler


@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", "float16"])
def test_a_half_precision_model_profiles_on_the_cpu(dtype, monkeypatch):
    runner = load_model("tiny@layers=1", dtype=dtype)
    assert runner.dtype in (torch.bfloat16, torch.float16)
    monkeypatch.setattr(profiler, "grid", lambda max_position, layers, *grid: [(64, 0, 1), (64, 64, 1), (128, 128, 1)])
    cost = profiler.profile(runner, max_position=256, repeats=1, held_out_points=2)
    assert cost.num_layers == 1 and min(cost.a, cost.b, cost.d, cost.e) >= 0 and cost.head > 0


def test_a_chunk_continuing_its_context_keeps_the_models_dtype():
    """The prefix + diagonal split merges in fp32; what it hands the next projection is the model's dtype."""
    runner = load_model("tiny@layers=1", dtype="bfloat16")
    cache = runner.new_cache(256)
    hidden = torch.randn(1, 64, runner.hidden_size, dtype=runner.dtype) * 0.02
    runner.run_layers(cache, hidden, 0, (0, 1))
    assert runner.run_layers(cache, hidden, 64, (0, 1)).dtype == torch.bfloat16


def test_a_profile_of_a_few_layers_prices_every_layer_of_the_model(monkeypatch):
    """A step's time is linear in its layers: a grid up to 4 of tiny-deep's 16 layers fits the full-depth step."""
    runner = load_model("tiny-deep")
    step = lambda c, p, n: n * (2e-5 * c + 3e-9 * c * (p + (c + 1) / 2) + 1e-4) + 2e-3      # noqa: E731
    measured = []

    def fake(runner, cache, c, p, n, repeats):
        measured.append(n)
        return step(c, p, n)
    monkeypatch.setattr(profiler, "_time_step", fake)
    cost = profiler.profile(runner, max_position=512, repeats=1, held_out_points=3, layers=4, chunks=(64, 256),
                            fractions=(0.5, 1.0))
    assert max(measured) == 4 and cost.num_layers == 16 and cost.fit["layers_measured"] == 4
    assert cost.compute_time(256, 512, 16) == pytest.approx(step(256, 512, 16), rel=1e-6)
