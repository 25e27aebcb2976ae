"""The reliability campaign: attack the pool the ways machines fail and count, for every trial, what a user
would lose. ``make reliability`` runs the full campaign; ``make test`` a short one (test_kill_campaign.py,
test_disk_campaign.py).

    python -m tests.reliability.campaign --kills 500 --power-cuts 50 --out docs/bench/reliability.json

``--kills`` and ``--power-cuts`` count trials per durability mode (strict and relaxed each get that many).

Trial kinds (DESIGN.md §6, issue 10):
  kill-strict / kill-relaxed        kill -9 of a writer at a random moment (opening, mid-put, mid-checkpoint)
  powercut-strict / -relaxed        ext4 on a loop device, the writer on it; the writer frozen (SIGSTOP) at a random
                                    moment, the file system shut down without flushing its log
                                    (FS_IOC_SHUTDOWN, NOLOGFLUSH), the writer killed, unmount, remount, reopen
  powercut-strict-evicting          the same on devices so small that every put evicts
  powercut-relaxed-after-close      a relaxed writer closes its pool cleanly, then the power is cut
  corrupt-<damage>                  a pool with records in checkpoint and log, one kind of damage, reopen
  two-pools                         two configs (own index_dir) over one extent file
  enospc-init / enospc-put          a capacity larger than the file system at init; puts into a sparse extent
                                    file until the file system is full
  eio                               the file system fails under a running writer (shutdown: every I/O is EIO)
  force-init-live-writer            ``pool init --force`` while a strict writer has the pool open (issue 37 table)
  force-init-refused-late           ``init --force`` on a config refused for its last entry: nothing deleted first
  force-init-ordinary-file          an ordinary file named as an extent: refused with and without --force
  shared-index-dir / empty-index-dir  two configs on one index_dir; index_dir "", "." or KVFLOW_POOL_INDEX_DIR=
  corrupt-checkpoint-deleted / -wal-deleted / -wal-first-page-zeroed / -manifest-device-id-changed (and the
  first two -then-puts: 40 more batches before the check)
  signature-block-device            a loop device with a btrfs signature at 64 KiB, first page zero (root only)
  enospc-one-put                    ENOSPC on one put: the device stays in service, its records are served
  close-racing-put                  close() while three threads put

For each trial: acknowledged puts lost, wrong records served, intact records lost, and whether ``fsck`` right
after recovery is clean. Loop devices, mounts and their images are always torn down. Trials that need root or
loop devices are skipped with a note. dm-error / dm-flakey are used when the kernel has device-mapper; without it
EIO comes from a file-system shutdown.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import multiprocessing
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvflow.errors import KVFlowError
from kvflow.pool import KVPool

from tests.pool.helpers import flip_byte
from tests.reliability import writer
from tests.reliability.writer import BATCH, batch_keys, last_sync, parse_acks, record_for

FS_IOC_SHUTDOWN = 0x8004587D          # _IOR('X', 125, __u32)
FS_SHUTDOWN_FLAG_NOLOGFLUSH = 2


@dataclass
class Trial:
    kind: str
    acked_lost: int = 0          # acknowledged records (put returned, fully stored) not served after recovery
    wrong_served: int = 0        # records served with content that is not what was put under that key
    intact_lost: int = 0         # records whose bytes were not damaged but that are no longer served
    fsck_clean: bool = True      # fsck right after recovery: every indexed record verifies, no overlaps
    acked: int = 0
    note: str = ""
    bounded_lost: int = 0        # relaxed: records acknowledged before the last completed sync pass began, lost
    oldest_lost_s: float = 0.0   # relaxed power cut: age at the cut of the oldest acknowledged record lost
    horizon_s: float = 0.0       # relaxed power cut: how long before the cut the last completed sync pass began
    sync_pass_max_s: float = 0.0  # relaxed power cut: the writer's longest sync pass


# -- process plumbing ------------------------------------------------------------------------------------------
_CTX = None


def context():
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["tests.reliability.writer"])
    return _CTX


def pool_cfg(root: Path, durability: str, capacity: int = 64 << 20, memory: bool = True, **extra) -> dict:
    devices = [{"type": "extent", "path": str(root / "disk.img"), "capacity": capacity, "bandwidth": 2 << 30,
                "zero_fill": False, "direct": writer_direct(root)},
               {"type": "files", "path": str(root / "files"), "capacity": capacity, "bandwidth": 1 << 30,
                "drop_cache": False}]
    if memory:
        devices.insert(0, {"type": "memory", "path": str(root / "shm"), "capacity": capacity, "bandwidth": 4 << 30})
    return {"index_dir": str(root / "idx"), "durability": durability, "chunk_tokens": 16,
            "checkpoint_interval_s": 0.05, "wal_compact_bytes": 16 * 64, "devices": devices, **extra}


def writer_direct(root: Path) -> bool:
    root.mkdir(parents=True, exist_ok=True)
    probe = root / ".odirect"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def check(cfg: dict, written: list[int], acked: list[int], damaged: set[bytes] = frozenset(),
          intact: list[int] | None = None) -> Trial:
    """Reopen (recovery), fsck without repair, read every key ever written. ``intact``: batches whose records were
    all stored and not damaged (default: the acknowledged ones)."""
    t = Trial("", acked=len(acked) * BATCH)
    intact = acked if intact is None else intact
    try:
        pool = _open_after_exit(cfg)
    except (KVFlowError, OSError) as err:          # what can a user still read? (counted, but not clean)
        t.fsck_clean = False
        t.note = f"reopen failed: {err}"
        try:
            pool = KVPool.open(cfg, readonly=True)
        except (KVFlowError, OSError):
            t.acked_lost = len(acked) * BATCH
            t.intact_lost = sum(1 for b in intact for k in batch_keys(b) if k.digest not in damaged)
            return t
        t.note += " (counted through a read-only open)"
    with pool:
        st = pool.stats()
        report = pool.fsck(repair=False)
        unexpected = [b for b in report["bad"] if bytes.fromhex(b["key"]) not in damaged]   # fsck finding the
        t.fsck_clean = (t.fsck_clean and not unexpected and not report["overlaps"]          # damage is right
                        and not st.get("recovery_conflicts"))
        if unexpected or report["overlaps"] or st.get("recovery_conflicts"):
            t.note = (f"fsck: {len(unexpected)} bad, {report['overlaps']} overlaps, "
                      f"{st.get('recovery_conflicts', 0)} conflicts")
        keys = [k for b in sorted(set(written) | set(acked)) for k in batch_keys(b)]
        got = pool.get_many(keys)
        t.wrong_served = sum(1 for k in keys if got[k] is not None and not torch.equal(got[k], record_for(k)))
        t.acked_lost = sum(1 for b in acked for k in batch_keys(b) if got[k] is None)
        t.intact_lost = sum(1 for b in intact for k in batch_keys(b) if got[k] is None and k.digest not in damaged)
    return t


def _open_after_exit(cfg: dict) -> KVPool:
    """Open for writing; a killed writer's locks are released during its exit, which the parent can observe a
    moment early (the exit closes its fds one by one): retry that, and only that, for up to a second."""
    for attempt in range(20):
        try:
            return KVPool.open(cfg)
        except KVFlowError as err:
            if "another process" not in str(err) and "in use by another" not in str(err) or attempt == 19:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


# -- (a) kill -9 ---------------------------------------------------------------------------------------------
def kill_trials(root: Path, durability: str, trials: int, seed: int, per_pool: int = 4) -> list[Trial]:
    ctx, rng, out = context(), random.Random(seed), []
    for t in range(trials):
        if t % per_pool == 0:
            cfg = pool_cfg(root / f"kill-{durability}-{t}", durability)
            written, all_acked = [], []
        ack = root / f"kill-{durability}-ack{t}"
        first = t * 1000
        p = ctx.Process(target=writer.write_forever, args=(cfg, str(ack), first, 999))
        p.start()
        if rng.random() < 0.25:                           # while it opens: recovery, checkpoint, first puts
            time.sleep(rng.uniform(0, 0.05))
        else:                                             # after a random number of acknowledged puts, mid-put
            target, deadline = rng.randrange(1, 150), time.monotonic() + 20
            while _lines(ack) < target and time.monotonic() < deadline and p.is_alive():
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 0.002))
        p.kill()
        p.join()
        got, closed, _ = parse_acks(ack)
        written += list(range(first, (max(got) + 2) if got else first + 1))
        all_acked += list(got)
        trial = check(cfg, written, all_acked)
        trial.kind = f"kill-{durability}"
        trial.note = (trial.note + ("; writer finished before the kill" if closed else "")).strip("; ")
        out.append(trial)
        if t % per_pool == per_pool - 1:
            shutil.rmtree(root / f"kill-{durability}-{t - per_pool + 1}", ignore_errors=True)
    return out


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


# -- loop devices -------------------------------------------------------------------------------------------------
def can_mount() -> str | None:
    """None when loop devices and ext4 mounts work here, else why not."""
    if os.geteuid() != 0:
        return "not root: loop devices and mounts need root"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control"
    return None


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@dataclass
class Ext4:
    image: Path
    mnt: Path
    dev: str = ""

    def mount(self) -> None:
        _run("mount", "-t", "ext4", self.dev, str(self.mnt))

    def umount(self) -> None:
        subprocess.run(["umount", str(self.mnt)], capture_output=True)
        if os.path.ismount(self.mnt):
            subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)

    def shutdown(self) -> None:
        """Cut the power: the file system stops at once, its journal not flushed (NOLOGFLUSH); every later I/O
        fails with EIO. What the loop device already received survives, as on a disk."""
        fd = os.open(self.mnt, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, FS_IOC_SHUTDOWN, struct.pack("I", FS_SHUTDOWN_FLAG_NOLOGFLUSH))
        finally:
            os.close(fd)

    def free_bytes(self) -> int:
        st = os.statvfs(self.mnt)
        return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def ext4(folder: Path, size_mb: int):
    """An ext4 file system on a loop device over a sparse image in ``folder``, mounted; always torn down."""
    folder.mkdir(parents=True, exist_ok=True)
    fs = Ext4(folder / "fs.img", folder / "mnt")
    fs.mnt.mkdir(exist_ok=True)
    with open(fs.image, "wb") as f:
        f.truncate(size_mb << 20)
    try:
        fs.dev = _run("losetup", "-f", "--show", str(fs.image))
        _run("mkfs.ext4", "-q", "-F", "-E", "nodiscard", fs.dev)
        fs.mount()
        yield fs
    finally:
        fs.umount()
        if fs.dev:
            subprocess.run(["losetup", "-d", fs.dev], capture_output=True)
        fs.image.unlink(missing_ok=True)


# -- (b) power cuts -------------------------------------------------------------------------------------------
PC_INTERVAL_S = 0.1      # checkpoint_interval_s of the power-cut writers


def power_cut_trials(root: Path, durability: str, trials: int, seed: int, evicting: bool = False,
                     after_close: bool = False) -> list[Trial]:
    """``evicting``: devices of 96 pages, so every put evicts (acknowledged records may legitimately be gone;
    what is served must be right and fsck clean). ``after_close``: the writer stores 1-200 batches and closes the
    pool cleanly, then the power is cut: nothing acknowledged may be lost (relaxed included).

    Relaxed: a record acknowledged before the last completed sync pass began (``KVPool.synced_at``, reported by
    the writer with each acknowledgement) must survive; younger ones may be lost. ``horizon_s`` is how long before
    the cut that pass began (the interval plus one pass, give or take scheduling)."""
    ctx, rng, out = context(), random.Random(seed), []
    kind = f"powercut-{durability}" + ("-evicting" if evicting else "") + ("-after-close" if after_close else "")
    for t in range(trials):
        with ext4(root / f"{kind}-{t}", 160) as fs:
            cfg = pool_cfg(fs.mnt / "pool", durability, capacity=96 * 4096 if evicting else 24 << 20,
                           memory=False, checkpoint_interval_s=PC_INTERVAL_S)
            ack = root / f"{kind}-ack{t}"
            p = ctx.Process(target=writer.write_forever,
                            args=(cfg, str(ack), 0, rng.randrange(1, 200) if after_close else 999))
            p.start()
            if after_close:
                p.join(120)
            else:
                target, deadline = rng.randrange(1, 200), time.monotonic() + 30
                while _lines(ack) < target and time.monotonic() < deadline and p.is_alive():
                    time.sleep(0.001)
                time.sleep(rng.uniform(0, 0.003) if rng.random() < 0.5 else rng.uniform(0, 0.6))
                os.kill(p.pid, signal.SIGSTOP)           # the instant of the cut: nothing after it is acknowledged
            cut = time.time()
            got, closed, _ = parse_acks(ack)
            synced_at, longest = last_sync(ack)
            fs.shutdown()
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
            fs.umount()
            fs.mount()                                   # journal replay, as after a reboot
            written = list(range(0, (max(got) + 2) if got else 1))
            if durability == "strict" or after_close:
                trial = check(cfg, written, list(got))
                if after_close and not closed:
                    trial.note = ("the writer did not close; " + trial.note).strip("; ")
                    trial.fsck_clean = False
            else:                                        # relaxed: what was acknowledged before the last sync pass
                synced = [b for b, ts in got.items() if ts < synced_at]
                trial = check(cfg, written, list(got), intact=synced)
                trial.bounded_lost = trial.intact_lost
                trial.oldest_lost_s = round(max([cut - got[b] for b in _lost_batches(cfg, got)], default=0.0), 3)
                trial.horizon_s = round(cut - synced_at, 3) if synced_at else 0.0
                trial.sync_pass_max_s = round(longest, 3)
            trial.kind = kind
            out.append(trial)
    return out


def _lost_batches(cfg: dict, acked: dict[int, float]) -> list[int]:
    with KVPool.open(cfg, readonly=True) as pool:
        got = pool.contains([k for b in acked for k in batch_keys(b)])
    keys_per = BATCH
    return [b for i, b in enumerate(acked) if not all(got[i * keys_per:(i + 1) * keys_per])]


# -- (c) corruption matrix ------------------------------------------------------------------------------------
DAMAGES = ("payload-bitflip", "header-bitflip", "zeroed-page", "truncated-extent", "swapped-records",
           "checkpoint-bitflip", "wal-bitflip", "manifest-garbage", "superblock-zeroed", "index-deleted",
           "record-file-deleted", "memory-page-zeroed", "checkpoint-deleted", "wal-deleted", "wal-first-page-zeroed",
           "manifest-device-id-changed", "checkpoint-deleted-then-puts", "wal-deleted-then-puts")
LATE_PUTS = 40          # "-then-puts": batches put after the damage, before the check (they reuse freed extents)


def _built_pool(root: Path, batches: int = 15) -> tuple[dict, list[tuple]]:
    """A pool (memory file + extent + files) with records in its checkpoint and its log, left as after a crash.
    Returns its config and rows (digest, device, offset, length, seq)."""
    cfg = pool_cfg(root, "strict", capacity=8 << 20, checkpoint_interval_s=3600, wal_compact_bytes=64 << 20)
    done = root / "built"
    p = context().Process(target=writer.build, args=(cfg, batches, batches // 2, str(done)))
    p.start()
    p.join()
    assert done.exists(), "the builder failed"
    with KVPool.open({**cfg, "checkpoint_interval_s": 3600}, readonly=True) as pool:
        rows = pool.entries()
    return cfg, rows


def _flip(path: Path, pos: int) -> None:
    flip_byte(path, pos, 0x10)


def _zero(path: Path, pos: int, n: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(b"\0" * n)


def damage(kind: str, cfg: dict, rows: list[tuple], rng: random.Random) -> set[bytes]:
    """Apply one damage; returns the digests of records whose own bytes were damaged (allowed to disappear)."""
    devs = cfg["devices"]
    index = {d["type"]: i for i, d in enumerate(devs)}
    on = {name: [r for r in rows if r[1] == i] for name, i in index.items()}
    idx = Path(cfg["index_dir"])
    extent, files, memory = Path(devs[index["extent"]]["path"]), Path(devs[index["files"]]["path"]), None
    if "memory" in index:
        memory = Path(devs[index["memory"]]["path"])
    sb = 4096
    if kind in ("payload-bitflip", "header-bitflip"):
        d, _, off, n, _ = rng.choice(on["extent"])
        pos = sb + off + (rng.randrange(128, n) if kind == "payload-bitflip" else rng.randrange(0, 128))
        _flip(extent, pos)
        return {d}
    if kind == "zeroed-page":
        d, _, off, n, _ = rng.choice(on["extent"])
        _zero(extent, sb + off, 4096)
        return {r[0] for r in on["extent"] if r[2] < off + 4096 and off < r[2] + n}
    if kind == "memory-page-zeroed":
        d, _, off, n, _ = rng.choice(on["memory"])
        _zero(memory, sb + off, 4096)
        return {d}
    if kind == "truncated-extent":
        cut = max(r[2] + r[3] for r in on["extent"]) // 2
        with open(extent, "r+b") as f:
            f.truncate(sb + cut)
        return {r[0] for r in on["extent"] if r[2] + r[3] > cut}
    if kind == "swapped-records":
        same = {}
        for r in on["extent"]:
            same.setdefault(r[3], []).append(r)
        a, b = rng.sample(max(same.values(), key=len), 2)
        with open(extent, "r+b") as f:
            f.seek(sb + a[2])
            da = f.read(a[3])
            f.seek(sb + b[2])
            db = f.read(b[3])
            f.seek(sb + a[2])
            f.write(db)
            f.seek(sb + b[2])
            f.write(da)
        return {a[0], b[0]}
    if kind == "checkpoint-bitflip":
        path = idx / "checkpoint"
        _flip(path, rng.randrange(40, path.stat().st_size - 8))
        return set()
    if kind == "wal-bitflip":
        wals = sorted(p for p in idx.glob("wal.*") if p.stat().st_size >= 3 * 64)
        path = wals[-1]
        entries = path.stat().st_size // 64
        _flip(path, 64 * (entries // 2) + rng.randrange(0, 56))
        return set()
    if kind == "manifest-garbage":
        (idx / "manifest.json").write_text('{"devices": [oops')
        return set()
    if kind == "superblock-zeroed":
        _zero(extent, 0, 4096)
        return set()
    if kind == "index-deleted":
        shutil.rmtree(idx)
        return set()
    if kind == "checkpoint-deleted":
        (idx / "checkpoint").unlink()
        return set()
    if kind == "wal-deleted":
        for path in idx.glob("wal.*"):
            path.unlink()
        return set()
    if kind == "wal-first-page-zeroed":
        path = max(idx.glob("wal.*"), key=lambda p: p.stat().st_size)
        _zero(path, 0, min(4096, path.stat().st_size))
        return set()
    if kind == "manifest-device-id-changed":
        manifest = json.loads((idx / "manifest.json").read_text())
        top = max(d["id"] for d in manifest["devices"])
        for d in manifest["devices"]:
            if d["name"].startswith("extent:"):
                d["id"] = top + 1
        (idx / "manifest.json").write_text(json.dumps(manifest))
        return set()
    if kind == "record-file-deleted":
        d, _, off, n, _ = rng.choice(on["files"])
        (files / f"{(off >> 12) & 0xff:02x}" / f"{off:x}.kvr").unlink()
        return {d}
    raise ValueError(kind)


def corruption_trials(root: Path, repeats: int, seed: int, kinds=DAMAGES) -> list[Trial]:
    rng, out = random.Random(seed), []
    batches = 15
    for r in range(repeats):
        for kind in kinds:
            folder = root / f"corrupt-{kind}-{r}"
            cfg, rows = _built_pool(folder, batches)
            damaged = damage(kind.removesuffix("-then-puts"), cfg, rows, rng)
            acked = list(range(batches))
            if kind.endswith("-then-puts"):        # new puts before anyone looks: a late --rebuild must still work
                late = list(range(1000, 1000 + LATE_PUTS))
                with KVPool.open(cfg) as pool:
                    for b in late:
                        pool.put_many({k: record_for(k) for k in batch_keys(b)})
                acked += late
            trial = check(cfg, acked, acked, damaged)
            trial.kind = f"corrupt-{kind}"
            trial.acked_lost = trial.intact_lost        # every record was acknowledged; damaged ones may go
            out.append(trial)
            shutil.rmtree(folder, ignore_errors=True)
    return out


# -- (d) two pools on one device ---------------------------------------------------------------------------
def two_pool_trials(root: Path, repeats: int) -> list[Trial]:
    out = []
    for r in range(repeats):
        folder = root / f"two-{r}"
        a = pool_cfg(folder, "strict", capacity=8 << 20, memory=False)
        b = {**a, "index_dir": str(folder / "idx-b"), "devices": [dict(a["devices"][0])]}
        acked_a, acked_b, note = list(range(0, 10)), [], ""
        with KVPool.open(a) as pa:
            for i in acked_a:
                pa.put_many({k: record_for(k) for k in batch_keys(i)})
        try:
            with KVPool.open(b) as pb:
                acked_b = list(range(100, 110))
                for i in acked_b:
                    pb.put_many({k: record_for(k) for k in batch_keys(i)})
            note = "the second pool opened the first one's device"
        except KVFlowError as err:
            note = f"refused: {err}"
        ta = check(a, acked_a, acked_a)
        tb = check(b, acked_b, acked_b) if acked_b else Trial("")
        out.append(Trial("two-pools", ta.acked_lost + tb.acked_lost, ta.wrong_served + tb.wrong_served,
                         ta.intact_lost + tb.intact_lost, ta.fsck_clean and tb.fsck_clean,
                         (len(acked_a) + len(acked_b)) * BATCH, note[:200]))
        shutil.rmtree(folder, ignore_errors=True)
    return out


# -- (e) ENOSPC and EIO -------------------------------------------------------------------------------------------
def enospc_trials(root: Path, repeats: int) -> list[Trial]:
    out = []
    for r in range(repeats):
        with ext4(root / f"enospc-{r}", 32) as fs:                      # ~28 MiB free
            cfg = pool_cfg(fs.mnt / "big", "strict", capacity=256 << 20, memory=False)
            cfg["devices"][0]["zero_fill"] = True
            free_before = fs.free_bytes()
            try:
                with KVPool.open(cfg):
                    pass
                note = "a capacity 9x the free space was accepted"
            except KVFlowError as err:
                note = f"refused: {str(err)[:160]}"
            left = fs.free_bytes()
            t = Trial("enospc-init", note=f"{note}; free after {left >> 20} of {free_before >> 20} MiB")
            t.fsck_clean = left >= free_before // 2          # a refused init must not leave the disk full
            out.append(t)
            shutil.rmtree(fs.mnt / "big", ignore_errors=True)
            # puts into a sparse extent file whose file system another file then fills: every acknowledged put
            # must be readable, and the pool must open again on the full disk
            cfg = pool_cfg(fs.mnt / "sparse", "strict", capacity=16 << 20, memory=False)
            cfg["devices"] = [cfg["devices"][0]]
            with KVPool.open(cfg):
                pass
            filler = os.open(fs.mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(filler, 0, max(fs.free_bytes() - (2 << 20), 4096))
            finally:
                os.close(filler)
            ack = root / f"enospc-ack{r}"
            p = context().Process(target=writer.write_forever, args=(cfg, str(ack), 0, 3000))
            p.start()
            p.join(120)
            if p.is_alive():
                p.kill()
                p.join()
            got, closed, errors = parse_acks(ack)
            fs.umount()
            fs.mount()
            written = list(range(0, (max(got) + 2) if got else 1))
            t = check({**cfg, "checkpoint_interval_s": 3600}, written, list(got))
            t.kind = "enospc-put"
            t.note = (f"{len(got)} batches acknowledged, {len(errors)} refused" +
                      (f" ({errors[0][:120]})" if errors else "") + (f"; {t.note}" if t.note else ""))
            out.append(t)
    return out


def eio_trials(root: Path, repeats: int, seed: int) -> list[Trial]:
    """The disk fails under a running strict writer: puts after the failure must raise, never be acknowledged."""
    ctx, rng, out = context(), random.Random(seed), []
    for r in range(repeats):
        with ext4(root / f"eio-{r}", 160) as fs:
            cfg = pool_cfg(fs.mnt / "pool", "strict", capacity=24 << 20, memory=False)
            ack = root / f"eio-ack{r}"
            p = ctx.Process(target=writer.write_forever, args=(cfg, str(ack), 0, 999))
            p.start()
            target, deadline = rng.randrange(5, 100), time.monotonic() + 30
            while _lines(ack) < target and time.monotonic() < deadline and p.is_alive():
                time.sleep(0.001)
            fs.shutdown()                                 # the writer keeps running: every I/O now fails
            time.sleep(0.3)
            p.kill()
            p.join()
            got, _, errors = parse_acks(ack)
            fs.umount()
            fs.mount()
            written = list(range(0, (max(got) + 2) if got else 1))
            t = check(cfg, written, list(got))
            t.kind = "eio"
            t.note = f"{len(errors)} puts raised or were partial after the failure" + (f"; {t.note}" if t.note else "")
            out.append(t)
    return out


# -- (f) admin commands, shared index folders, a full device, close racing puts (issue 37) ----------------------
ADMIN = ("force-init-live-writer", "force-init-refused-late", "force-init-ordinary-file", "shared-index-dir",
         "empty-index-dir", "enospc-one-put", "close-racing-put", "signature-block-device")


def _init(cfg: dict, folder: Path, force: bool) -> tuple[int, str]:
    """``kvflow pool init [--force]`` on ``cfg`` written as a YAML file, in a child (its exit code, stderr)."""
    import yaml
    path = folder / "kvflow.yaml"
    path.write_text(yaml.safe_dump({"pool": cfg}))
    done = subprocess.run([sys.executable, "-m", "kvflow", "pool", "init", str(path), *(["--force"] * force)],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stderr


def _refused(rc: int, err: str, t: Trial, what: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    if rc != 2 or len(lines) != 1 or "Traceback" in err:
        t.fsck_clean = False
        t.note = f"{what}: rc {rc}, {len(lines)} stderr lines: {err.strip()[-160:]}"
    else:
        t.note = f"refused: {lines[0][:160]}"


def _stored(cfg: dict, batches: list[int]) -> None:
    with KVPool.open(cfg) as pool:
        for b in batches:
            assert pool.put_many({k: record_for(k) for k in batch_keys(b)}) == BATCH


def admin_trials(root: Path, repeats: int, kinds=ADMIN) -> list[Trial]:
    out = []
    for r in range(repeats):
        for kind in kinds:
            folder = root / f"{kind}-{r}"
            folder.mkdir(parents=True, exist_ok=True)
            try:
                t = _ADMIN[kind](folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            if t is not None:
                t.kind = kind
                out.append(t)
    return out


def _force_init_live_writer(folder: Path) -> Trial:
    """``init --force`` while a strict writer has the pool open: refused, and every acknowledged put survives."""
    cfg = pool_cfg(folder, "strict", capacity=512 << 20, memory=False)     # sparse, and never full: no eviction
    ack = folder / "ack"
    p = context().Process(target=writer.write_forever, args=(cfg, str(ack), 0, 100_000))
    p.start()
    deadline = time.monotonic() + 30
    while _lines(ack) < 20 and time.monotonic() < deadline and p.is_alive():
        time.sleep(0.01)
    rc, err = _init(cfg, folder, force=True)
    p.kill()
    p.join()
    got, _, _ = parse_acks(ack)
    t = check(cfg, list(range(max(got, default=0) + 2)), list(got))
    _refused(rc, err, t, "init --force beside a live writer")
    return t


def _force_init_refused_late(folder: Path) -> Trial:
    """A config refused for its last entry (a files folder with other files; an index_dir with other files):
    nothing it names is deleted first."""
    cfg = pool_cfg(folder, "strict", capacity=8 << 20, memory=False)
    batches = list(range(10))
    _stored(cfg, batches)
    t = Trial("")
    for spoil in ("files", "index"):
        bad = dict(cfg)
        if spoil == "files":
            other = folder / "other-files"
            other.mkdir(exist_ok=True)
            (other / "notes.txt").write_text("mine")
            bad["devices"] = [cfg["devices"][0], {**cfg["devices"][1], "path": str(other)}]
        else:
            (Path(cfg["index_dir"]) / "notes.txt").write_text("mine")
        rc, err = _init(bad, folder, force=True)
        _refused(rc, err, t, f"init --force with a spoilt {spoil}")
        if spoil == "index":
            (Path(cfg["index_dir"]) / "notes.txt").unlink()
    found = check(cfg, batches, batches)
    found.fsck_clean &= t.fsck_clean
    found.note = t.note if t.fsck_clean else t.note + "; " + found.note
    return found


def _force_init_ordinary_file(folder: Path) -> Trial:
    """An ordinary file named as an extent: refused with and without --force, its bytes unchanged."""
    cfg = pool_cfg(folder, "strict", capacity=8 << 20, memory=False)
    data = b"important notes\n" * 1000
    Path(cfg["devices"][0]["path"]).write_bytes(data)
    t = Trial("", acked=1)
    for force in (False, True):
        rc, err = _init(cfg, folder, force)
        _refused(rc, err, t, f"init{' --force' if force else ''} on an ordinary file")
        if "--force" in err.replace("--force formats", ""):
            t.fsck_clean, t.note = False, f"the refusal suggests --force: {err.strip()[:160]}"
    if Path(cfg["devices"][0]["path"]).read_bytes() != data:
        t.intact_lost = t.acked_lost = 1
    return t


def _shared_index_dir(folder: Path) -> Trial:
    """A second config with the same index_dir and other devices is refused; the first pool loses nothing."""
    a = pool_cfg(folder / "a", "strict", capacity=8 << 20, memory=False)
    b = pool_cfg(folder / "b", "strict", capacity=8 << 20, memory=False)
    b["index_dir"] = a["index_dir"]
    batches = list(range(30))
    _stored(a, batches)
    t = Trial("")
    try:
        with KVPool.open(b) as pool:
            pool.put_many({k: record_for(k) for k in batch_keys(500)})
        t.fsck_clean, t.note = False, "the second config opened the first pool's index"
    except KVFlowError as err:
        t.note = f"refused: {str(err)[:160]}"
    found = check(a, batches, batches)
    found.fsck_clean &= t.fsck_clean
    found.note = t.note
    return found


def _empty_index_dir(folder: Path) -> Trial:
    """index_dir "", "." and KVFLOW_POOL_INDEX_DIR= are errors, never the config's own folder."""
    t = Trial("")
    cfg = pool_cfg(folder, "strict", capacity=8 << 20, memory=False)
    for value in ("", ".", "env"):
        env = {**os.environ, "KVFLOW_POOL_INDEX_DIR": ""} if value == "env" else None
        bad = cfg if value == "env" else {**cfg, "index_dir": value}
        import yaml
        path = folder / "kvflow.yaml"
        path.write_text(yaml.safe_dump({"pool": bad}))
        done = subprocess.run([sys.executable, "-m", "kvflow", "pool", "init", str(path)], capture_output=True,
                              text=True, timeout=120, env=env)
        _refused(done.returncode, done.stderr, t, f"index_dir {value!r}")
        if not t.fsck_clean:
            break
    return t


def _enospc_one_put(folder: Path) -> Trial:
    """ENOSPC on one put (fault injected at the device): that put fails; the device stays in service and every
    record stored before is still served."""
    import errno
    cfg = pool_cfg(folder, "strict", capacity=8 << 20, memory=False)
    cfg["devices"] = [cfg["devices"][0]]
    batches = list(range(20))
    t = Trial("", acked=len(batches) * BATCH)
    with KVPool.open(cfg) as pool:
        for b in batches:
            pool.put_many({k: record_for(k) for k in batch_keys(b)})
        device = pool.slots[0].device.inner
        real = device.commit

        def full(offset, buf):
            raise OSError(errno.ENOSPC, "No space left on device")
        device.commit = full
        try:
            pool.put_many({k: record_for(k) for k in batch_keys(999)})
            t.note = "a put on a full device was acknowledged"
            t.fsck_clean = False
        except KVFlowError as err:
            t.note = f"the put raised: {str(err)[:120]}"
        finally:
            device.commit = real
        keys = [k for b in batches for k in batch_keys(b)]
        got = pool.get_many(keys)
        t.intact_lost = t.acked_lost = sum(v is None for v in got.values())
        t.wrong_served = sum(1 for k in keys if got[k] is not None and not torch.equal(got[k], record_for(k)))
        if not pool.stats()["devices"][0]["healthy"]:
            t.fsck_clean, t.note = False, "the device was taken out of service"
    return t


def _close_racing_put(folder: Path) -> Trial:
    """close() while threads put: each put is stored or refused with a KVFlowError, never a raw error; every
    acknowledged put survives the reopen."""
    import threading
    cfg = pool_cfg(folder, "strict", capacity=16 << 20, memory=False)
    pool = KVPool.open(cfg)
    acked, raw, lock = [], [], threading.Lock()

    def put(first: int) -> None:
        for b in range(first, first + 50):
            try:
                if pool.put_many({k: record_for(k) for k in batch_keys(b)}) == BATCH:
                    with lock:
                        acked.append(b)
            except KVFlowError:
                return
            except Exception as err:  # noqa: BLE001 — what the trial is looking for
                raw.append(f"{type(err).__name__}: {err}")
                return
    threads = [threading.Thread(target=put, args=(i * 100,)) for i in range(3)]
    for th in threads:
        th.start()
    time.sleep(random.uniform(0.01, 0.2))
    pool.close()
    for th in threads:
        th.join()
    t = check(cfg, [b for i in range(3) for b in range(i * 100, i * 100 + 50)], acked)
    if raw:
        t.fsck_clean, t.note = False, f"raw error: {raw[0][:160]}"
    return t


def _signature_block_device(folder: Path) -> Trial | None:
    """A block device whose first page is zero but which carries a btrfs signature at 64 KiB: init refuses it and
    writes nothing. Skipped (no trial) without root and loop devices."""
    if os.geteuid() != 0 or not shutil.which("losetup"):
        return None
    img = folder / "fs.img"
    with open(img, "wb") as f:
        f.truncate(32 << 20)
        f.seek(65536 + 64)
        f.write(b"_BHRfS_M")
    before = img.read_bytes()
    try:
        loop = _run("losetup", "-f", "--show", str(img)).strip()
    except (OSError, subprocess.SubprocessError):
        return None
    t = Trial("", acked=1)
    try:
        cfg = {"index_dir": str(folder / "idx"), "chunk_tokens": 16,
               "devices": [{"type": "extent", "path": loop, "bandwidth": "1G", "direct": False}]}
        for force in (False, True):
            rc, err = _init(cfg, folder, force)
            _refused(rc, err, t, f"init{' --force' if force else ''} on a block device with a btrfs signature")
    finally:
        subprocess.run(["losetup", "-d", loop], check=False, timeout=20)
    if img.read_bytes() != before:
        t.acked_lost = t.intact_lost = 1
    return t


_ADMIN = {"force-init-live-writer": _force_init_live_writer, "force-init-refused-late": _force_init_refused_late,
          "force-init-ordinary-file": _force_init_ordinary_file, "shared-index-dir": _shared_index_dir,
          "empty-index-dir": _empty_index_dir, "enospc-one-put": _enospc_one_put,
          "close-racing-put": _close_racing_put, "signature-block-device": _signature_block_device}


# -- the campaign ---------------------------------------------------------------------------------------------
def passed(t: Trial) -> bool:
    """The acceptance of issue 10 for one trial: never a wrong record, fsck clean after recovery; strict (and
    every crash, which keeps the page cache) loses no acknowledged put; relaxed power cuts lose nothing acknowledged
    before the last completed sync pass began (and nothing after a clean close); damage takes only the damaged records; a refused init leaves the disk usable."""
    if t.wrong_served or not t.fsck_clean:
        return False
    if t.kind == "powercut-relaxed":
        return t.bounded_lost == 0
    if t.kind.endswith("-evicting"):
        return True
    if t.kind == "enospc-init":
        return t.note.startswith("refused")
    return t.acked_lost == 0 and t.intact_lost == 0


def summarize(trials: list[Trial]) -> list[dict]:
    kinds: dict[str, list[Trial]] = {}
    for t in trials:
        kinds.setdefault(t.kind, []).append(t)
    return [{"kind": k, "trials": len(ts), "acked_puts_lost": sum(t.acked_lost for t in ts),
             "wrong_served": sum(t.wrong_served for t in ts), "intact_lost": sum(t.intact_lost for t in ts),
             "fsck_clean": sum(t.fsck_clean for t in ts), "passed": sum(passed(t) for t in ts),
             "acked_records": sum(t.acked for t in ts),
             "relaxed_lost_before_last_sync": sum(t.bounded_lost for t in ts),
             "oldest_lost_s": max(t.oldest_lost_s for t in ts), "horizon_max_s": max(t.horizon_s for t in ts),
             "sync_pass_max_s": max(t.sync_pass_max_s for t in ts)} for k, ts in kinds.items()]


def _kill_phase(root: Path, durability: str, kills: int, seed: int, progress) -> tuple[list[Trial], list[str]]:
    progress(f"kill -9 x {kills} ({durability})")
    return kill_trials(root, durability, kills, seed), []


def _disk_phase(root: Path, power_cuts: int, corruption_repeats: int, seed: int,
                progress) -> tuple[list[Trial], list[str]]:
    trials: list[Trial] = []
    notes: list[str] = []
    progress(f"corruption matrix x {corruption_repeats}")
    trials += corruption_trials(root, corruption_repeats, seed)
    progress("two pools on one device")
    trials += two_pool_trials(root, max(1, corruption_repeats))
    progress("admin commands, shared index folders, a full device, close racing puts")
    trials += admin_trials(root, max(1, corruption_repeats))
    why = can_mount()
    if why:
        return trials, [f"power cuts, ENOSPC and EIO skipped: {why}"]
    for durability in ("strict", "relaxed"):
        progress(f"power cuts x {power_cuts} ({durability})")
        trials += power_cut_trials(root, durability, power_cuts, seed + 7)
    progress(f"power cuts x {max(2, power_cuts // 5)} (strict, evicting) and after a clean close (relaxed)")
    trials += power_cut_trials(root, "strict", max(2, power_cuts // 5), seed + 9, evicting=True)
    trials += power_cut_trials(root, "relaxed", max(2, power_cuts // 5), seed + 11, after_close=True)
    progress("ENOSPC and EIO")
    trials += enospc_trials(root, max(1, corruption_repeats))
    trials += eio_trials(root, max(1, corruption_repeats), seed)
    notes.append("dm-error / dm-flakey: " + ("used" if os.path.exists("/dev/mapper/control") and _has_dm() else
                                            "no device-mapper in this kernel; EIO comes from a file-system shutdown"))
    return trials, notes


def run(kills: int, power_cuts: int, corruption_repeats: int, seed: int = 0, root: Path | None = None,
        progress=print, jobs: int = 1) -> dict:
    """Three phases — kill -9 strict, kill -9 relaxed, everything on disk — one after the other, or with ``jobs``
    > 1 in that many forked processes side by side (each phase has its own folders; the trials are the same)."""
    own = root is None
    root = Path(tempfile.mkdtemp(prefix="kvflow-reliability-", dir="/var/tmp")) if own else root
    phases = [(_kill_phase, (root, "strict", kills, seed)), (_kill_phase, (root, "relaxed", kills, seed + 1)),
              (_disk_phase, (root, power_cuts, corruption_repeats, seed))]
    t0 = time.time()
    try:
        if jobs <= 1:
            results = [fn(*args, progress) for fn, args in phases]
        else:
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as ex:
                futures = [ex.submit(fn, *args, _say) for fn, args in phases]
                results = [f.result() for f in futures]
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    trials = [t for phase, _ in results for t in phase]
    return {"seed": seed, "kills": kills, "power_cuts": power_cuts, "corruption_repeats": corruption_repeats,
            "jobs": jobs, "seconds": round(time.time() - t0, 1), "notes": [n for _, notes in results for n in notes],
            "summary": summarize(trials), "trials": [asdict(t) for t in trials]}


def _say(message: str) -> None:
    print(f"... {message}", flush=True)


def _has_dm() -> bool:
    return subprocess.run(["dmsetup", "version"], capture_output=True).returncode == 0


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=_count, default=500, help="kill -9 trials per durability mode (strict, relaxed)")
    ap.add_argument("--power-cuts", type=_count, default=50, help="power cuts per durability mode (strict, relaxed)")
    ap.add_argument("--corruption-repeats", type=_count, default=3)
    ap.add_argument("--jobs", type=_count, default=1, help="run the three phases (kill strict, kill relaxed, disk) "
                                                         "in this many processes side by side")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--check", action="store_true", help="exit 1 when any trial fails its acceptance")
    args = ap.parse_args()
    result = run(args.kills, args.power_cuts, args.corruption_repeats, args.seed, progress=_say, jobs=args.jobs)
    cols = ("kind", "trials", "acked_puts_lost", "wrong_served", "intact_lost", "fsck_clean", "passed",
            "relaxed_lost_before_last_sync", "oldest_lost_s", "horizon_max_s", "sync_pass_max_s")
    print(" | ".join(cols))
    for row in result["summary"]:
        print(" | ".join(str(row[c]) for c in cols))
    for note in result["notes"]:
        print(note)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    failed = sum(r["trials"] - r["passed"] for r in result["summary"])
    print(f"{failed} of {len(result['trials'])} trials failed their acceptance")
    if args.check and failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
