"""A link in front of any device: a bandwidth cap (a token bucket per direction, so a device capped at b bytes/s
needs at least n/b seconds to move n bytes and concurrent requests share b) and a per-read latency. Used to emulate
a network link or a slower SSD — the restoration benchmarks set the I/O-to-compute ratio with it. Waiting is
sleeping, never spinning: the CPU belongs to compute. The pool wraps every device in one (``rate=None``,
``latency=0`` passes straight through) so both can change live.

A read of n bytes issued at t completes at  booking_end + latency,  booking_end = when the bucket has moved those
n bytes after everything booked before them, starting no earlier than t. So a lone read pays latency + n/b, one
reader in a loop pays it on every read, and q reads in flight at once (queue depth q) pay their latencies side by
side, not one after another — latency + q·n/b, like a real link (throughput min(b, q·n / (latency + n/b))):

    latency L, 2 reads in flight      |==r0==|--L--|              one read:   L + n/b
                                      .      |==r1==|--L--|       two:        L + 2n/b   (not 2L + 2n/b)
With a latency the bucket grants no burst (a real link has none; BURST_S is jitter slack for a bare cap).
Writes pay the bandwidth cap only.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

import torch

from kvflow.pool.devices.base import Device

BURST_S = 0.004   # an idle bucket lets this many seconds' worth of bytes through at once
MAX_LATENCY_S = 10.0

Clock = Callable[[], float]
Sleep = Callable[[float], None]


def check_latency(latency_s: float, where: str = "latency_s") -> float:
    """``latency_s`` as float if it is a finite number of seconds in [0, MAX_LATENCY_S]; else ValueError."""
    try:
        value = float(latency_s)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: must be a number of seconds, got {latency_s!r}") from None
    if not (math.isfinite(value) and 0 <= value <= MAX_LATENCY_S):
        raise ValueError(f"{where}: must be between 0 and {MAX_LATENCY_S:g} seconds, got {latency_s!r}")
    return value


class TokenBucket:
    """Reservations against a virtual clock: each request of n bytes books n/rate seconds after the previous one
    (an idle bucket may book up to BURST_S in the past). The caller sleeps until its booking ends."""

    def __init__(self, rate: float, clock: Clock = time.monotonic):
        assert rate > 0
        self.rate = float(rate)
        self.clock = clock
        self._booked_until = 0.0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, burst: bool = True) -> float:
        """Book ``nbytes``; returns the clock time at which they may be considered moved. Without ``burst`` they
        start no earlier than now."""
        with self._lock:
            start = max(self._booked_until, self.clock() - (BURST_S if burst else 0.0))
            self._booked_until = start + nbytes / self.rate
            return self._booked_until


class Throttled:
    """Same interface as the wrapped device; ``rate`` in bytes/s or None for no cap, ``latency`` seconds per read.
    ``clock`` and ``sleep`` are injectable so tests can count instead of time."""

    def __init__(self, inner: Device, rate: float | None = None, latency: float = 0.0, *,
                 clock: Clock = time.monotonic, sleep: Sleep = time.sleep):
        self.inner = inner
        self.clock, self.sleep = clock, sleep
        self.set_rate(rate)
        self.set_latency(latency)

    def set_rate(self, rate: float | None) -> None:
        self.rate = rate
        self._read = TokenBucket(rate, self.clock) if rate else None
        self._write = TokenBucket(rate, self.clock) if rate else None

    def set_latency(self, latency: float) -> None:
        self.latency = check_latency(latency)

    def _wait_until(self, deadline: float) -> None:
        delay = deadline - self.clock()
        if delay > 0:
            self.sleep(delay)

    def read(self, offset: int, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        bucket, latency = self._read, self.latency
        if bucket is None and not latency:
            return self.inner.read(offset, length, out)
        deadline = (bucket.reserve(length, burst=not latency) if bucket is not None else self.clock()) + latency
        data = self.inner.read(offset, length, out)
        self._wait_until(deadline)
        return data

    def commit(self, offset: int, buf: torch.Tensor) -> None:
        bucket = self._write
        if bucket is None:
            return self.inner.commit(offset, buf)
        deadline = bucket.reserve(buf.numel())
        self.inner.commit(offset, buf)
        self._wait_until(deadline)

    def pay(self, nbytes: int, since: float) -> None:
        """Wait as a read of ``nbytes`` begun at ``since`` would: for transfers that bypass ``read`` (keyed ones)."""
        bucket, latency = self._read, self.latency
        if bucket is None and not latency:
            return
        self._wait_until((bucket.reserve(nbytes, burst=not latency) if bucket is not None else since) + latency)

    def __getattr__(self, name):   # staging, sync, close, capacity, kind, ... come from the device itself
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"Throttled({self.inner!r}, rate={self.rate}, latency={self.latency})"
