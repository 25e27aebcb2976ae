"""What a block device or file already holds, before kvflow writes to it: known file system, partition table and
volume signatures anywhere in the places their tools put them (not just the first page, which btrfs and ISO 9660
leave empty), and the kvflow superblock (primary or backup).

    looks_like_data(fd, size) -> "btrfs file system at 64 KiB" | "non-zero bytes at ..." | None
"""

from __future__ import annotations

import os

from kvflow.pool.devices.base import SUPERBLOCK, parse_owner, parse_superblock

# (name, byte offset, magic): the signatures blkid / wipefs look for first, beyond kvflow's first page too
KNOWN: tuple[tuple[str, int, bytes], ...] = (
    ("ext2/3/4 file system", 1024 + 56, b"\x53\xef"),
    ("XFS file system", 0, b"XFSB"),
    ("btrfs file system", 65536 + 64, b"_BHRfS_M"),
    ("ISO 9660 image", 32768 + 1, b"CD001"),
    ("UDF image", 32768 + 1, b"BEA01"),
    ("swap space", 4096 - 10, b"SWAPSPACE2"),
    ("LUKS volume", 0, b"LUKS\xba\xbe"),
    ("LVM2 physical volume", 512 + 24, b"LVM2 001"),
    ("GPT partition table", 512, b"EFI PART"),
    ("GPT partition table (4K sectors)", 4096, b"EFI PART"),
    ("MBR / DOS partition table", 510, b"\x55\xaa"),
    ("F2FS file system", 1024, b"\x10\x20\xf5\xf2"),
    ("squashfs image", 0, b"hsqs"),
    ("ZFS label", 128 << 10, b"\x0c\xb1\xba\x00\x00\x00\x00\x00"),
    ("ReiserFS file system", 65536 + 52, b"ReIsEr"),
    ("bcache device", 4096 + 24, b"\xc6\x85\x73\xf6\x4e\x1a\x45\xca"),
)
PROBE_BYTES = 1 << 20          # the head (and tail) read: every signature above lies inside it


def _pread(fd: int, n: int, at: int) -> bytes:
    try:
        return os.pread(fd, n, at)
    except OSError:                  # O_DIRECT needs aligned buffers: reopen the path without it is the caller's
        return b""


def is_kvflow_device(fd: int, size: int) -> bool:
    """A kvflow superblock in the first page, or (its first page zeroed) a valid backup in the last."""
    head = _pread(fd, SUPERBLOCK, 0)
    if parse_superblock(head) is not None:
        return True
    last = (size // SUPERBLOCK - 1) * SUPERBLOCK
    return last >= SUPERBLOCK and parse_owner(_pread(fd, SUPERBLOCK, last)) is not None


def looks_like_data(fd: int, size: int) -> str | None:
    """Why the bytes behind ``fd`` (``size`` long, not a kvflow device) look like someone's data, or None when the
    first and last ``PROBE_BYTES`` are all zero and carry no known signature."""
    head = _pread(fd, min(PROBE_BYTES, size), 0)
    for name, at, magic in KNOWN:
        if head[at:at + len(magic)] == magic:
            return f"a {name} signature at byte {at:,}"
    tail_at = max(size - PROBE_BYTES, 0)
    tail = _pread(fd, size - tail_at, tail_at) if size > PROBE_BYTES else b""
    for where, data in ((0, head), (tail_at, tail)):
        if data.count(0) != len(data):
            return f"non-zero bytes at byte {where + len(data) - len(data.lstrip(bytes(1))):,}"
    return None
