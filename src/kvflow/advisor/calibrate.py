"""The formula's factor k, measured where the model runs here: the engine's measured reserve (engine/reserve.py) of
the model with ONE decoder layer (the reserve is one layer's peak, so one layer measures it; random weights, fp32,
this machine's CPU) divided by the formula for the same shape, tokens and dtype at TP 1."""

from __future__ import annotations

from kvflow.advisor.memory import activation_reserve
from kvflow.advisor.shapes import ALIASES
from kvflow.errors import ModelError
from kvflow.model.presets import PRESETS
from kvflow.model.shape import ModelShape

CALIBRATION_TOKENS = 1024     # enough tokens that per-token terms dominate; a few seconds on 2 CPU cores


def calibration_factor(model: str, shape: ModelShape, chunk: int) -> tuple[float, int, int]:
    """(k, measured bytes, tokens measured). Presets (and the ids they mirror) only: they build with random weights."""
    from kvflow.engine.reserve import measure_activation_reserve
    from kvflow.model.runner import load_model

    base = ALIASES.get(model, model).partition("@")[0]
    if base not in PRESETS:
        raise ModelError(f"--calibrate needs a preset that runs here ({', '.join(PRESETS)}), not {model!r}")
    tokens = min(chunk, CALIBRATION_TOKENS)
    runner = load_model(f"{base}@layers=1", dtype="float32")
    measured = measure_activation_reserve(runner, tokens)
    return measured / activation_reserve(shape, tokens, 1, "float32"), measured, tokens
