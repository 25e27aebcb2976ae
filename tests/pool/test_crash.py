"""kill -9 at random moments, many times: after every crash the reopened pool has no two live keys sharing an
extent, an allocator that agrees with its index, only records that verify, the right content, and (in both
durability modes, since kill -9 keeps the page cache) every acknowledged record. A deliberately broken recovery
makes the same checks fail, so they can."""

from __future__ import annotations

import multiprocessing
import random
import time

import pytest

from kvflow.pool import journal as journal_mod
from kvflow.pool.allocator import ExtentAllocator

from . import crash_writer
from .crash_writer import violations


@pytest.fixture(scope="module")
def forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.pool.crash_writer"])
    return ctx


def pool_cfg(tmp_path, durability: str, capacity: int) -> dict:
    return {"index_dir": str(tmp_path / "idx"), "durability": durability, "chunk_tokens": 16,
            "checkpoint_interval_s": 0.02, "wal_compact_bytes": 16 * 64,        # compact every few puts
            "devices": [{"type": "memory", "path": str(tmp_path / "shm"), "capacity": capacity, "bandwidth": 4 << 30},
                        {"type": "extent", "path": str(tmp_path / "disk.img"), "capacity": capacity,
                         "bandwidth": 2 << 30, "zero_fill": False},                    # sparse: cheap to create
                        {"type": "files", "path": str(tmp_path / "files"), "capacity": capacity,
                         "bandwidth": 1 << 30, "drop_cache": False}]}


def acked(path) -> tuple[list[int], bool]:
    lines = path.read_text().split() if path.exists() else []
    return [int(x) for x in lines if x != "closed"], "closed" in lines


def crash_trials(ctx, tmp_path, durability, capacity, trials, seed, stop_early=False, per_pool=4):
    """Run ``trials`` writers, ``per_pool`` in a row on one pool (each recovering what the last one left), each
    killed at a random moment; returns the violations found and how many writers were killed mid-run. A writer
    puts at most 999 batches (~18 MB), so without eviction four of them fit in the 3 x 64 MiB pool."""
    rng = random.Random(seed)
    found, kills = [], 0
    for t in range(trials):
        if t % per_pool == 0:
            cfg = pool_cfg(tmp_path / f"pool{t}", durability, capacity)
            written, all_acked = [], []
        ack = tmp_path / f"ack{t}"
        first = t * 1000
        p = ctx.Process(target=crash_writer.write_forever, args=(cfg, str(ack), first, 999))
        p.start()
        if rng.random() < 0.25:                 # while it opens: recovery, checkpoint, first puts
            time.sleep(rng.uniform(0, 0.05))
        else:                                   # after a random number of acknowledged puts, mid-put
            target, deadline = rng.randrange(1, 400), time.monotonic() + 20
            while (not ack.exists() or ack.read_bytes().count(b"\n") < target) and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 0.002))
        p.kill()
        p.join()
        got, closed = acked(ack)
        kills += not closed
        written += list(range(first, (max(got) + 2) if got else first + 1))
        all_acked += got
        found += [f"trial {t}: {v}" for v in violations(cfg, written, all_acked, must_keep_acked=True)]
        if stop_early and found:
            break
    return found, kills


@pytest.mark.slow
@pytest.mark.parametrize("durability", ["strict", "relaxed"])
def test_kill9_during_puts_and_checkpoints_keeps_every_invariant(forkserver, tmp_path, durability):
    found, kills = crash_trials(forkserver, tmp_path, durability, capacity=64 << 20, trials=16, seed=1)
    assert not found, found
    assert kills == 16, "every writer is killed mid-run"


@pytest.mark.slow
def test_kill9_under_constant_eviction_keeps_every_invariant(forkserver, tmp_path, monkeypatch):
    found, kills = crash_trials(forkserver, tmp_path, "strict", capacity=96 * 4096, trials=16, seed=2)
    found = [f for f in found if "acknowledged" not in f]      # evicted records are legitimately gone
    assert not found, found


@pytest.mark.slow
@pytest.mark.parametrize("sabotage", ["forget_log", "ignore_deletes", "fresh_allocator"])
def test_a_broken_recovery_is_caught(forkserver, tmp_path, monkeypatch, sabotage):
    if sabotage == "forget_log":           # recover from the checkpoint alone
        monkeypatch.setattr(journal_mod, "unpack_log", lambda data: ([], 0, False))
    elif sabotage == "ignore_deletes":     # replay PUTs but not DELs: evicted keys come back on reused extents
        real_apply = journal_mod.apply
        monkeypatch.setattr(journal_mod, "apply",
                            lambda rows, op: None if op.op == journal_mod.DEL else real_apply(rows, op))
    else:                                  # an allocator that forgets what the index holds
        monkeypatch.setattr(ExtentAllocator, "from_used", classmethod(lambda cls, cap, align, ext: cls(cap, align)))
    capacity = 96 * 4096 if sabotage == "ignore_deletes" else 64 << 20
    found, _ = crash_trials(forkserver, tmp_path, "strict", capacity=capacity, trials=6, seed=3, stop_early=True)
    assert found, "the checks must notice a broken recovery"
