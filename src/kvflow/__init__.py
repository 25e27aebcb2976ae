"""kvflow: exact, fast restoration of long-context KV caches."""

from kvflow.errors import KVFlowError
from kvflow.model import KVCache, ModelRunner, load_model

__version__ = "0.1.0"
__all__ = ["KVFlowError", "KVCache", "ModelRunner", "load_model"]
