"""The process the crash tests kill -9: it stores batches of records forever and, after each put_many returns,
appends the batch number to an acknowledgement file (one write(), so a kill cannot tear it). Also the checker
that reopens the pool afterwards and lists every broken recovery invariant.

Preloaded by a multiprocessing forkserver, so each trial forks in milliseconds instead of importing torch."""

from __future__ import annotations

import os

import torch

from kvflow.pool import KVPool
from kvflow.pool.allocator import round_up

from .helpers import context_keys, tensor_for


def batch_keys(batch: int):
    return context_keys(4, seed=batch)


def record_for(key) -> torch.Tensor:
    return tensor_for(key, numel=512 * (1 + key.digest[0] % 3))     # 2-6 KiB: extents of one or two units


def write_forever(cfg: dict, ack_path: str, first_batch: int, batches: int) -> None:
    pool = KVPool.open(cfg)
    ack = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for b in range(first_batch, first_batch + batches):
        pool.put_many({k: record_for(k) for k in batch_keys(b)})
        os.write(ack, f"{b}\n".encode())
    pool.close()
    os.write(ack, b"closed\n")


def violations(cfg: dict, written: list[int], acked: list[int], must_keep_acked: bool) -> list[str]:
    """Reopen the pool (recovery) and check: no two rows share an extent; allocator == rows; every row verifies;
    what is served is what was put; with ``must_keep_acked`` every acknowledged record is there."""
    bad = []
    with KVPool.open(cfg) as pool:
        st = pool.stats()
        if st["recovery_conflicts"]:
            bad.append(f"{st['recovery_conflicts']} rows shared an extent after recovery")
        rows = pool.entries()
        for i, slot in enumerate(pool.slots):
            mine = sorted((off, round_up(n, slot.alloc.align)) for _, dev, off, n, _ in rows if dev == i)
            if any(a + n > b for (a, n), (b, _) in zip(mine, mine[1:])):
                bad.append(f"device {i}: two live keys share an extent")
            if dict(mine) != slot.alloc.used:
                bad.append(f"device {i}: allocator and index disagree")
        report = pool.fsck(repair=False)
        if report["bad"]:
            bad.append(f"{len(report['bad'])} indexed records do not verify: {report['bad'][0]['error']}")
        keys = [k for b in written for k in batch_keys(b)]
        got = pool.get_many(keys)
        wrong = [k for k in keys if got[k] is not None and not torch.equal(got[k], record_for(k))]
        if wrong:
            bad.append(f"{len(wrong)} records served with the wrong content")
        lost = [k for b in acked for k in batch_keys(b) if got[k] is None]
        if must_keep_acked and lost:
            bad.append(f"{len(lost)} acknowledged records lost")
        pool.put_many({k: record_for(k) for k in batch_keys(10**9)})  # new puts must not clobber live rows
        if pool.fsck(repair=False)["bad"]:
            bad.append("a put after recovery overwrote a live record")
    return bad
