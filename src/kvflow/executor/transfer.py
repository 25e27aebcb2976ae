"""The executor's transfer side: where pool records cross from the host to the model's device and back, and how the
device's work is timed. The one place in the executor that knows a device (DESIGN.md §4).

    host (CPU)   reads land in reused page-aligned staging buffers; ``land`` copies each record into the cache on
                 the I/O thread (the dtype cast included) and hands its buffer back; times are the host clock
    CUDA         the staging buffers are pinned; ``land`` queues the host-to-device copies on the transfer's own
                 stream, records an event after them and waits for that event on the I/O thread only — so the
                 copy of load k overlaps the compute stream's kernels, and a load is marked landed (the board's
                 cells filled) only once its bytes are on the device. Compute spans are timed with CUDA events
                 mapped onto the run's clock (one reference event at the start of the run), so busy time means
                 device busy time, not host launch time

Staging buffers are pooled by size (records of one pool are mostly one size) and reused, never pinned per read:
pinning is a page-locking system call as slow as the copy it helps. Free buffers beyond ``keep_bytes`` are released
(an engine held to its memory budget keeps none: ``keep_bytes = 0``, engine.py). ``allocated`` counts every buffer
ever made and ``peak`` the most out at once: with one record size they are equal — a buffer is made only when every
one is out (the tests pin it over repeated restores).
"""

from __future__ import annotations

import bisect
import threading

import torch

from kvflow.pool.devices.base import aligned_empty, padded

KEEP_BYTES = 512 << 20      # free staging bytes kept for reuse at most (beyond: released)


class Staging:
    """Reused page-aligned host buffers (pinned when ``pinned``): ``take(n)`` one of at least n bytes, ``give(t)``
    back the buffer that holds tensor ``t`` (a view of it: a decoded record); unknown tensors are ignored."""

    def __init__(self, pinned: bool = False, keep_bytes: int = KEEP_BYTES):
        self.pinned, self.keep_bytes = pinned, keep_bytes
        self.lock = threading.Lock()
        self.free: dict[int, list[torch.Tensor]] = {}
        self.free_bytes = 0
        self.out: dict[int, torch.Tensor] = {}        # data_ptr -> buffer handed out
        self.out_ptrs: list[int] = []                 # sorted keys of ``out``
        self.allocated = 0                            # buffers ever made
        self.peak = 0                                 # most buffers out at once

    def take(self, nbytes: int) -> torch.Tensor:
        size = padded(nbytes)
        with self.lock:
            spare = self.free.get(size)
            if spare:
                buf = spare.pop()
                self.free_bytes -= size
            else:
                buf = self._new(size)
            ptr = buf.data_ptr()
            self.out[ptr] = buf
            bisect.insort(self.out_ptrs, ptr)
            self.peak = max(self.peak, len(self.out))
        return buf[:nbytes]

    def give(self, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        ptr = tensor.data_ptr()
        with self.lock:
            i = bisect.bisect_right(self.out_ptrs, ptr) - 1
            if i < 0:
                return
            base = self.out_ptrs[i]
            buf = self.out[base]
            if ptr >= base + buf.numel():
                return
            del self.out_ptrs[i]
            del self.out[base]
            if self.free_bytes + buf.numel() <= self.keep_bytes:
                self.free.setdefault(buf.numel(), []).append(buf)
                self.free_bytes += buf.numel()

    @property
    def outstanding(self) -> int:
        return len(self.out)

    def forget(self) -> None:
        """End of a run: buffers never handed back (reads of an aborted run) are dropped, not reused."""
        with self.lock:
            self.out.clear()
            self.out_ptrs.clear()

    def _new(self, size: int) -> torch.Tensor:
        self.allocated += 1
        return aligned_empty(size, self.pinned)


class HostTransfer:
    """The CPU: records are copied into the cache on the thread that lands them; spans are host times."""

    def __init__(self) -> None:
        self.staging = Staging(pinned=False)

    def start(self, clock) -> None:
        """At t = 0 of a run (``clock``: the run's clock)."""
        self.clock = clock

    def land(self, cache, records) -> None:
        """``records``: (canonical block, token range, layer range); every block is handed back to staging."""
        for block, tokens, layers in records:
            cache.write_block(block, tokens, layers)
        for block, _, _ in records:
            self.staging.give(block)

    def mark(self):
        return self.clock()

    def span(self, start_mark, end_mark) -> tuple[float, float]:
        return start_mark, end_mark

    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return tensors


class CudaTransfer:
    """One CUDA device: pinned staging, a copy stream ordered by events, CUDA-event timing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.staging = Staging(pinned=True)
        self.stream = torch.cuda.Stream(device)
        self.copies = 0                               # loads landed through the stream (tests: it was used)
        self.trace: list | None = None                # a list: each landing's (start, end) event pair is kept

    def start(self, clock) -> None:
        """Record the reference event: device times are mapped to the run's clock as t_ref + elapsed."""
        self.clock = clock
        torch.cuda.synchronize(self.device)
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record(torch.cuda.current_stream(self.device))
        self.ref.synchronize()
        self.ref_t = clock()

    def land(self, cache, records) -> None:
        timed = self.trace is not None
        begin, done = torch.cuda.Event(enable_timing=timed), torch.cuda.Event(enable_timing=timed)
        dtype = cache.keys[0].dtype
        with torch.cuda.stream(self.stream):
            begin.record(self.stream)
            for block, tokens, layers in records:
                pinned = block.is_pinned()
                if block.dtype != dtype:      # cast on the device: torch casts a host-to-device copy on the host
                    block = block.to(self.device, non_blocking=pinned)
                cache.write_block(block, tokens, layers, non_blocking=pinned)
            done.record(self.stream)
        done.synchronize()                            # the I/O thread waits; the compute stream does not
        self.copies += 1
        if timed:
            self.trace.append(self.span(begin, done))
        for block, _, _ in records:
            self.staging.give(block)

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def span(self, start_mark, end_mark) -> tuple[float, float]:
        """Waits for ``end_mark``: the caller's next decision sees the device's work done."""
        end_mark.synchronize()
        return (self.ref_t + self.ref.elapsed_time(start_mark) / 1e3, self.ref_t + self.ref.elapsed_time(end_mark) / 1e3)

    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device tensors to fresh host tensors, copied on the transfer stream after the compute queued so far."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out = [t.to("cpu", non_blocking=False) for t in tensors]
        return out


def for_device(device: torch.device):
    return CudaTransfer(device) if device.type == "cuda" else HostTransfer()

