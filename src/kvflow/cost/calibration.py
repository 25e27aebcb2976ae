"""Run-time correction of the profiled cost model.

A shared machine drifts: the same step can run 20% slower an hour after profiling. Plans chosen on stale costs
are balanced for the wrong speeds — a static plan (layer split, staircase) cannot move its boundary at run time,
so it pays the whole error. After every restoration the restorer compares what each compute step and each load
took with what the cost model predicted and keeps an exponentially weighted ratio per side; the planner then
plans (and computes T*) with the profiled model scaled by those ratios.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.cost.model import CostModel

# grid steps only: the query (a few tokens against a long cache) is another regime of the kernels, and its few
# tens of milliseconds would swing the grid's ratio
COMPUTE_KINDS = ("compute", "fallback")


@dataclass(slots=True)
class Calibration:
    compute: float = 1.0          # measured / predicted compute seconds
    io: float = 1.0               # measured / predicted load seconds
    weight: float = 0.3           # of the newest observation
    min_sample_s: float = 0.02    # ignore a side that worked less than this in one restoration (noise)

    def observe(self, events, cost: CostModel, seconds_per_cell: float, chunk_tokens: int) -> None:
        """Fold one execution's timeline in. ``cost``: the *profiled* model; ``seconds_per_cell``: the load time of
        one (chunk x layer) record the planner assumed."""
        spent = {"compute": 0.0, "io": 0.0}
        expected = {"compute": 0.0, "io": 0.0}
        for e in events:
            layers = e.layers[1] - e.layers[0]
            if e.kind in COMPUTE_KINDS:
                spent["compute"] += e.end - e.start
                expected["compute"] += cost.step_time(e.tokens, layers)
            elif e.kind == "load":
                spent["io"] += e.end - e.start
                expected["io"] += (e.tokens[1] - e.tokens[0]) // chunk_tokens * layers * seconds_per_cell
        for side in ("compute", "io"):
            if spent[side] >= self.min_sample_s and expected[side] > 0:
                ratio = spent[side] / expected[side]
                setattr(self, side, (1 - self.weight) * getattr(self, side) + self.weight * ratio)

    def scaled(self, cost: CostModel) -> CostModel:
        return cost.scaled(self.compute)
