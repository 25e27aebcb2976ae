"""The planner follows the machine's measured speed, not only its profile."""

import torch

from kvflow import KVPool, Restorer
from kvflow.cost import CostModel
from kvflow.cost.calibration import Calibration
from kvflow.executor import Event


def cost_model(scale=1.0) -> CostModel:
    return CostModel("m", "0" * 32, 2, a=1e-4 * scale, b=2e-8 * scale, d=1e-3 * scale, e=1e-4 * scale,
                     head=1e-3 * scale, kv_bytes_per_token_layer=1024, num_layers=4)


def test_measured_over_predicted_moves_the_scales_and_scaled_costs_follow():
    cost = cost_model()
    cal = Calibration(weight=0.5)
    predicted = cost.compute_time(256, 512, 4)
    events = [Event("compute", (512, 768), (0, 4), 0.0, 2 * predicted),
              Event("load", (768, 1024), (0, 4), 0.0, 4 * 0.05 * 3)]      # 3x slower than 0.05 s per cell
    for _ in range(12):
        cal.observe(events, cost, seconds_per_cell=0.05, chunk_tokens=256)
    assert abs(cal.compute - 2.0) < 1e-3 and abs(cal.io - 3.0) < 1e-3
    scaled = cal.scaled(cost)
    assert abs(scaled.compute_time(256, 512, 4) / (2 * predicted) - 1) < 1e-3


def test_too_little_work_on_a_side_leaves_its_scale_alone():
    cal = Calibration()
    cal.observe([Event("compute", (0, 256), (0, 1), 0.0, 0.001)], cost_model(), 0.05, 256)
    assert cal.compute == 1.0 and cal.io == 1.0


def test_a_restorer_with_a_far_too_optimistic_profile_corrects_itself(tiny):
    profile = CostModel(tiny.name, tiny.fingerprint, 2, a=1e-9, b=1e-13, d=1e-8, e=1e-8, head=1e-8,
                        kv_bytes_per_token_layer=tiny.kv_bytes_per_token() // tiny.num_layers,
                        num_layers=tiny.num_layers)
    restorer = Restorer(tiny, KVPool.memory("32M", chunk_tokens=32), cost=profile)
    ids = torch.randint(0, 1024, (600,), generator=torch.Generator().manual_seed(0))
    restorer.store(ids)
    before = restorer.planned_cost().compute_time(32, 0, tiny.num_layers)
    restorer.restore(ids, ids[:5], "recompute")
    assert restorer.calibration.compute > 10
    assert restorer.planned_cost().compute_time(32, 0, tiny.num_layers) > 10 * before
    frozen = Restorer(tiny, restorer.pool, cost=profile, calibrate=False)
    frozen.restore(ids, ids[:5], "recompute")
    assert frozen.planned_cost() is profile


def _observe(cal: Calibration, ratio: float) -> None:
    cost = cost_model()
    predicted = cost.compute_time(256, 512, 4)
    cal.observe([Event("compute", (512, 768), (0, 4), 0.0, ratio * predicted)], cost, 0.05, 256)


def test_the_band_is_the_configured_one_until_a_side_was_seen_twice():
    cal = Calibration()
    assert cal.band("compute", 0.35) == 0.35
    _observe(cal, 3.0)                  # a stale profile: the scale jumps to it, the band does not narrow yet
    assert abs(cal.compute - 3.0) < 1e-9 and cal.band("compute", 0.35) == 0.35
    assert cal.band("io", 0.15) == 0.15


def test_a_steady_machine_narrows_the_band_and_an_erratic_one_keeps_it():
    """The band follows how wrong the calibrated model was: a machine that keeps the speed it was calibrated at
    (within 1%) gets a narrow band, never below the floor; one that swings by 2x keeps the configured ceiling."""
    steady, erratic = Calibration(), Calibration()
    for k in range(12):
        _observe(steady, 3.0 * (1.01 if k % 2 else 0.99))
        _observe(erratic, 3.0 * (2.0 if k % 2 else 0.5))
    assert 0.03 <= steady.band("compute", 0.35) < 0.1
    assert erratic.band("compute", 0.35) == 0.35
    assert steady.band("compute", 0.02) == 0.02      # the configured band is the ceiling
