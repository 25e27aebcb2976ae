"""The pool organizer: each device's read/write bandwidth b_i (probed, recorded in the manifest, or given in the
config), throttles applied, and the placement ratios p_i = b_i / sum(b) the striper uses."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

PROBE_CHUNK = 1 << 20


@dataclass(slots=True)
class Bandwidth:
    read: float    # bytes/s
    write: float


def probe(device, offsets: list[int], executor: ThreadPoolExecutor, chunk: int = PROBE_CHUNK) -> Bandwidth:
    """Write then read ``chunk`` bytes at each offset through all of the device's workers. Reads include the
    checksum pass every pool read makes, so ``read`` is the rate a restore can actually consume."""
    pattern = torch.randint(0, 256, (chunk,), dtype=torch.uint8)   # not zeros: some SSDs compress

    def write(off: int) -> None:
        buf = device.staging(off, chunk)
        buf[:chunk].copy_(pattern)
        device.commit(off, buf)

    def read(off: int) -> None:
        xxhash.xxh3_64_intdigest(device.read(off, chunk).numpy())

    t0 = time.perf_counter()
    list(executor.map(write, offsets))
    device.sync()
    t1 = time.perf_counter()
    list(executor.map(read, offsets))
    t2 = time.perf_counter()
    moved = len(offsets) * chunk
    return Bandwidth(read=moved / max(t2 - t1, 1e-9), write=moved / max(t1 - t0, 1e-9))


def effective(raw: float, cap: float | None) -> float:
    return min(raw, cap) if cap else raw


def ratios(bandwidths: list[float]) -> list[float]:
    total = sum(bandwidths)
    return [b / total if total else 0.0 for b in bandwidths]
