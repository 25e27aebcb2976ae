"""WriteQueue: records written to the pool by one background thread, off the serving path.

The engine (engine/pool_tier.py) and the vLLM connector (integrations/vllm.py) both store finished KV this way: the
caller copies the records out of its blocks and ``offer``s them; a bounded queue hands them to a writer thread.
When the queue is full the offer is dropped and counted — the caller never waits for the pool. A write that fails
is logged and counted: a missing record is a miss later, never a failed request.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from typing import Callable

from kvflow.threads import single_threaded_run

log = logging.getLogger("kvflow.pool")


class WriteQueue:
    def __init__(self, write: Callable[[dict], int], size: int, counters: Counter, name: str = "kvflow-pool-writer"):
        """``write(items) -> records stored``; ``counters`` gets writes_queued, writes_dropped, records_dropped,
        records_written, write_errors."""
        self.write, self.counters = write, counters
        for key in ("writes_queued", "writes_dropped", "records_dropped", "records_written", "write_errors"):
            counters.setdefault(key, 0)
        self.queue: queue.Queue = queue.Queue(maxsize=size)
        self.closed = False
        self._thread = threading.Thread(target=single_threaded_run(self._loop), name=name, daemon=True)
        self._thread.start()

    def full(self) -> bool:
        return self.queue.full()

    def pending(self) -> int:
        """Writes queued, not yet taken by the writer."""
        return self.queue.qsize()

    def offer(self, items: dict) -> bool:
        """Queue one write of ``items`` (key -> tensor); False (counted) when the queue is full or closed."""
        if not self.closed:
            try:
                self.queue.put_nowait(items)
                self.counters["writes_queued"] += 1
                return True
            except queue.Full:
                pass
        self.drop(len(items))
        return False

    def drop(self, records: int) -> None:
        """Count a write that was not queued (callers that check ``full()`` before copying records out)."""
        self.counters["writes_dropped"] += 1
        self.counters["records_dropped"] += records

    def _loop(self) -> None:
        while True:
            items = self.queue.get()
            try:
                if items is None:
                    return
                self.counters["records_written"] += self.write(items)
            except Exception as err:   # a failed write is a miss later, never a failed request
                self.counters["write_errors"] += 1
                log.warning("pool write failed: %s", err)
            finally:
                self.queue.task_done()

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self.queue.join()

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop the thread (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.flush()
        self.queue.put(None)
        self._thread.join(timeout=timeout)
