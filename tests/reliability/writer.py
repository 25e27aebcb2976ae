"""The processes the campaign attacks: a writer that stores batches forever and acknowledges each one (with the
time) after ``put_many`` returned every record of it, and a builder that leaves a pool with records in both its
checkpoint and its log. Preloaded by a multiprocessing forkserver so each trial forks in milliseconds."""

from __future__ import annotations

import os
import time

import torch

from kvflow.pool import KVPool

from tests.pool.crash_writer import batch_keys, record_for  # noqa: F401  (re-exported for the checker)

BATCH = len(batch_keys(0))


def write_forever(cfg: dict, ack_path: str, first_batch: int, batches: int, close: bool = True) -> None:
    """Ack line ``<batch> <unix time> <synced_at> <longest sync pass s>`` once a batch is fully stored (the last
    two: when the pool's last completed sync pass began, and its longest pass so far, as the writer saw them then);
    ``err <batch> <error>`` when a put raised or stored fewer records than it was given (not acknowledged)."""
    ack = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        pool = KVPool.open(cfg)
    except Exception as err:  # noqa: BLE001 — the trial records why the pool did not open
        os.write(ack, f"openerr {type(err).__name__}: {err}\n".replace("\n", " ").encode() + b"\n")
        os._exit(3)
    for b in range(first_batch, first_batch + batches):
        try:
            stored = pool.put_many({k: record_for(k) for k in batch_keys(b)})
        except Exception as err:  # noqa: BLE001
            os.write(ack, f"err {b} {type(err).__name__}: {err}".replace("\n", " ").encode() + b"\n")
            continue
        if stored == BATCH:
            os.write(ack, f"{b} {time.time():.6f} {pool.synced_at:.6f} "
                           f"{pool.stats()['sync_pass_max_s']:.6f}\n".encode())
        else:
            os.write(ack, f"err {b} stored {stored} of {BATCH}\n".encode())
    if close:
        pool.close()
        os.write(ack, b"closed\n")
    os._exit(0)


def build(cfg: dict, batches: int, checkpoint_at: int, done_path: str) -> None:
    """Store ``batches`` batches, checkpoint after ``checkpoint_at`` of them, then exit without closing: the pool
    is left with records in its checkpoint and in its log, as after a crash."""
    pool = KVPool.open(cfg)
    for b in range(batches):
        assert pool.put_many({k: record_for(k) for k in batch_keys(b)}) == BATCH
        if b + 1 == checkpoint_at:
            pool.checkpoint()
    with open(done_path, "w") as f:
        f.write("done\n")
    os._exit(0)


def parse_acks(path) -> tuple[dict[int, float], bool, list[str]]:
    """Acknowledged batch -> time, whether the writer closed cleanly, and error lines."""
    acked, closed, errors = {}, False, []
    if not os.path.exists(path):
        return acked, closed, errors
    for line in open(path).read().splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "closed":
            closed = True
        elif parts[0] in ("err", "openerr"):
            errors.append(line)
        elif len(parts) == 4:
            acked[int(parts[0])] = float(parts[1])
    return acked, closed, errors


def last_sync(path) -> tuple[float, float]:
    """The writer's ``pool.synced_at`` and longest sync pass on its last acknowledgement: every batch acknowledged
    before that moment was on stable storage by then ((0.0, 0.0) without acknowledgements)."""
    synced, longest = 0.0, 0.0
    if os.path.exists(path):
        for line in open(path).read().splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0].isdigit():
                synced, longest = max(synced, float(parts[2])), max(longest, float(parts[3]))
    return synced, longest


def expected(key) -> torch.Tensor:
    return record_for(key)
