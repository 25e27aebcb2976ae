"""What the compute and I/O threads of one run share: the lock, the clock, the stop flag, the I/O side's end, and
the deadline every wait has.

A stall is a wait during which nothing happened (no notify from either side, no read landing, no input arriving)
for ``stall_s``. It raises one StallError naming what stalled — never a hang. The compute side waits only for the I/O
side, whose every read has a deadline of its own, so the compute side's deadline is twice as long: a stalled read is
reported by the side that knows which read (and which devices) it was.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvflow.errors import KVFlowError
from kvflow.executor.timeline import Event
from kvflow.executor.transfer import HostTransfer


class StallError(KVFlowError):
    """A pool read, a stage input or the other side of the executor did not come within the stall timeout."""


@dataclass
class Sync:
    stall_s: float
    origin: float                                   # time.perf_counter() at t = 0 of the run's timeline
    cond: threading.Condition = field(default_factory=threading.Condition)
    stop: threading.Event = field(default_factory=threading.Event)      # the compute side failed: I/O, end now
    io_done: threading.Event = field(default_factory=threading.Event)   # the I/O thread has ended
    io_error: list[BaseException] = field(default_factory=list)
    io_events: list[tuple[int, Event]] = field(default_factory=list)    # (request, load event), I/O thread only
    last_activity: float = field(default_factory=time.monotonic)
    transfer: Any = None                            # HostTransfer | CudaTransfer (transfer.py): landing and timing

    def __post_init__(self) -> None:
        if self.transfer is None:
            self.transfer = HostTransfer()
        self.transfer.start(self.clock)             # t = 0 of the run on the device's clock too

    def clock(self) -> float:
        return time.perf_counter() - self.origin

    def notify(self) -> None:
        """Lock held. Something changed: wake the waiters and restart their deadlines."""
        self.last_activity = time.monotonic()
        self.cond.notify_all()

    def wait(self, poll: float, what: Callable[[], str]) -> None:
        """Lock held. One wait of at most ``poll`` s for a notify; StallError when nothing happened for twice the
        stall timeout (see the module docstring)."""
        self.cond.wait(poll)
        quiet = time.monotonic() - self.last_activity
        if quiet >= 2 * self.stall_s and not self.io_done.is_set():
            raise StallError(f"executor stalled: {what()} — the I/O side did nothing for {quiet:.3g} s "
                             f"(executor.stall_timeout_s = {self.stall_s:g})")

    def wait_for(self, ready: Callable[[], bool], what: Callable[[], str]) -> None:
        """Lock held. Until ``ready()`` or the I/O side ends; a stall raises (see :meth:`wait`)."""
        while not (ready() or self.io_done.is_set()):
            self.wait(self.stall_s, what)

    def end_io(self) -> None:
        """The I/O thread's last act."""
        with self.cond:
            self.io_done.set()
            self.notify()
