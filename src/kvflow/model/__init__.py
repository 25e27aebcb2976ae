"""Model runner: a transformers causal LM executed by token range and layer range, exactly."""

from kvflow.model.presets import PRESETS, Preset
from kvflow.model.runner import KVCache, ModelRunner, PrefillResult, load_model, parse_dtype

__all__ = ["PRESETS", "Preset", "KVCache", "ModelRunner", "PrefillResult", "load_model", "parse_dtype"]
