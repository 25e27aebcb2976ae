"""Run-time correction of the profiled cost model.

A shared machine drifts: the same step can run 20% slower an hour after profiling. Plans chosen on stale costs
are balanced for the wrong speeds — a static plan (layer split, staircase) cannot move its boundary at run time,
so it pays the whole error. After every restoration the restorer compares what each compute step and each load
took with what the cost model predicted and keeps an exponentially weighted ratio per side; the planner then
plans (and computes T*) with the profiled model scaled by those ratios.

It also keeps how wrong the calibrated model still was: for each side, an exponentially weighted mean of
|ln(observed ratio / the estimate before it)| — the error of the model the plan was actually made with. The
planner's speed band (``planner.compute_band`` / ``io_band``, the speeds cacheflow's choice must hold under) is
narrowed to ``BAND_PER_ERROR`` times that error once a side has been seen twice: on a steady machine the
calibrated model is right to a few percent and the nominally fastest plan is chosen (a static staircase where it
wins); on an erratic one the error stays large, the band stays at its configured width and a dynamic meet, which
corrects itself at run time, is preferred. The configured band is the ceiling and the cold-start value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvflow.cost.model import CostModel

# grid steps only: the query (a few tokens against a long cache) is another regime of the kernels, and its few
# tens of milliseconds would swing the grid's ratio
COMPUTE_KINDS = ("compute", "fallback")
BAND_PER_ERROR = 2.0          # band = this x the mean relative error of the calibrated model (two mean deviations)
MIN_BAND = 0.03               # never plan as if the model were exact


@dataclass(slots=True)
class Calibration:
    compute: float = 1.0          # measured / predicted compute seconds
    io: float = 1.0               # measured / predicted load seconds
    weight: float = 0.3           # of the newest observation
    min_sample_s: float = 0.02    # ignore a side that worked less than this in one restoration (noise)
    compute_err: float = 0.0      # mean |ln(ratio / estimate before it)| of the calibrated model, per side ...
    io_err: float = 0.0
    compute_seen: int = 0         # ... and how many restorations each side was observed in
    io_seen: int = 0

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
                ratio, before = spent[side] / expected[side], getattr(self, side)
                seen = getattr(self, side + "_seen")
                # the first observation measures the profile's age (the scale jumps to it), not the calibrated
                # model's error
                if seen:
                    err = abs(math.log(ratio / before))
                    old = getattr(self, side + "_err")
                    setattr(self, side + "_err", err if seen == 1 else (1 - self.weight) * old + self.weight * err)
                setattr(self, side + "_seen", seen + 1)
                setattr(self, side, ratio if not seen else (1 - self.weight) * before + self.weight * ratio)

    def band(self, side: str, configured: float) -> float:
        """The speed band the planner should hold its choice under for ``side`` ("compute" / "io"): the
        configured one until the side was observed twice, then ``BAND_PER_ERROR`` x the calibrated model's error,
        within [MIN_BAND, configured]."""
        if getattr(self, side + "_seen") < 2:
            return configured
        err = math.expm1(getattr(self, side + "_err"))
        return min(configured, max(MIN_BAND, BAND_PER_ERROR * err))

    def scaled(self, cost: CostModel) -> CostModel:
        return cost.scaled(self.compute)
