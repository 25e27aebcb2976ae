"""``kvflow pool init --force``: remove what a pool config names so ``init`` creates it anew — in two phases, so a
refusal never leaves half a pool deleted:

    plan(cfg)   every device and the index folder checked, and every writer lock taken (index ``lock``, each extent
                and files device): a live writer, a file kvflow did not make, a block device carrying a file system
                or partition signature, a folder with other files — one ConfigError, nothing touched
    run()       while those locks are held: extent / memory files unlinked, a block device's superblocks zeroed,
                files-device folders and the index folder removed

``--force`` overrides a device's *ownership* (another pool's, or one whose index is gone); it never overrides a
running writer, and never formats what is not a kvflow device or empty.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvflow.errors import ConfigError
from kvflow.pool.config import PoolConfig
from kvflow.pool.devices.base import SUPERBLOCK, file_size, flock_writer
from kvflow.pool.devices.signatures import is_kvflow_device, looks_like_data

_INDEX_FILES = ("manifest.json", "checkpoint", "lock", "wal.")
_MARKER = ".kvflow-device"


def _busy(what: str) -> ConfigError:
    return ConfigError(f"{what} is open for writing by a running kvflow process; --force formats only an idle pool "
                       f"(stop that process first)")


@dataclass
class Format:
    steps: list[Callable[[], None]] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)     # writer locks held from plan() until run() ends

    def lock(self, path: str, what: str, flags: int = os.O_RDONLY) -> int:
        fd = os.open(path, flags)
        self.fds.append(fd)
        if not flock_writer(fd, wait_s=0.2):
            raise _busy(what)
        return fd

    def run(self) -> None:
        try:
            for step in self.steps:
                step()
        finally:
            self.release()

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def plan(cfg: PoolConfig) -> Format:
    """Check everything ``--force`` would remove, holding every writer lock; raises ConfigError (locks released)
    when anything is refused. Run the result with ``.run()``."""
    fmt = Format()
    try:
        _plan_index(cfg, fmt)
        for dev in cfg.devices:
            if dev.path is not None and os.path.lexists(dev.path):
                _plan_device(dev.type, Path(dev.path), fmt)
    except BaseException:
        fmt.release()
        raise
    return fmt


def _plan_index(cfg: PoolConfig, fmt: Format) -> None:
    if not cfg.index_dir or not os.path.lexists(cfg.index_dir):
        return
    idx = Path(cfg.index_dir)
    if not idx.is_dir() or idx.is_symlink():
        raise ConfigError(f"pool.index_dir {idx} is not a folder; remove it yourself")
    other = [p.name for p in idx.iterdir() if not (p.name.startswith(_INDEX_FILES) or p.name.endswith(".tmp"))]
    if other:
        raise ConfigError(f"{idx} holds other files ({other[0]}, ...), not only a kvflow index; remove it yourself")
    if (idx / "lock").exists():
        fmt.lock(str(idx / "lock"), f"pool index {idx}")
    fmt.steps.append(lambda: shutil.rmtree(idx))


def _plan_device(kind: str, path: Path, fmt: Format) -> None:
    if path.is_symlink():
        raise ConfigError(f"{path} is a symbolic link, not a regular file or a block device; --force formats only "
                          f"those")
    if kind == "files":
        if not path.is_dir():
            raise ConfigError(f"{path} is not a folder; a files device is a folder")
        if any(path.iterdir()):
            if not (path / _MARKER).is_file():
                raise ConfigError(f"{path} is a folder with other files in it, not a kvflow files device; "
                                  f"--force formats only kvflow devices — remove it yourself")
            fmt.lock(str(path / _MARKER), f"files device {path}")
        fmt.steps.append(lambda: shutil.rmtree(path))
    elif path.is_dir():
        raise ConfigError(f"{path} is a folder; a {kind} device is a file")
    elif path.is_block_device():
        fd = fmt.lock(str(path), f"block device {path}", os.O_RDWR)
        size = file_size(fd)
        if not is_kvflow_device(fd, size) and (why := looks_like_data(fd, size)):
            raise ConfigError(f"{path} is not a kvflow device and carries {why}; --force never formats what looks "
                              f"like data — wipe it yourself (wipefs -a) if it is really unused")

        def zero_superblocks() -> None:
            for at in (0, size // SUPERBLOCK * SUPERBLOCK - SUPERBLOCK):
                os.pwrite(fd, bytes(SUPERBLOCK), at)
            os.fsync(fd)
        fmt.steps.append(zero_superblocks)
    elif not path.is_file():
        raise ConfigError(f"{path} is not a regular file or a block device; --force formats only those")
    else:
        fd = fmt.lock(str(path), f"device {path}")
        size = file_size(fd)
        if size and not is_kvflow_device(fd, size):
            raise ConfigError(f"{path} is not a kvflow device (and not empty); --force formats only kvflow devices "
                              f"and empty files — remove it yourself if it is really unused")
        fmt.steps.append(lambda: path.unlink())
