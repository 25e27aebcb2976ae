"""What a pipeline needs around the stages: a pool other processes can read, each stage's link bandwidth, and
what storing boundary activations costs."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from kvflow.chunks.record import HEADER_SIZE
from kvflow.pool.config import PoolConfig


@contextmanager
def shared_pool(capacity: int | str = "1G", *, devices: int = 1, chunk_tokens: int = 256,
                storage_dtype: str = "float32", root: str | os.PathLike | None = None):
    """A PoolConfig of ``devices`` memory devices backed by files in /dev/shm (shared memory: every stage process
    maps the same records) with its index in a temporary folder; everything is removed on exit."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    tag = f"kvflow-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    index = Path(root) / tag if root is not None else Path(tempfile.mkdtemp(prefix=tag))
    paths = [shm / f"{tag}-dev{i}" for i in range(devices)]
    cfg = PoolConfig.load({"devices": [{"type": "memory", "path": str(p), "capacity": capacity} for p in paths],
                           "chunk_tokens": chunk_tokens, "storage_dtype": storage_dtype, "index_dir": str(index)})
    try:
        yield cfg
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
        shutil.rmtree(index, ignore_errors=True)


def link_bandwidths(rate: Callable[[int], float], stages: list[tuple[int, int]],
                    rho: float | None) -> list[float] | None:
    """Each stage's own link: rho x ``rate(n)``, the KV bytes/s that n layers recompute at short context (the
    benchmark measures it; one stage = the whole model, so the 1-stage baseline's link follows the same rule).
    None (unthrottled) when rho is None."""
    if rho is None:
        return None
    return [rho * rate(b - a) for a, b in stages]


def boundary_overhead(runner, boundaries: list[int], chunk_tokens: int, storage_dtype: str = "float32") -> dict:
    """Bytes per token the boundary activations add (fp32, headers amortised) and their share of the KV."""
    act = len(boundaries) * (runner.hidden_size * 4 + HEADER_SIZE / chunk_tokens)
    kv = runner.shape.kv_bytes_per_token(storage_dtype) + runner.num_layers * HEADER_SIZE / chunk_tokens
    return {"boundaries": list(boundaries), "act_bytes_per_token": act, "kv_bytes_per_token": kv,
            "percent_of_kv": 100.0 * act / kv}
