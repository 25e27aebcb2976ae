"""Pool configuration: one ``PoolConfig`` with a list of ``DeviceConfig``, loaded from the ``pool:`` section of a
YAML/TOML file with ``KVFLOW_POOL_*`` environment overrides for its scalar fields.

    pool:
      chunk_tokens: 256
      durability: strict        # strict | relaxed
      storage_dtype: float32
      index_dir: ./kvpool       # manifest + write-ahead log + checkpoint
      devices:
        - {type: memory, capacity: 2G}
        - {type: extent, path: /mnt/nvme0/kvflow.img, capacity: 64G}
        - {type: files, path: /var/tmp/kvflow-files, capacity: 8G, bandwidth: 500M}
        - {type: extent, path: /dev/nvme1n1, throttle: 1.25G, latency_s: 0.0001}   # emulated NVMe-oF link
        - {type: remote, url: "redis://10.0.0.5:6379,10.0.0.6:6379", cluster: true}   # shared tier (Redis cluster)
      remote_placement: stripe  # stripe: remote is one more striped device | copy: local devices + a copy remotely
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvflow.config import check, load_section, read_file
from kvflow.errors import ConfigError
from kvflow.model.dtypes import TORCH
from kvflow.pool.devices.throttle import MAX_LATENCY_S

DTYPES = TORCH           # storage dtypes: model/dtypes.py's table
PLACEMENTS = ("bandwidth", "equal", "overflow")
REMOTE_PLACEMENTS = ("stripe", "copy")
MIN_CAPACITY = 4096             # one page: a device's capacity is rounded down to whole pages


@dataclass(slots=True)
class DeviceConfig:
    type: str                       # a name in kvflow.pool.devices.DEVICE_TYPES: memory | extent | files
    path: str | None = None         # memory: optional shared file (e.g. /dev/shm/kv0); extent: file or block device
    capacity: int | None = None     # bytes ("64G"); an extent on a block device defaults to the device size
    bandwidth: int | None = None    # bytes/s read bandwidth to assume instead of probing
    throttle: int | None = None     # cap this device at bytes/s (token bucket) to emulate a link or a slower SSD
    latency_s: float = 0.0          # every read pays this many seconds (reads in flight overlap theirs), e.g. 1e-4
    workers: int = 4                # I/O threads of this device (queue depth)
    direct: bool = True             # extent: O_DIRECT (page cache bypassed); false only where O_DIRECT is unsupported
    zero_fill: bool = True          # extent: write zeros over a new file once so first writes are not slow
    drop_cache: bool = True         # files: posix_fadvise(DONTNEED) after each write/read (cold-cache baseline)
    # remote (a Redis / Valkey store shared by every engine; devices/remote.py):
    url: str | None = field(default=None, repr=False)   # "redis://host:port[,host:port]" seeds (rediss: TLS)
    cluster: bool = True            # a Redis cluster (keys over hash slots, every node read) or one server
    username: str | None = field(default=None, repr=False)   # ACL user (else pool.remote_username)
    password: str | None = field(default=None, repr=False)   # never logged (else pool.remote_password / env)
    password_file: str | None = None   # the password is this file's first line (else pool.remote_password_file)
    tls: dict | None = None         # passed through to the client: ssl_ca_certs, ssl_certfile, ssl_keyfile, ...
    timeout_s: float = 2.0          # connect and per-command socket timeout
    key_prefix: str = "kvflow:"     # store keys are key_prefix + the record key digest (hex)
    ttl_s: int = 0                  # > 0: records expire after this long (0: the store's LRU decides)
    required: bool = True           # unreachable at start: one ConfigError (false: start without it, re-probe)

    def check_at(self, where: str) -> None:
        """Validate against ``where`` (e.g. ``pool.devices[2]``) so errors name the entry."""
        from kvflow.pool.devices import DEVICE_TYPES
        check(self.type in DEVICE_TYPES, f"{where}.type: unknown device type {self.type!r} "
                                         f"(known: {', '.join(sorted(DEVICE_TYPES))})")
        cls = DEVICE_TYPES[self.type]
        check(bool(self.path) or not cls.needs_path, f"{where}.path: required for a {self.type} device")
        check(self.capacity is None or self.capacity >= MIN_CAPACITY,
              f"{where}.capacity: must be at least {MIN_CAPACITY // 1024}K (one page), got {self.capacity!r}")
        check(self.capacity is not None or not cls.needs_capacity,
              f"{where}.capacity: required for a {self.type} device")
        check(self.bandwidth is None or self.bandwidth > 0, f"{where}.bandwidth: must be positive bytes/s")
        check(self.throttle is None or self.throttle > 0, f"{where}.throttle: must be positive bytes/s")
        check(1 <= self.workers <= 64, f"{where}.workers: must be 1..64")
        check(math.isfinite(self.latency_s) and 0 <= self.latency_s <= MAX_LATENCY_S,
              f"{where}.latency_s: must be between 0 and {MAX_LATENCY_S:g} seconds, got {self.latency_s!r}")
        if hasattr(cls, "check_config"):
            cls.check_config(self, where)

    @property
    def persistent(self) -> bool:
        return self.path is not None

    @property
    def name(self) -> str:
        """Stable identity recorded in the manifest: type + absolute path (a remote store: its seed nodes)."""
        if self.type == "remote" and self.url:
            scheme, sep, rest = self.url.partition("://")
            return f"{self.type}:{scheme}{sep}{rest.rpartition('@')[2]}"    # never the credentials of a URL
        return f"{self.type}:{os.path.abspath(self.path)}" if self.path else f"{self.type}:anonymous"


@dataclass(slots=True)
class PoolConfig:
    devices: list[DeviceConfig] = field(default_factory=list)
    chunk_tokens: int = 256
    durability: str = "strict"      # strict: a put returns once data and index are durable; relaxed: periodic sync
    storage_dtype: str = "float32"
    index_dir: str | None = None     # required when any device is persistent
    placement: str = "bandwidth"     # bandwidth (p_i ∝ b_i) | equal (round robin) | overflow (one device at a time)
    checkpoint_interval_s: float = 5.0   # relaxed: sync devices + log this often; both: compact the log when large
    wal_compact_bytes: int = 4 << 20     # rewrite the checkpoint once the log exceeds this and the checkpoint
    high_watermark: float = 0.95     # a device above this fraction of capacity takes records only when no device
    #                                  below it has room; a put evicts only when its record fits nowhere
    low_watermark: float = 0.85      # no effect (accepted so older configs load): a put evicts only what it needs
    probe_bytes: int = 64 << 20      # bytes moved per device by the bandwidth probe at creation / `kvflow pool probe`
    probe_seconds: float = 0.0       # ... and read again until this long was spent reading (bursty caps, e.g. 1.0)
    remote_placement: str = "stripe"  # stripe: a remote device is striped by p_i like any | copy: local first + a copy
    remote_username: str | None = field(default=None, repr=False)   # remote devices' ACL user / password unless a
    remote_password: str | None = field(default=None, repr=False)   # device sets its own (KVFLOW_POOL_REMOTE_*)
    remote_password_file: str | None = None   # ... or the first line of this file (KVFLOW_POOL_REMOTE_PASSWORD_FILE)

    def validate(self) -> None:
        check(len(self.devices) > 0, "pool.devices: at least one device is required")
        for i, dev in enumerate(self.devices):
            dev.check_at(f"pool.devices[{i}]")
        names = [d.name for d in self.devices if d.persistent]
        check(len(names) == len(set(names)), "pool.devices: two devices use the same path")
        check(self.chunk_tokens > 0, "pool.chunk_tokens: must be positive")
        check(self.durability in ("strict", "relaxed"), f"pool.durability: must be strict or relaxed, "
                                                          f"got {self.durability!r}")
        check(self.storage_dtype in DTYPES, f"pool.storage_dtype: must be one of {', '.join(DTYPES)}, "
                                            f"got {self.storage_dtype!r}")
        check(self.placement in PLACEMENTS, f"pool.placement: must be one of {', '.join(PLACEMENTS)}, "
                                            f"got {self.placement!r}")
        check(0 < self.high_watermark <= 1, "pool.high_watermark: must be in (0, 1]")
        check(0 < self.low_watermark <= 1, "pool.low_watermark: must be in (0, 1] (it has no effect)")
        check(0 < self.checkpoint_interval_s <= 86400, "pool.checkpoint_interval_s: must be positive and at most a day "
                                                       f"(86400), got {self.checkpoint_interval_s!r}")
        check(self.probe_bytes >= 1 << 20, "pool.probe_bytes: must be at least 1M")
        check(self.wal_compact_bytes >= 0, f"pool.wal_compact_bytes: must be 0 (compact at every interval) or "
                                           f"positive bytes, got {self.wal_compact_bytes!r}")
        check(math.isfinite(self.probe_seconds) and 0 <= self.probe_seconds <= 60,
              "pool.probe_seconds: must be between 0 and 60")
        check(self.remote_placement in REMOTE_PLACEMENTS, f"pool.remote_placement: must be stripe or copy, "
                                                          f"got {self.remote_placement!r}")
        for i, dev in enumerate(self.devices):
            if dev.type == "remote":
                dev.username = dev.username or self.remote_username
                dev.password = (dev.password or _secret(dev.password_file, f"pool.devices[{i}].password_file")
                                or self.remote_password
                                or _secret(self.remote_password_file, "pool.remote_password_file"))
        check(self.index_dir is not None or not any(d.persistent for d in self.devices),
              "pool.index_dir: required when a device has a path (its index must survive restarts)")
        check(self.index_dir is None or os.path.normpath(self.index_dir.strip() or ".") != ".",
              f"pool.index_dir: {self.index_dir!r} names no folder of its own (the index needs one: e.g. ./kvpool)")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.storage_dtype]

    @classmethod
    def load(cls, source: PoolConfig | dict | str | os.PathLike) -> PoolConfig:
        """A PoolConfig from itself, a mapping (with or without a ``pool`` key) or a YAML/TOML file; relative paths
        in a file resolve against the file's folder. Env ``KVFLOW_POOL_*`` overrides scalars."""
        if isinstance(source, PoolConfig):
            source.validate()
            return source
        if isinstance(source, dict):
            return load_section(cls, "pool", source)
        if not isinstance(source, (str, os.PathLike)):
            raise ConfigError(f"pool config must be a path, a mapping or a PoolConfig, got {type(source).__name__}")
        cfg = load_section(cls, "pool", read_file(source))
        base = Path(source).resolve().parent
        if cfg.index_dir is not None:
            cfg.index_dir = str(base / cfg.index_dir)
        for dev in cfg.devices:
            if dev.path is not None:
                dev.path = str(base / dev.path)
        return cfg


def _secret(path: str | None, where: str) -> str | None:
    """The first line of a secret file (e.g. a mounted Kubernetes secret), None without a file; the file's content
    is never part of an error message."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline().rstrip("\r\n")
    except OSError as err:
        raise ConfigError(f"{where}: cannot read {path}: {err.strerror or err}") from None
    check(bool(line), f"{where}: {path} is empty (its first line is the password)")
    return line
