"""The I/O side: one thread walking the I/O order, reads running ahead on fetch threads, loads landing in order.

Reads run ahead: up to ``depth`` loads are in the pool at once (``depth`` = its devices, at least 2), so a device
that finished its share of one read starts on the next instead of idling while another finishes (a read of one
layer's records, or of an odd number of them, is never spread evenly). Loads land — are written into the cache and
become visible — in order. A dynamic-meet load is claimed when it is issued; near the meet (two unclaimed chunks or
fewer) claims wait until nothing is in flight, so running ahead never takes a chunk from the compute side. A
pipelined meet's last group (kvflow.planner.group) is one read per layer, bottom up; after it, claims wait for it to
land, so the I/O side goes below it only when the compute side runs late.

Safety: the thread checks ``sync.stop`` between reads (the compute side failed: end now, pending reads cancelled);
every read has a deadline (``stall_s``): one that does not return in time is a StallError naming the load and the
devices holding its records. Fetch threads are daemons, so a read stuck in a device cannot hold up the process's
exit; every other fetch thread is joined before the I/O thread ends.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout

from kvflow.executor.board import Board
from kvflow.executor.job import Job
from kvflow.executor.sync import StallError, Sync
from kvflow.executor.timeline import Event
from kvflow.planner.plan import LoadStep
from kvflow.threads import single_threaded_run

log = logging.getLogger("kvflow.executor")


class Reads:
    """``depth`` daemon threads calling ``read(keys)``; each submit is a Future."""

    def __init__(self, read, depth: int, name: str = "kvflow-fetch"):
        self.read = read
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=single_threaded_run(self._work), name=f"{name}_{i}", daemon=True)
                        for i in range(depth)]
        for t in self.threads:
            t.start()

    def submit(self, keys) -> Future:
        fut: Future = Future()
        self.todo.put((fut, keys))
        return fut

    def _work(self) -> None:
        while (item := self.todo.get()) is not None:
            fut, keys = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self.read(keys))
            except BaseException as err:  # surfaced where the future is waited on
                fut.set_exception(err)

    def close(self, timeout: float) -> list[threading.Thread]:
        """Cancel reads not yet started, let the running ones end (up to ``timeout`` s in all); returns the threads
        still in a read (stuck: left behind as daemons)."""
        while True:
            try:
                fut, _ = self.todo.get_nowait()
            except queue.Empty:
                break
            fut.cancel()
        for _ in self.threads:
            self.todo.put(None)
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t for t in self.threads if t.is_alive()]


class IOSide:
    def __init__(self, pool, sync: Sync, jobs: list[Job], boards: list[Board]):
        self.pool, self.sync, self.jobs, self.boards = pool, sync, jobs, boards
        self.depth = max(2, getattr(pool, "parallelism", 1))
        self.flight: deque = deque()     # (r, chunks, layers, keys, future, issued)
        self.landed_at = 0.0             # when the last load landed: the next one's busy time starts there
        self.stuck = False               # a read missed its deadline: do not wait for it again

    def run(self, io_order: list[tuple[int, LoadStep]]) -> None:
        """The I/O thread's body; its error is surfaced on the compute thread (``sync.io_error``)."""
        sync = self.sync
        self.reads = Reads(reader(self.pool, sync.transfer.staging), self.depth)
        try:
            for r, step in io_order:
                if sync.stop.is_set():
                    return
                job, board = self.jobs[r], self.boards[r]
                (c0, c1), (l0, l1) = step.chunks, step.layers
                if job.plan.dynamic_meet:
                    while True:
                        with sync.cond:
                            reading = any(f[0] == r for f in self.flight)
                            claim = board.claim((c0, c1), reading, sync.clock())
                            if claim == "group":
                                sync.notify()
                        if claim is not None:
                            break
                        self.land()                  # near the meet: let what is in flight land, then decide
                    if claim == "skip":
                        continue
                    if claim == "shared":
                        self.drain()
                        self.load_shared(r, c0)
                        self.landed_at = sync.clock()
                        continue
                    if claim == "group":     # the last group: one read per layer, bottom up
                        for layer in range(job.plan.num_layers):
                            self.issue(r, board.group, (layer, layer + 1))
                        continue
                self.issue(r, (c0, c1), (l0, l1))
            self.drain()
        except BaseException as err:  # surfaced on the compute thread
            sync.io_error.append(err)
        finally:
            left = self.reads.close(0.0 if self.stuck else sync.stall_s)  # no other read outlives the run
            if left:
                log.warning("executor: %d pool read(s) stuck past the stall timeout left on daemon threads %s",
                            len(left), ", ".join(t.name for t in left))
            sync.end_io()

    def issue(self, r: int, chunks: tuple[int, int], layers: tuple[int, int]) -> None:
        """Submit one read, landing the oldest while ``depth`` are in flight."""
        keys = self.jobs[r].keys
        wanted = [keys[i][layer] for i in range(*chunks) for layer in range(*layers)]
        self.flight.append((r, chunks, layers, wanted, self.reads.submit(wanted), self.sync.clock()))
        while len(self.flight) >= self.depth and not self.sync.stop.is_set():
            self.land()

    def drain(self) -> None:
        while self.flight:
            if self.sync.stop.is_set():
                return
            self.land()

    def land(self) -> None:
        r, (c0, c1), (l0, l1), wanted, fut, issued = self.flight.popleft()
        job, board, sync = self.jobs[r], self.boards[r], self.sync
        C = job.plan.chunk_tokens
        got = self.result(fut, r, (c0, c1), (l0, l1), wanted)
        misses, records = [], []
        keys = iter(wanted)
        for i in range(c0, c1):
            for layer in range(l0, l1):
                key = next(keys)
                tensor = got.get(key)
                if tensor is None:
                    misses.append((i, layer))
                else:
                    records.append((tensor, key.tokens, key.layers))
        sync.transfer.land(job.cache, records)  # hot path: one copy per record into the cache (dtype cast included)
        end = sync.clock()
        start, self.landed_at = max(issued, self.landed_at), end
        sync.io_events.append((r, Event("load", (c0 * C, c1 * C), (l0, l1), start, end)))
        with sync.cond:
            board.landed((c0, c1), (l0, l1), misses, start, end)
            sync.notify()

    def load_shared(self, r: int, chunk: int) -> None:
        """Cell meet: load the shared chunk's layers top-down until the compute side's layer is next, as many
        layers per read as the pool has devices (one layer alone would leave the others idle)."""
        job, board, sync = self.jobs[r], self.boards[r], self.sync
        C, width = job.plan.chunk_tokens, getattr(self.pool, "parallelism", 1)
        while not sync.stop.is_set():
            with sync.cond:
                top = board.sh
                board.sh = max(board.sl, board.sh - width)
                if board.sh >= top:
                    return
                layers = (board.sh, top)
                board.in_flight += 1
            keys = [job.keys[chunk][layer] for layer in range(*layers)]
            start = sync.clock()
            got = self.result(self.reads.submit(keys), r, (chunk, chunk + 1), layers, keys)
            misses = [(chunk, layer) for layer, k in zip(range(*layers), keys) if got.get(k) is None]
            sync.transfer.land(job.cache, [(got[k], k.tokens, k.layers) for k in keys if got.get(k) is not None])
            sync.io_events.append((r, Event("load", (chunk * C, (chunk + 1) * C), layers, start, sync.clock())))
            with sync.cond:
                board.cells.fill((chunk, chunk + 1), layers)
                for i, layer in misses:
                    board.cells.unfill(i, layer)
                if misses:
                    board.fail_cell(chunk, min(layer for _, layer in misses))
                board.in_flight -= 1
                sync.notify()

    def result(self, fut: Future, r: int, chunks: tuple[int, int], layers: tuple[int, int], keys) -> dict:
        """A read's records, or StallError when it does not return within the stall timeout."""
        try:
            return fut.result(timeout=self.sync.stall_s)
        except (FutureTimeout, CancelledError):
            self.stuck = True
            raise StallError(f"executor stalled: the load of request {r} {_span('chunk', chunks)} "
                             f"{_span('layer', layers)} did not return within {self.sync.stall_s:g} s "
                             f"(executor.stall_timeout_s){self._devices(keys)}") from None

    def _devices(self, keys) -> str:
        """Which pool devices hold ``keys`` (error path only: scans the pool's index)."""
        try:
            digests = {k.digest for k in keys}
            devs = sorted({dev for d, dev, *_ in self.pool.entries() if d in digests})
            names = [f"{self.pool.stats()['devices'][i]['name']} (#{i})" for i in devs]
        except Exception:  # a pool without an index to ask: the load alone names the stall
            return ""
        return f"; its records are on pool device{'s' if len(names) > 1 else ''} {', '.join(names)}" if names else ""


def reader(pool, staging):
    """``pool.get_many`` reading into the transfer's staging buffers where the pool can (KVPool), else as it is."""
    try:
        takes = "staging" in inspect.signature(pool.get_many).parameters
    except (TypeError, ValueError):
        takes = False
    return (lambda keys: pool.get_many(keys, staging=staging)) if takes else pool.get_many


def _span(what: str, span: tuple[int, int]) -> str:
    a, b = span
    return f"{what} {a}" if b - a == 1 else f"{what}s {a}-{b - 1}"
