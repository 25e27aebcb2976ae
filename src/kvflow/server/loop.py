"""EngineLoop: the one thread that drives an LLMEngine; asyncio handlers talk to it through queues.

    handler (event loop)  --submit()-->  inbox (queue.Queue)  -->  engine thread: add_request / step()
    handler  <--asyncio.Queue per request (call_soon_threadsafe)--  RequestOutput | Exception

A request that fails inside a step on its own (its sampling, its stop strings) ends alone with an error output
(engine.py, ``_next_token``); an exception out of the step itself (the batched forward) fails the requests of that
step (their handlers answer 500) and the loop goes on;
shutdown() stops admissions, lets running requests finish (up to a timeout), then flushes the pool writes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from kvflow.engine import LLMEngine, SamplingParams
from kvflow.threads import use_compute_threads

log = logging.getLogger("kvflow.server")


class ServerBusy(Exception):
    """The loop is shutting down and admits nothing new."""


@dataclass(slots=True)
class Handle:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq_id: int | None = None
    submitted_s: float = field(default_factory=time.perf_counter)
    last_s: float | None = None
    aborted: bool = False          # set by the handler's side; an aborted handle still in the inbox is never admitted


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self.inbox: queue.Queue = queue.Queue()
        self.handles: dict[int, Handle] = {}
        self._aborts: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._accepting = True
        self.step_errors = 0
        self.thread = threading.Thread(target=self._run, name="kvflow-engine", daemon=True)

    def start(self) -> EngineLoop:
        self.thread.start()
        return self

    @property
    def queue_length(self) -> int:
        return self.inbox.qsize()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Handle:
        if not self._accepting:
            raise ServerBusy("the server is shutting down")
        handle = Handle(prompt_ids, params, asyncio.get_running_loop())
        self.inbox.put(handle)
        self._wake.set()
        return handle

    def abort(self, handle: Handle) -> None:
        handle.aborted = True
        self._aborts.put(handle)
        self._wake.set()

    # ---------------------------------------------------------------------------------- the thread
    def _send(self, handle: Handle, item) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.events.put_nowait, item)
        except RuntimeError:       # its event loop is closed: nobody is listening any more
            pass

    def _admit(self) -> None:
        while True:
            try:
                handle = self.inbox.get_nowait()
            except queue.Empty:
                return
            if handle.aborted:
                continue
            try:
                handle.seq_id = self.engine.add_request(handle.prompt_ids, handle.params)
                self.handles[handle.seq_id] = handle
            except Exception as err:
                self._send(handle, err)

    def _drop_aborted(self) -> None:
        while True:
            try:
                handle = self._aborts.get_nowait()
            except queue.Empty:
                return
            if handle.seq_id is not None and self.handles.pop(handle.seq_id, None) is not None:
                self.engine.abort(handle.seq_id)

    def _run(self) -> None:
        use_compute_threads()         # the one thread of this process that computes with several (kvflow/threads.py)
        engine = self.engine
        while not self._stop.is_set():
            self._wake.clear()
            self._admit()
            self._drop_aborted()
            if not engine.has_unfinished():
                self._wake.wait(0.05)
                continue
            try:
                outputs = engine.step()
            except Exception as err:       # a bug in one step: fail what was running, keep serving
                self.step_errors += 1
                log.exception("engine step failed")
                for seq_id, handle in list(self.handles.items()):
                    engine.abort(seq_id)
                    self._send(handle, err)
                self.handles.clear()
                continue
            now = time.perf_counter()
            for out in outputs:
                handle = self.handles.get(out.seq_id)
                if handle is None:
                    continue
                if self.metrics is not None:
                    if handle.last_s is None:
                        self.metrics.ttft.observe(now - handle.submitted_s)
                    else:
                        self.metrics.itl.observe(now - handle.last_s)
                handle.last_s = now
                if out.finished:
                    del self.handles[out.seq_id]
                self._send(handle, out)

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting, let running requests finish, flush the pool writes, stop the thread."""
        self._accepting = False
        deadline = time.perf_counter() + drain_timeout_s
        while self.thread.is_alive() and (self.handles or not self.inbox.empty()) and time.perf_counter() < deadline:
            time.sleep(0.02)
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.engine.close()
