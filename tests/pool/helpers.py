"""Tiny models of what the restorer stores: chunk keys of a random context and a tensor determined by its key."""

from __future__ import annotations

import os
import random

import torch

from kvflow.chunks.keys import ChunkKey, chunk_keys
from kvflow.pool.devices import odirect_supported  # noqa: F401  (the device tests import it from here)

FP = "0123456789abcdef" * 2


def context_keys(n_chunks: int, groups=((0, 1),), seed: int = 0, chunk_tokens: int = 16) -> list[ChunkKey]:
    """Keys of one context, chunk-major (chunk 0 group 0, chunk 0 group 1, ...), as the restorer stores them."""
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(n_chunks * chunk_tokens)]
    return [k for row in chunk_keys(tokens, FP, chunk_tokens, list(groups)) for k in row]


def tensor_for(key: ChunkKey, numel: int = 512) -> torch.Tensor:
    """The record content of ``key``: a reproducible function of its digest, so any process can check it."""
    g = torch.Generator().manual_seed(int.from_bytes(key.digest[:8], "little") & (2**63 - 1))
    return torch.randn(2, numel // 2, generator=g)


def device_cfg(tmp_path, kind: str, capacity: int = 8 << 20, **extra) -> dict:
    """A device entry of each type under tmp_path (memory devices get a shared file so they persist)."""
    if kind == "memory":
        return {"type": "memory", "path": str(tmp_path / "mem0"), "capacity": capacity, **extra}
    if kind == "extent":
        return {"type": "extent", "path": str(tmp_path / "disk.img"), "capacity": capacity,
                "direct": odirect_supported(tmp_path), **extra}
    return {"type": "files", "path": str(tmp_path / "files"), "capacity": capacity, **extra}


def flip_byte(path, pos: int, mask: int = 0x40, sync: bool = False) -> None:
    """Damage one byte of a file in place (XOR ``mask``), fsynced with ``sync`` (a device read with O_DIRECT)."""
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))
        if sync:
            os.fsync(f.fileno())


def fill(cfg, n: int = 8, seed: int = 0) -> list[ChunkKey]:
    """``n`` records put into the pool of config ``cfg`` (opened and closed); their keys."""
    from kvflow.pool import KVPool
    keys = context_keys(n, seed=seed)
    with KVPool.open(cfg) as pool:
        assert pool.put_many({k: tensor_for(k) for k in keys}) == n
    return keys


def served(cfg, keys) -> int:
    """How many of ``keys`` the pool of ``cfg`` serves — never a wrong record."""
    from kvflow.pool import KVPool
    with KVPool.open(cfg) as pool:
        got = pool.get_many(keys)
    assert all(v is None or torch.equal(v, tensor_for(k)) for k, v in got.items()), "never a wrong record"
    return sum(v is not None for v in got.values())
