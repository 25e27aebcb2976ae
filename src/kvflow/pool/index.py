"""The Global Lookup Table: chunk key -> where its record lives. One row per stored record, an LRU order per device
(for eviction) and a pin count per row (readers in flight), so an extent is never reused under a reader.

    digest (16 B) ──> Entry(dev, offset, length, seq, checksum)      dev: slot in the pool; kind = its device type
                       pins > 0  -> being read: not evictable; if removed meanwhile, its extent is freed on unpin
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator


@dataclass(slots=True)
class Entry:
    dev: int
    offset: int
    length: int        # record bytes (header + payload)
    seq: int           # pool-wide sequence number written in the record header
    checksum: int      # payload checksum from the record header
    pins: int = 0
    dead: bool = False  # no longer in the table; free its extent when pins drops to 0

    @property
    def end(self) -> int:
        return self.offset + self.length


class LookupTable:
    def __init__(self, num_devices: int):
        self._rows: dict[bytes, Entry] = {}
        self._lru: list[OrderedDict[bytes, Entry]] = [OrderedDict() for _ in range(num_devices)]

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._rows

    def get(self, digest: bytes) -> Entry | None:
        return self._rows.get(digest)

    def insert(self, digest: bytes, entry: Entry) -> Entry | None:
        """Add a row; returns the row it replaced (now dead), if any."""
        old = self.remove(digest)
        self._rows[digest] = entry
        self._lru[entry.dev][digest] = entry
        return old

    def remove(self, digest: bytes) -> Entry | None:
        entry = self._rows.pop(digest, None)
        if entry is not None:
            del self._lru[entry.dev][digest]
            entry.dead = True
        return entry

    def touch(self, digest: bytes, entry: Entry) -> None:
        self._lru[entry.dev].move_to_end(digest)

    def oldest(self, dev: int) -> Iterator[tuple[bytes, Entry]]:
        """Rows of one device, least recently used first. Collect, then remove: the table must not change while
        this iterator is in use."""
        return iter(self._lru[dev].items())

    def count(self, dev: int) -> int:
        return len(self._lru[dev])

    def items(self) -> Iterator[tuple[bytes, Entry]]:
        return iter(list(self._rows.items()))
