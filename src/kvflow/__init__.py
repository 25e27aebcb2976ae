"""kvflow: exact, fast restoration of long-context KV caches.

    from kvflow import load_model, KVPool, Restorer
    r = Restorer(load_model("tiny"), KVPool.memory())
"""

from kvflow.errors import KVFlowError
from kvflow.model import KVCache, ModelRunner, load_model
from kvflow.pool import KVPool
from kvflow.restorer import Restorer, RestoreResult

__version__ = "0.1.0"
__all__ = ["KVFlowError", "KVCache", "ModelRunner", "load_model", "KVPool", "Restorer", "RestoreResult"]
