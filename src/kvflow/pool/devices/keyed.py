"""The second kind of tier: a keyed store (Redis / Valkey, ``remote.py``), addressed by name, not by offset. Striped
devices (``base.py``) hold a flat byte range the pool's allocator carves up; a keyed store holds records under names
every process computes alike (``digest.hex()`` of the record key), so an engine finds what another engine stored
without that engine's index.

    store.get(names, io)       -> Answer(values: bytes | None per name)     one pipelined round, nodes in parallel
    store.contains(names, io)  -> Answer(values: bool per name)             on the caller's I/O workers (``io``;
    store.put(names, recs, io) -> Answer(values: bool per name: stored)     None: on the calling thread)
    store.delete(names)        (raises OSError)
    store.ping()               (raises OSError: the store does not answer)

A failed node makes its names' values None (misses) and shows in ``Answer.failed``; nothing raises. The pool's keyed
path (``kvflow.pool.keyed``) asks stores for what its index does not know; ``KeyedDevice`` lets the striper place
records on a store too (``remote_placement: stripe``): offsets only name what this process put there.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kvflow.chunks.record import HEADER_SIZE, parse_header
from kvflow.errors import RecordError
from kvflow.pool.devices.base import ALIGN, Device, check_writable, into

if TYPE_CHECKING:
    from kvflow.pool.config import DeviceConfig

DEFAULT_CAPACITY = 1 << 40   # what the pool's allocator accounts for a store; the store's own limit decides really


@dataclass(slots=True)
class Answer:
    """One batched request: a value per name (None / False where the node holding it failed), and how many of its
    per-node requests failed, with the first failure."""
    values: list
    requests: int = 1
    failed: int = 0
    error: OSError | None = None

    @property
    def down(self) -> bool:
        """No request was answered: the store itself failed."""
        return self.error is not None and self.failed >= self.requests


class KeyedStore(Protocol):
    name: str
    cfg: DeviceConfig
    reachable: bool          # answered at open (or since)
    unreachable: str         # why it did not answer at open ("" when it did)
    rounds: int              # pipelined rounds so far (tests count them)

    def get(self, names: list[bytes], io: Executor | None = None) -> Answer: ...
    def contains(self, names: list[bytes], io: Executor | None = None) -> Answer: ...
    def put(self, names: list[bytes], records: list, io: Executor | None = None) -> Answer: ...
    def delete(self, names: list[bytes]) -> None: ...
    def ping(self) -> None: ...
    def close(self) -> None: ...
    def describe(self) -> dict: ...


def record_name(digest: bytes) -> bytes:
    """A record's name in every keyed store: the hex of its key digest (the same in every process and host)."""
    return digest.hex().encode()


def owned(data: bytes, out: torch.Tensor | None = None) -> torch.Tensor:
    """``data`` copied into a page-aligned uint8 tensor (``out`` when it is large enough)."""
    out = into(out if out is not None and out.numel() >= len(data) else None, len(data))
    out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return out


class KeyedDevice(Device):
    """A keyed store seen as a striped device, so the striper can place records on it. A record names itself (its
    header carries its key digest), so a commit stores it under that name; anything else (the bandwidth probe's
    data) goes under a scratch name of this process, deleted when its extent is freed."""
    kind = "net"

    def __init__(self, store: KeyedStore, scratch: bytes, readonly: bool = False):
        super().__init__(store.cfg, readonly)
        self.store = store
        self.persistent = False                  # the store keeps records; this process's index of them does not
        self.capacity = (store.cfg.capacity or DEFAULT_CAPACITY) // ALIGN * ALIGN
        self._scratch = scratch
        self._names: dict[int, bytes] = {}       # offset -> name of what this process put there

    def commit(self, offset: int, buf: torch.Tensor) -> None:
        check_writable(self)
        arr = buf.numpy()
        try:
            header = parse_header(arr[:HEADER_SIZE])
            name, n = record_name(header.digest), header.total_size
        except RecordError:
            name, n = self._scratch + str(offset).encode(), buf.numel()
        answer = self.store.put([name], [memoryview(arr)[:n]])
        if answer.error is not None:
            raise answer.error
        self._names[offset] = name

    def read(self, offset: int, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
        name = self._names.get(offset)
        if name is None:
            self.store.ping()                    # the store answers (the pool's re-probe asks this)
            raise RecordError(f"{self.name}: nothing stored at {offset} by this process")
        answer = self.store.get([name])
        if answer.error is not None:
            raise answer.error
        if answer.values[0] is None:
            raise RecordError("not in the store (evicted, expired or its node restarted empty): a miss")
        return owned(answer.values[0], out)[:length]

    def discard(self, offset: int) -> None:
        name = self._names.pop(offset, None)
        if name is not None and name.startswith(self._scratch):   # shared records stay: eviction is the store's
            try:
                self.store.delete([name])
            except OSError:
                pass

    def close(self) -> None:
        self.store.close()

    def describe(self) -> dict:
        return {**super().describe(), **self.store.describe()}
