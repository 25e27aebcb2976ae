"""Which cells of a request's grid were filled, and how often: the check that runs before the query.

    fills [chunks x layers]  +1 per cell by each compute step and each landed load (its misses -1 again)
    fallback of chunk i      the row is rewritten whole: cleared, then every layer +1 (cells computed or loaded
                             before the fallback are refilled, not filled twice — they hold the same values)
    before the query         every cell == 1 (a layer at a time for a pipelined query); a hole (0) or a
                             double fill (2+) is an AssertionError naming the cell

Plan layers (a stage's own, from 0), chunk indices of the grid. Cheap: one tensor add per step or load.
"""

from __future__ import annotations

import torch


class Cells:
    def __init__(self, num_chunks: int, num_layers: int):
        self.fills = torch.zeros(num_chunks, num_layers, dtype=torch.int16)

    def fill(self, chunks: tuple[int, int], layers: tuple[int, int]) -> None:
        (c0, c1), (l0, l1) = chunks, layers
        assert 0 <= c0 <= c1 <= self.fills.shape[0] and 0 <= l0 <= l1 <= self.fills.shape[1], \
            f"cells chunks [{c0}, {c1}) x layers [{l0}, {l1}) are outside the grid {tuple(self.fills.shape)}"
        self.fills[c0:c1, l0:l1] += 1

    def unfill(self, chunk: int, layer: int) -> None:
        """A cell of a load that landed without it (a miss): not filled after all."""
        self.fills[chunk, layer] -= 1

    def refill_row(self, chunk: int) -> None:
        """A fallback recomputed chunk ``chunk`` through every layer."""
        self.fills[chunk] = 1

    def check(self, chunks: tuple[int, int] | None = None, layers: tuple[int, int] | None = None) -> None:
        """Every cell of chunks x layers (default: all) filled exactly once, else AssertionError naming one."""
        (c0, c1), (l0, l1) = chunks or (0, self.fills.shape[0]), layers or (0, self.fills.shape[1])
        part = self.fills[c0:c1, l0:l1]
        bad = (part != 1).nonzero()
        if len(bad):
            i, layer = (int(x) for x in bad[0])
            n = int(part[i, layer])
            raise AssertionError(f"grid cell (chunk {c0 + i}, layer {l0 + layer}) was "
                                 + ("never filled" if n == 0 else f"filled {n} times")
                                 + f" ({len(bad)} bad cell{'s' if len(bad) > 1 else ''})")
