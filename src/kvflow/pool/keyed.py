"""The pool's keyed path: what its own index does not know, asked of the keyed stores among its slots
(``Slot.store``, ``devices/keyed.py``) — one pipelined round per store, never one per record.

    get_many ─ unknown keys ──► fetch          GET   ──► verify(record, key) ──► tensor | miss (bad: deleted)
    contains ─ unknown keys ──► contains       EXISTS
    longest_prefix ─ beyond ──► extend_prefix  EXISTS, binary search over the chunk chain
    put_many ─ stored ────────► copy           SET   (``remote_placement: copy``)
    placement ────────────────► weights        (``copy``: stores take no stripes while a local device can)

A store that answers no request of a round counts as one I/O error of its slot (three in a row take it out of
service); a node that fails makes its records misses. A node that hangs is waited for once: its first timeout makes
it suspect and the store sends it nothing until its background re-probe finds it answering (``devices/remote.py``),
so the later rounds of a restore (the binary search, the GETs) and later restores find its records missing at once. Keyed transfers pay the slot's throttle like striped reads.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import torch

from kvflow.chunks.keys import ChunkKey, record_digest
from kvflow.chunks.record import decode, encode_into, record_size
from kvflow.errors import RecordError
from kvflow.pool.devices.base import aligned_empty
from kvflow.pool.devices.keyed import Answer, owned, record_name
from kvflow.pool.state import PoolState

log = logging.getLogger("kvflow.pool")

OnError = Callable[[int, Exception, str], None]


def _stores(st: PoolState) -> list[int]:
    return [i for i, s in enumerate(st.slots) if s.healthy and s.store is not None]


def _settle(st: PoolState, i: int, op: str, answer: Answer, on_error: OnError) -> bool:
    """Count a round's failures against slot ``i``; False when the store answered nothing."""
    s = st.slots[i]
    if answer.down:
        on_error(i, answer.error, op)
        return False
    if answer.failed:
        with st.lock:
            s.counters["errors"] += 1
        log.warning("pool: %d of %d requests to %s failed (%s); their records are misses", answer.failed,
                    answer.requests, s.store.name, answer.error.strerror)
    s.errors_in_row = 0
    return True


def _present(st: PoolState, digests: list[bytes], on_error: OnError) -> set[bytes]:
    """The digests some healthy store holds (one pipelined EXISTS round per store)."""
    found: set[bytes] = set()
    for i in _stores(st):
        want = [d for d in digests if d not in found]
        if not want:
            break
        answer = st.slots[i].store.contains([record_name(d) for d in want], st.slots[i].io)
        if _settle(st, i, "exists", answer, on_error):
            found.update(d for d, there in zip(want, answer.values) if there)
    return found


def contains(st: PoolState, keys: list[ChunkKey], local: list[bool], on_error: OnError) -> list[bool]:
    """``local`` (what the pool's index knows) or'ed with what the stores hold, asked in one pipelined round."""
    unknown = [k.digest for k, ok in zip(keys, local) if not ok]
    if not unknown or not _stores(st):
        return local
    have = _present(st, unknown, on_error)
    return [ok or k.digest in have for k, ok in zip(keys, local)]


def extend_prefix(st: PoolState, hashes: list[bytes], tails: list[bytes], n: int, on_error: OnError) -> int:
    """Chunks of the longest prefix stored locally or in a store, given that the first ``n`` are known locally.
    One pipelined round asks for the first unknown chunk and the last one together (nothing there / the whole
    context there: done), then a binary search over the chunk chain, one round per probe (a chunk is there when
    every layer group's record is): O(log chunks) round trips, never one per chunk. It assumes the stored chunks
    of a context are a prefix; a hole the store evicted below the answer is a miss on read and is recomputed — the
    answer is a hint, the read is the check."""
    if n >= len(hashes) or not _stores(st):
        return n
    table, slots = st.table, st.slots

    def there(chunks: list[int]) -> list[bool]:
        need = {}
        for i in chunks:
            for tail in tails:
                d = record_digest(hashes[i], tail)
                e = table.get(d)
                if e is None or not slots[e.dev].healthy:
                    need.setdefault(i, []).append(d)
        have = _present(st, [d for ds in need.values() for d in ds], on_error) if need else set()
        return [all(d in have for d in need.get(i, ())) for i in chunks]

    last = len(hashes) - 1
    first_ok, last_ok = there([n, last]) if last > n else there([n]) * 2
    if not first_ok:
        return n
    if last_ok:
        return len(hashes)
    lo, hi = n + 1, last                 # chunks [0, lo) there, the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if there([mid - 1])[0]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fetch(st: PoolState, keys: list[ChunkKey], on_error: OnError) -> dict[ChunkKey, torch.Tensor]:
    """Records of ``keys`` (which the pool's index does not know) from the stores, verified like any read; a
    record absent, evicted, on a failed node or failing verification is left out (a miss)."""
    out: dict[ChunkKey, torch.Tensor] = {}
    for i in _stores(st) if keys else ():
        want = [k for k in keys if k not in out]
        if not want:
            break
        s = st.slots[i]
        t0 = time.monotonic()
        answer = s.store.get([record_name(k.digest) for k in want], s.io)
        if not _settle(st, i, "get", answer, on_error):
            continue
        s.device.pay(sum(len(r) for r in answer.values if r is not None), t0)
        bad, moved, found = [], 0, 0
        for key, data in zip(want, answer.values):
            if data is None:
                continue
            try:
                out[key] = decode(owned(data).numpy(), expect=key)[1]
                moved, found = moved + len(data), found + 1
            except RecordError as err:
                bad.append(key)
                log.warning("pool: dropping record %s from %s: %s", key.hex, s.store.name, err)
        if bad:     # a record that fails verification is deleted, so no engine reads it again
            try:
                s.store.delete([record_name(k.digest) for k in bad])
            except OSError:
                pass
        with st.lock:
            s.counters["reads"] += found
            s.counters["read_bytes"] += moved
            s.counters["corrupt"] += len(bad)
            st.counters["corrupt"] += len(bad)
    return out


def copy(st: PoolState, items: Iterable[tuple[ChunkKey, torch.Tensor, int]], dtype: torch.dtype,
         on_error: OnError) -> int:
    """``remote_placement: copy``: every record the pool stored on a striped device is also written to each store
    (pipelined SETs, encoded on the slot's workers). Best effort — a copy that fails is counted (``put_errors``)
    and logged, the local record stays. Returns records copied."""
    if st.cfg.remote_placement != "copy" or st.readonly:
        return 0
    items = [it for it in items if (e := st.table.get(it[0].digest)) is None or st.slots[e.dev].store is None]
    if not items:               # a pool of nothing but stores stripes to them: no second copy
        return 0
    copied = 0
    for i in _stores(st):
        s = st.slots[i]

        def encoded(item) -> memoryview:
            key, tensor, seq = item
            buf = aligned_empty(record_size(tensor.shape, dtype))
            encode_into(buf.numpy(), key, tensor.detach(), seq, dtype)
            return memoryview(buf.numpy())

        values = list(s.io.map(encoded, items))
        answer = s.store.put([record_name(k.digest) for k, _, _ in items], values, s.io)
        stored = answer.values if _settle(st, i, "set", answer, on_error) else [False] * len(items)
        ok = sum(stored)
        with st.lock:
            s.counters["writes"] += ok
            s.counters["write_bytes"] += sum(len(v) for v, r in zip(values, stored) if r)
            st.counters["put_errors"] += len(items) - ok
        copied = max(copied, ok)
    return copied


def weights(st: PoolState, bandwidths: list[float]) -> list[float]:
    """The striper's weights: b_i, except that with ``remote_placement: copy`` stores take no stripes while a
    striped device can (they get a copy of everything instead). Never all zero: a pool of nothing but a store that
    is down still places (and fails those writes) rather than refusing to open."""
    keyed = [s.store is not None for s in st.slots]
    if st.cfg.remote_placement == "copy" and any(b > 0 for b, k in zip(bandwidths, keyed) if not k):
        bandwidths = [0.0 if k else b for b, k in zip(bandwidths, keyed)]
    return bandwidths if any(b > 0 for b in bandwidths) else [1.0] * len(bandwidths)
