"""Where a stage's compute inputs come from during restoration (pipeline.stage_link.StageLink implementations).

    EmbedInputs        stage 0: token embeddings, always at hand
    ActivationInputs   independent stage g > 0: the stored boundary activations at b_g, prefetched forward on their
                       own thread over the stage's link (its token bucket is shared with the KV loads, which walk
                       backward): while step k computes, step k+1's activations arrive
    HandoffInputs      sequential stage g > 0: the hidden states stage g-1 recomputed, as it hands them over
    Handoff            wraps a stage's inputs and forwards its full-stage outputs to the next stage
                       (sequential mode): all at once when its compute side is done, or step by step
"""

from __future__ import annotations

import logging
import threading

import torch

from kvflow.chunks.keys import ChunkKey
from kvflow.executor.timeline import Event
from kvflow.pipeline.channel import END, PIECE, Channel
from kvflow.pipeline.stage_link import StageLink
from kvflow.threads import single_threaded_run

log = logging.getLogger("kvflow.pipeline")


class EmbedInputs(StageLink):
    def __init__(self, runner, token_ids: torch.Tensor):
        self.runner, self.token_ids = runner, token_ids

    def inputs(self, a: int, b: int) -> torch.Tensor:
        return self.runner.embed(self.token_ids[a:b])


class ActivationInputs(StageLink):
    """``keys[i]``: the activation record of chunk i (only chunks whose record the index holds). ``steps``: the
    plan's compute steps as token ranges — asking for one step prefetches the next."""

    def __init__(self, pool, keys: list[ChunkKey], chunk_tokens: int, steps: list[tuple[int, int]], clock):
        self.pool, self.keys, self.C, self.clock = pool, keys, chunk_tokens, clock
        self.ends = sorted({b for _, b in steps})
        self._got: dict[int, torch.Tensor | None] = {}
        self._asked: set[int] = set()   # chunks requested from the pool (landed or in flight)
        self._queue: list[int] = []
        self._ahead = True              # prefetch the next step too (until the compute side is done)
        self._closed = False
        self._cond = threading.Condition()
        self.events: list[Event] = []
        self.failed: list[int] = []
        self.io_busy = 0.0
        self._thread = threading.Thread(target=single_threaded_run(self._prefetch), name="kvflow-act", daemon=True)
        self._thread.start()
        if steps:                       # the first step's activations go ahead of the KV loads on the link
            with self._cond:
                self._ask(range(steps[0][0] // chunk_tokens, min(-(-steps[0][1] // chunk_tokens), len(keys))))

    def inputs(self, a: int, b: int) -> torch.Tensor | None:
        C, n = self.C, len(self.keys)
        c0, c1 = a // C, min(-(-b // C), n)
        ahead = next((e for e in self.ends if e > b), b) if self._ahead else b
        with self._cond:
            self._ask(range(c0, min(-(-ahead // C), n)))
            self._cond.wait_for(lambda: all(i in self._got for i in range(c0, c1)))
            parts = []
            for i in range(c0, c1):
                if self._got[i] is None:
                    break
                parts.append(self._got[i])
        if not parts:
            return None
        hidden = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        return hidden[:, :b - a]

    def grid_computed(self) -> None:
        self._ahead = False

    def load(self, a: int, b: int) -> torch.Tensor | None:
        """The activations of tokens [a, b) (chunk aligned), fetched now if not prefetched; None unless all are valid."""
        if -(-b // self.C) > len(self.keys):
            return None
        hidden = self.inputs(a, b)
        return hidden if hidden is not None and hidden.shape[1] == b - a else None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _ask(self, chunks) -> None:
        """Lock held."""
        new = [i for i in chunks if i not in self._asked]
        if new:
            self._asked.update(new)
            self._queue += new
            self._cond.notify_all()

    def _prefetch(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._queue)
                if self._closed:
                    return
                batch, self._queue = self._queue, []
            wanted = [self.keys[i] for i in batch]
            start = self.clock()
            try:
                got = self.pool.get_many(wanted)
            except Exception as err:            # an unreadable pool: these chunks have no inputs (I/O covers them)
                log.warning("activations of chunks %s unreadable: %s", batch, err)
                got = {}
            end = self.clock()
            self.io_busy += end - start
            layer = wanted[0].layers[0]
            self.events.append(Event("act", (batch[0] * self.C, (batch[-1] + 1) * self.C), (layer, layer), start, end))
            with self._cond:
                for i, key in zip(batch, wanted):
                    tensor = got.get(key)
                    self._got[i] = None if tensor is None else tensor.view(1, self.C, -1).float()
                    if tensor is None:
                        self.failed.append(i)
                self._cond.notify_all()


class HandoffInputs(StageLink):
    """Hidden states from the previous stage, pieces covering [0, m) in order, then END."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.parts: list[torch.Tensor] = []
        self.have = 0
        self.ended = False

    def inputs(self, a: int, b: int) -> torch.Tensor | None:
        while self.have < b and not self.ended:
            msg = self.channel.recv()
            if msg.kind == END:
                self.ended = True
            else:
                assert msg.kind == PIECE and msg.a == self.have, "hand-off pieces arrive in order"
                self.parts.append(msg.hidden)
                self.have = msg.b
        if self.have <= a:
            return None
        if len(self.parts) > 1:
            self.parts = [torch.cat(self.parts, dim=1)]
        return self.parts[0][:, a:min(b, self.have)]

    def drain(self) -> None:
        """Read the rest of the hand-off (the compute side may have met I/O first) so the channel is at the query."""
        self.inputs(self.have, 1 << 62)


class Handoff(StageLink):
    """Sequential mode, stage g < S-1: inputs from ``source``; recomputed outputs [0, m) go to the next stage."""

    def __init__(self, source: StageLink, channel: Channel, per_step: bool = False):
        self.source, self.channel, self.per_step = source, channel, per_step
        self.parts: list[torch.Tensor] = []
        self.next = 0

    def inputs(self, a: int, b: int) -> torch.Tensor | None:
        return self.source.inputs(a, b)

    def output(self, a: int, hidden: torch.Tensor) -> None:
        if a != self.next:
            return                      # only a contiguous prefix can be handed over
        if self.per_step:
            self.channel.piece(a, hidden)
        else:
            self.parts.append(hidden)
        self.next = a + hidden.shape[1]

    def grid_computed(self) -> None:
        self.source.grid_computed()
        if self.parts:
            self.channel.piece(0, torch.cat(self.parts, dim=1))
            self.parts.clear()
        self.channel.send(END)
