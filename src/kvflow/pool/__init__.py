"""Unified KV pool: one logical store striped over host memory and SSDs by bandwidth, passthrough (O_DIRECT)
extents instead of per-chunk files, a Global Lookup Table that survives kill -9. See docs/POOL.md."""

from kvflow.pool.config import DeviceConfig, PoolConfig
from kvflow.pool.pool import KVPool

__all__ = ["DeviceConfig", "KVPool", "PoolConfig"]
