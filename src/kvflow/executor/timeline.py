"""What an execution did and when: events per thread, timings, utilisation, and the timeline picture."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Event:
    kind: str                 # compute | load | fallback | query | head
    tokens: tuple[int, int]
    layers: tuple[int, int]
    start: float              # seconds since the execution began
    end: float


@dataclass(slots=True)
class Timings:
    ttft_s: float             # plan start -> next-token logits (the Restorer adds lookup + planning)
    restore_s: float          # until every grid cell is filled (failed loads recomputed)
    grid_compute_end_s: float
    compute_busy_s: float     # grid compute (+ fallback) seconds
    io_busy_s: float          # seconds the I/O thread spent in pool reads
    blocked_io_s: float       # seconds the compute thread waited for data
    lower_bound_s: float      # T* for this request (cost model + pool bandwidth)
    predicted_ttft_s: float
    lookup_s: float = 0.0     # prefix lookup in the pool's index
    plan_s: float = 0.0       # planning
    start_s: float = 0.0      # in a batch: when this request's work began, from the batch start

    @property
    def compute_util(self) -> float:
        return self.compute_busy_s / self.restore_s if self.restore_s > 0 else 0.0

    @property
    def io_util(self) -> float:
        return self.io_busy_s / self.restore_s if self.restore_s > 0 else 0.0

    @property
    def vs_lower_bound(self) -> float:
        return self.ttft_s / self.lower_bound_s if self.lower_bound_s > 0 else float("nan")

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(compute_util=self.compute_util, io_util=self.io_util, vs_lower_bound=self.vs_lower_bound)
        return d


def plot_timeline(events: list[Event], path, title: str, chunk_tokens: int, offset: float = 0.0) -> None:
    """Top: the two lanes (compute, I/O) over time. Bottom: each grid step as a box spanning its time and its
    token range — compute boxes climb from the start of the context while load boxes descend from its end,
    and restoration ends where the two pointers meet."""
    import textwrap

    from kvflow.extras import require
    matplotlib = require("plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colors = {"compute": "#4C72B0", "load": "#DD8452", "fallback": "#C44E52", "query": "#55A868", "head": "#8172B2"}
    fig, (ax, pos) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [1, 2]})
    lanes = {"load": 0, "compute": 1, "fallback": 1, "query": 1, "head": 1}
    top = max([e.tokens[1] for e in events] + [1])
    for e in events:
        ax.barh(lanes[e.kind], e.end - e.start, left=e.start + offset, color=colors[e.kind], edgecolor="white",
                height=0.6)
        pos.add_patch(Rectangle((e.start + offset, e.tokens[0] / chunk_tokens), e.end - e.start,
                                (e.tokens[1] - e.tokens[0]) / chunk_tokens, facecolor=colors[e.kind],
                                edgecolor="white", alpha=0.85))
    end = max([e.end for e in events] + [0.0]) + offset
    pos.set_xlim(0, end * 1.02)
    pos.set_ylim(0, top / chunk_tokens)
    ax.set_yticks([0, 1], ["I/O", "compute"])
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=10)
    pos.set_ylabel(f"context position (chunks of {chunk_tokens} tokens)")
    pos.set_xlabel("seconds")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), ncol=5, fontsize=8, loc="lower center")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
