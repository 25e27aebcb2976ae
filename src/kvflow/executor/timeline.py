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
    """Two lanes (compute, I/O) over time; each bar labelled by its token range. The two pointers meeting is
    visible as compute bars moving right through the context while load bars move left."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"compute": "#4C72B0", "fallback": "#C44E52", "query": "#55A868", "head": "#8172B2", "load": "#DD8452"}
    fig, (ax, pos) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, gridspec_kw={"height_ratios": [1, 2]})
    lanes = {"load": 0, "compute": 1, "fallback": 1, "query": 1, "head": 1}
    for e in events:
        ax.barh(lanes[e.kind], e.end - e.start, left=e.start + offset, color=colors[e.kind], edgecolor="white",
                height=0.6)
        mid_chunk = (e.tokens[0] + e.tokens[1]) / 2 / chunk_tokens
        if e.kind in ("compute", "load", "fallback"):
            pos.plot([e.start + offset, e.end + offset], [mid_chunk, mid_chunk], color=colors[e.kind], lw=3)
    ax.set_yticks([0, 1], ["I/O", "compute"])
    ax.set_title(title)
    pos.set_ylabel("context position (chunks)")
    pos.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), ncol=5, fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
