"""Space inside one device: a user-space extent ("LBA") allocator. The device is a flat range of ``align``-byte
units; a record occupies one extent (its size rounded up to ``align``). Best fit by size; freed neighbours coalesce.

    0                                                                      capacity
    | used | free |  used  | used |        free         | used |     free      |
                                    ^ alloc(n) takes the smallest free extent >= n and splits it

The pool rebuilds an allocator from its index on open (``from_used``), so index and allocator always agree.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Iterable


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


class ExtentAllocator:
    def __init__(self, capacity: int, align: int = 4096):
        assert align > 0 and capacity >= 0
        self.align = align
        self.capacity = capacity // align * align
        self.used: dict[int, int] = {}                 # start -> length of every allocated extent
        self._free_at: dict[int, int] = {}             # start -> length
        self._free_end: dict[int, int] = {}            # end -> start
        self._by_size: dict[int, dict[int, None]] = {}  # length -> starts (insertion-ordered set)
        self._sizes: list[int] = []                    # sorted keys of _by_size
        self.used_bytes = 0
        if self.capacity:
            self._add_free(0, self.capacity)

    @classmethod
    def from_used(cls, capacity: int, align: int, extents) -> ExtentAllocator:
        """An allocator whose used extents are exactly ``extents`` [(start, length)]. Raises ValueError if one is
        unaligned, out of range or overlaps another."""
        alloc = cls(capacity, align)
        alloc._free_at.clear(), alloc._free_end.clear(), alloc._by_size.clear(), alloc._sizes.clear()
        pos = 0
        for start, length in sorted(extents):
            length = round_up(length, align)
            if start % align or length <= 0 or start + length > alloc.capacity:
                raise ValueError(f"extent [{start}, {start + length}) is unaligned or outside [0, {alloc.capacity})")
            if start < pos:
                raise ValueError(f"extent [{start}, {start + length}) overlaps the extent ending at {pos}")
            if start > pos:
                alloc._add_free(pos, start - pos)
            alloc.used[start] = length
            alloc.used_bytes += length
            pos = start + length
        if pos < alloc.capacity:
            alloc._add_free(pos, alloc.capacity - pos)
        return alloc

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    def alloc(self, nbytes: int) -> int | None:
        """Start of a new extent of ``round_up(nbytes, align)`` bytes, or None when no free extent is large enough."""
        size = round_up(max(nbytes, 1), self.align)
        i = bisect_left(self._sizes, size)
        if i == len(self._sizes):
            return None
        have = self._sizes[i]
        start = next(iter(self._by_size[have]))
        self._remove_free(start, have)
        if have > size:
            self._add_free(start + size, have - size)
        self.used[start] = size
        self.used_bytes += size
        return start

    def free(self, start: int) -> None:
        size = self.used.pop(start)
        self.used_bytes -= size
        if (left := self._free_end.get(start)) is not None:
            self._remove_free(left, start - left)
            size += start - left
            start = left
        if (right_len := self._free_at.get(start + size)) is not None:
            self._remove_free(start + size, right_len)
            size += right_len
        self._add_free(start, size)

    def frees_needed(self, starts: Iterable[int], nbytes: int) -> int | None:
        """How many of the used extents ``starts`` (in the order they would be freed) must be freed before a free
        extent of ``nbytes`` exists: 0 when one exists now, None when freeing all of them would not make one.
        Changes nothing; reads ``starts`` only as far as it needs."""
        size = round_up(max(nbytes, 1), self.align)
        if self.largest_free >= size:
            return 0
        at: dict[int, int] = {}       # the simulation's free extents that differ from the real ones: start -> end
        ends: dict[int, int] = {}     # end -> start of those
        gone: set[int] = set()        # starts of real free extents merged into a simulated one

        def take_left(pos: int) -> int:      # start of the free extent ending at pos (merged away), else pos
            if (s := ends.pop(pos, None)) is not None:
                del at[s]
                return s
            if (s := self._free_end.get(pos)) is not None and s not in gone:
                gone.add(s)
                return s
            return pos

        def take_right(pos: int) -> int:     # end of the free extent starting at pos (merged away), else pos
            if (e := at.pop(pos, None)) is not None:
                del ends[e]
                return e
            if (n := self._free_at.get(pos)) is not None and pos not in gone:
                gone.add(pos)
                return pos + n
            return pos

        for count, start in enumerate(starts, 1):
            lo, hi = take_left(start), take_right(start + self.used[start])
            if hi - lo >= size:
                return count
            at[lo], ends[hi] = hi, lo
        return None

    def free_extents(self) -> list[tuple[int, int]]:
        return sorted(self._free_at.items())

    def _add_free(self, start: int, size: int) -> None:
        self._free_at[start] = size
        self._free_end[start + size] = start
        starts = self._by_size.get(size)
        if starts is None:
            starts = self._by_size[size] = {}
            insort(self._sizes, size)
        starts[start] = None

    def _remove_free(self, start: int, size: int) -> None:
        del self._free_at[start], self._free_end[start + size]
        starts = self._by_size[size]
        del starts[start]
        if not starts:
            del self._by_size[size]
            self._sizes.pop(bisect_left(self._sizes, size))
