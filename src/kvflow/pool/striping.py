"""The bandwidth-aware part of the allocator: which device each record of a put goes to.

``bandwidth`` (the default) is a smooth weighted round robin counted in bytes: every record adds p_i x size of
credit to each device i, the device with the most credit takes the record and pays its size. Over *any* run of
consecutive records — in particular the suffix of a context that restoration loads backwards — device i gets
p_i of the bytes, give or take one record, so reading that run keeps every device busy for the same time. The
credit persists across puts, so a context stored one chunk per call is striped just as well.

    p = (1, 1, 2, 4) / 8:   records  0 1 2 3 4 5 6 7 8 ...
                            device   3 2 3 1 3 2 3 0 3 ...

Records are striped per *lane* — the layer a record holds — each lane with its own credit, lane j starting j
unit steps into the sequence. So a context's records are spread along both axes at once: the chunks of any one
layer (what a layer-by-layer load reads) and the layers of any one chunk (what a chunk-by-chunk load reads)
each cover the devices by p_i. With equal devices this is a Latin square, device = (chunk + layer) mod D.

``equal`` is the same with equal weights; ``overflow`` fills one device at a time (LMCache's tiering order).
"""

from __future__ import annotations


class Striper:
    def __init__(self, weights: list[float]):
        self.set_weights(weights)

    def set_weights(self, weights: list[float]) -> None:
        total = sum(weights)
        assert total > 0, "no device can take records"
        self.p = [w / total for w in weights]
        self.lanes: dict[int, list[float]] = {}

    def _credit(self, lane: int) -> list[float]:
        credit = self.lanes.get(lane)
        if credit is None:  # a new lane starts ``lane`` unit steps into the sequence
            credit = self.lanes[lane] = [0.0] * len(self.p)
            for _ in range(lane % max(1, 4 * len(self.p))):
                self._step(credit, self._order(credit, 1.0)[0], 1.0)
        return credit

    def _order(self, credit: list[float], nbytes: float) -> list[int]:
        score = [c + p * nbytes for c, p in zip(credit, self.p)]
        return sorted((i for i, p in enumerate(self.p) if p > 0), key=lambda i: (-score[i], -self.p[i], i))

    def _step(self, credit: list[float], dev: int, nbytes: float) -> None:
        for i, p in enumerate(self.p):
            credit[i] += p * nbytes
        credit[dev] -= nbytes

    def order(self, nbytes: int, lane: int = 0) -> list[int]:
        """Devices by preference for the next record of ``lane`` (devices with p_i = 0 are not offered)."""
        return self._order(self._credit(lane), nbytes)

    def charge(self, dev: int, nbytes: int, lane: int = 0) -> None:
        self._step(self._credit(lane), dev, nbytes)


class Overflow(Striper):
    def order(self, nbytes: int, lane: int = 0) -> list[int]:
        return [i for i, p in enumerate(self.p) if p > 0]


def make_placement(policy: str, bandwidths: list[float]) -> Striper:
    if policy == "bandwidth":
        return Striper(bandwidths)
    live = [1.0 if b > 0 else 0.0 for b in bandwidths]
    return Overflow(live) if policy == "overflow" else Striper(live)
