"""kvflow: exact, fast restoration of long-context KV caches.

    from kvflow import load_model, KVPool, Restorer
    r = Restorer(load_model("tiny"), KVPool.memory())
"""

from kvflow.threads import our_omp_wait

our_omp_wait()                     # before torch loads libgomp (kvflow/threads.py, kvflow/spin.py)

from kvflow.errors import KVFlowError  # noqa: E402
from kvflow.model import KVCache, ModelRunner, load_model  # noqa: E402
from kvflow.pool import KVPool  # noqa: E402
from kvflow.restorer import Restorer, RestoreResult  # noqa: E402

__version__ = "0.1.0"
__all__ = ["KVFlowError", "KVCache", "ModelRunner", "load_model", "KVPool", "Restorer", "RestoreResult"]
