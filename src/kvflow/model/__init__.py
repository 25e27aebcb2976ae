"""Model runner: a transformers causal LM executed by token range and layer range, exactly."""

from kvflow.model.presets import PRESETS, Preset
from kvflow.model.device import resolve as resolve_device
from kvflow.model.device import set_default_device
from kvflow.model.dtypes import parse_dtype
from kvflow.model.runner import KVCache, ModelRunner, PrefillResult, load_model
from kvflow.model.shape import ModelShape

__all__ = ["PRESETS", "Preset", "KVCache", "ModelRunner", "PrefillResult", "load_model", "parse_dtype", "ModelShape",
           "resolve_device", "set_default_device"]
