"""A bandwidth cap around any device: a token bucket per direction, so a device capped at b bytes/s needs at least
n/b seconds to move n bytes and concurrent requests share b. Used to emulate a network link or a slower SSD — the
restoration benchmarks set the I/O-to-compute ratio with it. Waiting is sleeping, never spinning: the CPU belongs
to compute. The pool wraps every device in one (``rate=None`` passes straight through) so caps can change live."""

from __future__ import annotations

import threading
import time

import torch

from kvflow.pool.devices.base import Device

BURST_S = 0.004   # an idle bucket lets this many seconds' worth of bytes through at once


class TokenBucket:
    """Reservations against a virtual clock: each request of n bytes books n/rate seconds after the previous one
    (an idle bucket may book up to BURST_S in the past). The caller sleeps until its booking ends."""

    def __init__(self, rate: float):
        assert rate > 0
        self.rate = float(rate)
        self._booked_until = 0.0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> float:
        """Book ``nbytes``; returns the monotonic time at which they may be considered moved."""
        with self._lock:
            start = max(self._booked_until, time.monotonic() - BURST_S)
            self._booked_until = start + nbytes / self.rate
            return self._booked_until


def _wait_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)


class Throttled:
    """Same interface as the wrapped device; ``rate`` in bytes/s or None for no cap."""

    def __init__(self, inner: Device, rate: float | None = None):
        self.inner = inner
        self.set_rate(rate)

    def set_rate(self, rate: float | None) -> None:
        self.rate = rate
        self._read = TokenBucket(rate) if rate else None
        self._write = TokenBucket(rate) if rate else None

    def read(self, offset: int, length: int) -> torch.Tensor:
        bucket = self._read
        if bucket is None:
            return self.inner.read(offset, length)
        deadline = bucket.reserve(length)
        data = self.inner.read(offset, length)
        _wait_until(deadline)
        return data

    def commit(self, offset: int, buf: torch.Tensor) -> None:
        bucket = self._write
        if bucket is None:
            return self.inner.commit(offset, buf)
        deadline = bucket.reserve(buf.numel())
        self.inner.commit(offset, buf)
        _wait_until(deadline)

    def __getattr__(self, name):   # staging, sync, close, capacity, kind, ... come from the device itself
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"Throttled({self.inner!r}, rate={self.rate})"
