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


def probe(device, offsets: list[int], executor: ThreadPoolExecutor, chunk: int = PROBE_CHUNK,
          read_passes: int = 1, min_read_s: float = 0.0) -> Bandwidth:
    """Write then read ``chunk`` bytes at each offset through all of the device's workers. Reads include the
    checksum pass every pool read makes, so ``read`` is the rate a restore can actually consume. A short untimed
    pass first starts the workers and maps the pages; with ``read_passes`` > 1 (cheap for memory, whose passes last
    milliseconds on a shared CPU) the fastest pass counts — noise only ever slows a pass down. With ``min_read_s``
    read passes repeat until that long was spent reading and the rate is bytes over time of them all (a cap that
    lets a burst through at first — a kernel blkio throttle does — is over-read by a short probe)."""
    pattern = torch.randint(0, 256, (chunk,), dtype=torch.uint8)   # not zeros: some SSDs compress

    def write(off: int) -> None:
        buf = device.staging(off, chunk)
        buf[:chunk].copy_(pattern)
        device.commit(off, buf)

    def read(off: int) -> None:
        xxhash.xxh3_64_intdigest(device.read(off, chunk).numpy())

    warm = offsets[:8]
    list(executor.map(write, warm))
    list(executor.map(read, warm))
    t0 = time.perf_counter()
    list(executor.map(write, offsets))
    device.sync()
    t_write = time.perf_counter() - t0
    best, spent, passes = float("inf"), 0.0, 0
    while passes < max(1, read_passes) or spent < min_read_s:
        t1 = time.perf_counter()
        list(executor.map(read, offsets))
        took = time.perf_counter() - t1
        best, spent, passes = min(best, took), spent + took, passes + 1
    moved = len(offsets) * chunk
    t_read = spent / passes if min_read_s > 0 else best
    return Bandwidth(read=moved / max(t_read, 1e-9), write=moved / max(t_write, 1e-9))


def effective(raw: float, cap: float | None) -> float:
    return min(raw, cap) if cap else raw


def ratios(bandwidths: list[float]) -> list[float]:
    total = sum(bandwidths)
    return [b / total if total else 0.0 for b in bandwidths]
