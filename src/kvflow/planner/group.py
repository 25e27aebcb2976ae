"""The meet's last group: when a run-time meet's compute side stops for good and the I/O side claims every chunk
left as one group, loaded layer by layer bottom up, so that the query runs layer l as soon as layer l is in.

Without it a run-time meet's query waits for the whole grid and then runs alone (its loads land a chunk at a time,
every layer at once); a static staircase's layer-major loads hide most of the query behind them. The group keeps
the meet dynamic and gets the staircase's tail::

    chunks:        0 ...... m | m ...... hi       compute side: [0, m), claimed as it goes; I/O side: whole chunks
                                                  from the top down to hi, then [m, hi) as the group
    I/O side:                 | layer 0 of the group, layer 1, ..., layer L-1  (one read per layer)
    query:                    | layer 0 once the compute side is done and layer 0 is in, layer 1 once layer 1 is in ...

The compute side stops early on purpose: its last chunk should be done about when the group's layer 0 lands, so
that the group's upper layers land while the query's lower layers run.

One decision, made at every claim on either side, shared by the executor (executor/board.py) and the simulator
(planner/simulate.py) so that what runs is what was predicted — :func:`stop_point`: is the compute side's boundary
final? For every chunk m it could stop at, the predicted end of the query if it recomputes [lo, m) and the I/O side
loads [m, hi) as the group, against the meet's end (whole chunks, the last one shared layer by layer, then the whole
query). The best stop wins if it beats the meet:

    compute side   about to claim [lo, c1): the stop point m <= c1 -> claim [lo, m) only, and no more
    I/O side       about to claim a chunk: the boundary is final (the compute side said so, or the stop point is the
                   compute side's claimed lo) -> claim every unclaimed chunk as the group, one read per layer
    neither        the meet goes on: the I/O side loads whole chunks, which serve any boundary

The decision is re-made with the speeds measured so far at every claim, so the boundary becomes final as late as it
can: only the loads after it are exposed to a speed the model got wrong. Before that the I/O side loads whole chunks
(they serve any boundary); after it, layer by layer (the query's lower layers land first). A group cell is never
recomputed: that would need its chunk's lower layers recomputed, not loaded.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class MeetState:
    """What either side knows at a claim. Times are on the run's clock."""
    prefix: Sequence[float]   # prefix[i]: predicted seconds to recompute chunks [0, i), every layer
    speed: float              # measured ÷ predicted compute seconds so far (1: as predicted)
    lo: int                   # unclaimed chunks are [lo, hi)
    hi: int
    compute_free: float       # when the compute side is done with what it has claimed (at its own claim: now)
    io_free: float            # when the I/O side is done with what it has in flight
    chunk_io_s: float         # seconds to load one chunk, every layer
    query_layer_s: float      # predicted seconds of tail + query through one layer (a step of its own)
    query_s: float            # ... through every layer in one step
    num_layers: int


MAX_GROUP = 64                # chunks: a group this large hides any query; bounds the search


def stop_point(s: MeetState) -> int | None:
    """Where the compute side's claims should end (chunk m in [lo, hi): the I/O side loads [m, hi) as the last group),
    or None: keep meeting.

    Only group sizes g that could beat the meet are priced (a hot path: every claim of both sides, and every claim
    the planner simulates): the group's query ends no sooner than its last layer lands plus one query layer, nor than
    the compute side's share plus every query layer — two lower bounds that cut the search to the few g near the
    end of the meet, and to none far from it, without changing the answer."""
    if s.hi <= s.lo or s.chunk_io_s <= 0:
        return None
    x = _meet_point(s, s.hi, s.io_free)
    if s.hi - x > MAX_GROUP:
        return None                                # far from the end
    end = _meet_end_at(s, s.hi, s.io_free, x) - 1e-3 * s.query_s
    q = s.speed * s.query_layer_s
    g_hi = min(s.hi - s.lo, MAX_GROUP, int((end - s.io_free - q) / s.chunk_io_s) + 1)  # lands before the meet ends
    budget = s.prefix[s.lo] + (end - s.compute_free - s.num_layers * q) / s.speed        # compute side's share ...
    g_lo = s.hi - bisect_left(s.prefix, budget, s.lo, s.hi + 1)                         # ... done in time (a chunk
    best = None                                                                          # of slack for rounding)
    for g in range(g_hi, max(g_lo, 1) - 1, -1):                  # the largest group first: it wins a tie
        t = group_end(s, s.hi, s.io_free, g)
        if t < end:
            best, end = s.hi - g, t
    return best


def group_end(s: MeetState, hi: int, io_free: float, g: int) -> float:
    """Predicted end of the query (LM head excluded) if the I/O side groups chunks [hi - g, hi) from ``io_free``."""
    t = s.compute_free + s.speed * (s.prefix[hi - g] - s.prefix[s.lo])
    per_layer = g * s.chunk_io_s / s.num_layers
    for layer in range(s.num_layers):
        t = max(t, io_free + (layer + 1) * per_layer) + s.speed * s.query_layer_s
    return t


def _balance(s: MeetState, hi: int, io_free: float, x: float) -> float:
    """Compute side's end minus I/O side's end if they meet at (fractional) chunk x."""
    i = min(int(x), hi - 1)
    done = s.prefix[i] + (x - i) * (s.prefix[i + 1] - s.prefix[i]) if x < hi else s.prefix[hi]
    return (s.compute_free + s.speed * (done - s.prefix[s.lo])) - (io_free + (hi - x) * s.chunk_io_s)


def _meet_point(s: MeetState, hi: int, io_free: float) -> float:
    """Where the two sides meet, fractionally (the cell meet shares the last chunk): bisection on chunks, then
    linear within one."""
    a, b = s.lo, hi
    if _balance(s, hi, io_free, a) >= 0:
        return float(a)
    if _balance(s, hi, io_free, b) <= 0:
        return float(b)
    while b - a > 1:
        m = (a + b) // 2
        a, b = (m, b) if _balance(s, hi, io_free, m) < 0 else (a, m)
    fa, fb = _balance(s, hi, io_free, a), _balance(s, hi, io_free, b)
    return a + (-fa) / (fb - fa)


def _meet_end(s: MeetState, hi: int, io_free: float) -> float:
    """No group: the sides meet, then the whole query runs."""
    return _meet_end_at(s, hi, io_free, _meet_point(s, hi, io_free))


def _meet_end_at(s: MeetState, hi: int, io_free: float, x: float) -> float:
    done = max(s.compute_free + s.speed * (_prefix_at(s, x) - s.prefix[s.lo]), io_free + (hi - x) * s.chunk_io_s)
    return done + s.speed * s.query_s


def _prefix_at(s: MeetState, x: float) -> float:
    i = min(int(x), len(s.prefix) - 2)
    return s.prefix[i] + (x - i) * (s.prefix[i + 1] - s.prefix[i])
