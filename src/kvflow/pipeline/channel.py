"""Messages between neighbouring stages over torch.distributed point-to-point (gloo on CPU, NCCL between GPUs:
pipeline/comm.py). A message's tensors live on ``wire`` (the backend's device); received hidden states are handed
over on ``compute`` (the stage's own device).

Every message is a fixed header (int64 x 4: kind, a, b, hidden size) and, for a piece, its payload: the hidden
states of tokens [a, b) as raw bytes (any dtype). Two FIFO channels per neighbour pair, one tag each:

    DATA     stage g -> g+1   hand-off pieces + END, tail/query pieces + END, repair pieces + END
    CONTROL  stage g+1 -> g   REPAIR(a, b) | DONE

Sends are asynchronous (kept until ``flush``); receives block up to the process group's timeout, and a dead
peer surfaces at once as an error ("Connection closed by peer"), which the launcher reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

DATA, CONTROL = 1, 2                      # tags
PIECE, END, REPAIR, DONE = 1, 2, 3, 4     # kinds

_DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
_CODES = {v: k for k, v in _DTYPES.items()}


@dataclass(slots=True)
class Message:
    kind: int
    a: int = 0
    b: int = 0
    hidden: torch.Tensor | None = None    # PIECE: [1, b - a, hidden]


class Channel:
    """One direction between this rank and ``peer`` on one tag."""

    def __init__(self, peer: int, tag: int, hidden_size: int, dtype: torch.dtype,
                 wire: torch.device = torch.device("cpu"), compute: torch.device = torch.device("cpu")):
        self.peer, self.tag, self.hidden_size, self.dtype = peer, tag, hidden_size, dtype
        self.wire, self.compute = wire, compute
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.sent_bytes = 0

    def send(self, kind: int, a: int = 0, b: int = 0, hidden: torch.Tensor | None = None) -> None:
        header = torch.tensor([kind, a, b, _CODES[self.dtype]], dtype=torch.int64, device=self.wire)
        self._pending.append((dist.isend(header, self.peer, tag=self.tag), header))
        if kind == PIECE:
            assert hidden is not None and hidden.shape[1] == b - a, (hidden.shape, a, b)
            payload = hidden.detach().to(self.wire, self.dtype).contiguous().view(torch.uint8).view(-1)
            self._pending.append((dist.isend(payload, self.peer, tag=self.tag), payload))
            self.sent_bytes += payload.numel()

    def piece(self, a: int, hidden: torch.Tensor) -> None:
        self.send(PIECE, a, a + hidden.shape[1], hidden)

    def recv(self) -> Message:
        header = torch.empty(4, dtype=torch.int64, device=self.wire)
        dist.recv(header, self.peer, tag=self.tag)
        kind, a, b, code = (int(x) for x in header)
        if kind != PIECE:
            return Message(kind, a, b)
        dtype = _DTYPES[code]
        payload = torch.empty((b - a) * self.hidden_size * dtype.itemsize, dtype=torch.uint8, device=self.wire)
        dist.recv(payload, self.peer, tag=self.tag)
        return Message(kind, a, b, payload.view(dtype).view(1, b - a, self.hidden_size).to(self.compute))

    def flush(self) -> None:
        """Wait until every message sent so far has left (before the buffers may go)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
