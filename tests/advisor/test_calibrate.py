"""Calibration: the formula's factor k is the engine's measured reserve over the formula, on a one-layer model."""

import pytest

from kvflow.advisor import advise, load_shape
from kvflow.advisor.calibrate import calibration_factor
from kvflow.errors import ModelError


def test_calibration_measures_a_positive_factor_and_scales_the_reserve():
    k, measured, tokens = calibration_factor("tiny", load_shape("tiny"), 256)
    assert tokens == 256 and measured > 0 and k > 0
    assert advise("tiny", 24, chunk=256, factor=k).reserve == int(k * advise("tiny", 24, chunk=256).reserve)


def test_calibration_needs_a_model_that_runs_here():
    with pytest.raises(ModelError, match="--calibrate needs a preset"):
        calibration_factor("llama-3.1-70b", load_shape("llama-3.1-70b"), 2048)
