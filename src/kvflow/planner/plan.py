"""A restoration plan: the plain value the planner returns and the executor runs.

The context's full chunks form a grid of cells (chunk i, layer l). A plan says which cells are recomputed
and which are loaded, in what order each side works, and how the query is run::

              chunk:  0   1   2   3   4   5   6   7        split = (4, 4, 4, 3, 1, 0, 0, 0)
    layer 3         [ C   C   C | L   L   L   L   L ]      C = recomputed (compute thread, forward)
    layer 2         [ C   C   C   C | L   L   L   L ]      L = loaded     (I/O thread)
    layer 1         [ C   C   C   C | L   L   L   L ]
    layer 0         [ C   C   C   C   C | L   L   L ]
                                                           tail + query: recomputed last, all layers

``split[i]`` = number of lower layers of chunk i that are recomputed; it never increases along the
context (a "staircase"), so recomputing a cell never needs a loaded cell. Token split (CacheFlow's
two pointers, Cake) is ``(L,..,L,0,..,0)``; layer split is ``(cut,..,cut)``; recompute is all ``L``;
load is all ``0``. The partial tail chunk (never stored) and the query are recomputed after the grid.

With ``dynamic_meet`` the compute side walks forward and the I/O side walks backward chunk by chunk and the
boundary moves at run time to wherever they meet (Cake's mechanism; ``split`` is then the prediction). With
``chunk_compute_s`` and ``chunk_io_s`` too (predicted seconds to recompute chunk i / to load one chunk), the compute
side claims a step only while it would finish it before the I/O side could load it — the compute prediction scaled
by the speed measured so far, the I/O side paced by its last load (a late chunk claimed by a compute side slower
than planned is what the meet must avoid). ``chunk_io_s`` is the plan's prediction, for display and tests.
With ``cell_meet`` the pointers meet inside a chunk: the last unclaimed chunk is shared layer by layer — the compute
side recomputes its lower layers bottom-up, the I/O side loads its upper layers top-down (a staircase decided at
run time), so neither side idles for more than one cell at the end.
With ``pipelined_query`` the query runs layer by layer, each layer waiting only for that layer's cells. For a static
plan its layer-major loads give that; for a dynamic meet (with ``chunk_compute_s`` and ``query_s``) the I/O side
claims its last chunks as one group at run time and loads them layer by layer bottom up (kvflow.planner.group).

A pipeline stage's plan covers only its own layers: layer indices in ``split`` and in the steps are relative to
``layer_offset`` (model layer = layer_offset + plan layer), and ``num_layers`` is the stage's layer count.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ComputeStep:
    """Run layers [l0, l1) on tokens [a, b) — input: token embeddings when l0 == 0."""
    tokens: tuple[int, int]
    layers: tuple[int, int]


@dataclass(frozen=True, slots=True)
class LoadStep:
    """Load cells of chunks [c0, c1) x layers [l0, l1) in one parallel pool read."""
    chunks: tuple[int, int]
    layers: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_s: float          # restore + query + head, as the cost model and pool bandwidth predict
    restore_s: float       # until every cell of the grid is filled
    compute_s: float       # compute-thread work in the grid
    io_s: float            # I/O-thread work


@dataclass(frozen=True, slots=True)
class Plan:
    strategy: str
    context_len: int
    query_len: int
    chunk_tokens: int
    num_layers: int
    split: tuple[int, ...]               # per full chunk: lower layers recomputed
    compute: tuple[ComputeStep, ...]     # grid compute steps, in order
    loads: tuple[LoadStep, ...]          # grid load steps, in order
    dynamic_meet: bool = False
    pipelined_query: bool = False
    step_tokens: int = 1024              # tail + query run in pieces of at most this many tokens
    layer_offset: int = 0                # a pipeline stage: the plan's layer 0 is this layer of the model
    chunk_compute_s: tuple[float, ...] = ()   # dynamic meet guard: predicted recompute seconds of each chunk ...
    chunk_io_s: float = 0.0                   # ... and of loading one chunk (empty / 0: no guard)
    cell_meet: bool = False              # dynamic meet: share the last unclaimed chunk layer by layer
    query_s: tuple[float, ...] = ()      # pipelined meet: predicted tail + query seconds (one layer, every layer)
    predicted: Prediction | None = None
    lower_bound_s: float | None = None
    notes: dict = field(default_factory=dict)

    @property
    def num_chunks(self) -> int:
        return len(self.split)

    @property
    def grid_tokens(self) -> int:
        return self.num_chunks * self.chunk_tokens

    @property
    def suffix(self) -> tuple[int, int]:
        """Tokens recomputed with the query: the partial tail chunk + the query."""
        return self.grid_tokens, self.context_len + self.query_len

    @property
    def recomputed_cells(self) -> int:
        return sum(self.split)

    @property
    def loaded_cells(self) -> int:
        return self.num_chunks * self.num_layers - self.recomputed_cells

    def describe(self) -> str:
        n, L = self.num_chunks, self.num_layers
        if not n:
            return "nothing stored: recompute all"
        if self.dynamic_meet and len(set(self.split)) == 1:
            return f"token split, meet at run time (predicted: {'recompute' if self.split[0] else 'load'} all {n})"
        if all(s == L for s in self.split):
            return f"recompute {n} chunks"
        if all(s == 0 for s in self.split):
            return f"load {n} chunks x {L} layers" + (" layer by layer" if self.pipelined_query else "")
        if len(set(self.split)) == 1:
            return f"layer split: recompute layers 0-{self.split[0] - 1}, load {self.split[0]}-{L - 1}"
        if set(self.split) <= {0, L}:
            m = self.split.count(L)
            return f"token split: recompute chunks 0-{m - 1}, load {m}-{n - 1}" + (" (meet at run time)"
                                                                                    if self.dynamic_meet else "")
        return f"staircase: {self.recomputed_cells}/{n * L} cells recomputed"
