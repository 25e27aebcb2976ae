"""The measured bound: what no plan can beat on this machine, built from times measured in the same run.

    cells     each chunk's cheapest recompute, measured: the context run through every layer chunk by chunk
              (one chunk a step) and in the largest steps the executor takes (``max_step`` tokens); a chunk's
              cost is the smaller of its own step and its share of the big step (its single-chunk time scaled by
              the big step's measured / summed single-chunk times) — bigger steps are cheaper per token, and a
              bound must use the cheapest way a cell can be computed. Per cell: the chunk's cost / layers.
    link      the rate the throttle enforces, or for a real disk the rate of raw O_DIRECT reads measured alone
    query     the tail + query through every layer + the LM head on a full cache, measured alone; after the last
              load at least its last layer + head remain (the query through one layer, measured alone)

The bound is the balance point of those (``kvflow.planner.bound.balance_point`` — the same function the cost
model's T* uses, fed measurements instead of the model). Timings are medians over the probes of a run, each probe
taken between the strategies it judges.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvflow.model.device import synchronize
from kvflow.model.runner import ModelRunner
from kvflow.planner.bound import balance_point


def _now(runner: ModelRunner) -> float:
    """The host clock once the runner's device has finished what it was given (timings of work, not of a queue)."""
    synchronize(runner.device)
    return time.perf_counter()


@dataclass
class QueryTimes:
    """One request's tail + query measured alone on a full cache (medians over probes)."""
    query: list[float] = field(default_factory=list)            # through every layer
    query_layer: list[float] = field(default_factory=list)      # through one layer
    head: list[float] = field(default_factory=list)

    def measure(self, runner: ModelRunner, cache, suffix_ids: torch.Tensor, start: int, step_tokens: int) -> None:
        """Time the suffix at positions [start, start + len) on ``cache`` (its keys below ``start`` filled; their
        values do not change the time)."""
        L, n = runner.num_layers, suffix_ids.numel()
        pieces = [(a, min(a + step_tokens, n)) for a in range(0, n, step_tokens)]
        hidden = [runner.embed(suffix_ids[a:b]) for a, b in pieces]
        t0 = _now(runner)
        for h, (a, _) in zip(hidden, pieces):
            runner.run_layers(cache, h, start + a, (0, 1))
        self.query_layer.append(_now(runner) - t0)
        t0 = _now(runner)
        for k, (a, _) in enumerate(pieces):
            hidden[k] = runner.run_layers(cache, hidden[k], start + a, (0, L))
        self.query.append(_now(runner) - t0)
        t0 = _now(runner)
        runner.logits_many([hidden[-1]])
        self.head.append(_now(runner) - t0)

    @property
    def compute_after(self) -> float:
        return statistics.median(self.query) + statistics.median(self.head)

    @property
    def io_after(self) -> float:
        return statistics.median(self.query_layer) + statistics.median(self.head)


@dataclass
class CellProbe:
    """Measured costs of one context: per-chunk cheapest recompute (all layers) and its query alone."""
    chunk_tokens: int
    num_layers: int
    chunks: list[list[float]] = field(default_factory=list)     # per probe: seconds per chunk, all layers
    own: QueryTimes = field(default_factory=QueryTimes)

    def probe(self, runner: ModelRunner, token_ids: torch.Tensor, grid_chunks: int, max_step: int,
              others: list[tuple["QueryTimes", torch.Tensor, int]] = (), single: bool = True) -> None:
        """One measurement (two recomputes of the grid + the query), in the executor's largest steps: ``max_step``
        tokens for the grid and for the tail + query pieces (a plan's ``step_tokens``). ``others``: (times, suffix
        ids, start) of more requests whose queries are timed on this cache (a batch: a chunk costs the same at the
        same position whatever its tokens, so the longest context's probe serves every request). ``single``
        false (long contexts, where each pass is minutes): the big steps only, a step's time shared evenly by its
        chunks (their positions differ by under a step: at 64K tokens and 1K-token steps, under 2%)."""
        C, L = self.chunk_tokens, self.num_layers
        grid = grid_chunks * C
        cache = runner.new_cache(max([token_ids.numel()] + [s + ids.numel() for _, ids, s in others]))
        per = max(1, max_step // C)
        if not single:
            best = []
            for c0 in range(0, grid_chunks, per):
                c1 = min(c0 + per, grid_chunks)
                h = runner.embed(token_ids[c0 * C:c1 * C])
                t0 = _now(runner)
                runner.run_layers(cache, h, c0 * C, (0, L))
                best += [(_now(runner) - t0) / (c1 - c0)] * (c1 - c0)
            self.chunks.append(best)
            self.own.measure(runner, cache, token_ids[grid:], grid, max_step)
            for times, ids, start in others:
                times.measure(runner, cache, ids, start, max_step)
            return
        single = []
        for i in range(grid_chunks):
            h = runner.embed(token_ids[i * C:(i + 1) * C])
            t0 = _now(runner)
            runner.run_layers(cache, h, i * C, (0, L))
            single.append(_now(runner) - t0)
        best = list(single)
        big = runner.new_cache(grid)
        for c0 in range(0, grid_chunks, per):
            c1 = min(c0 + per, grid_chunks)
            h = runner.embed(token_ids[c0 * C:c1 * C])
            t0 = _now(runner)
            runner.run_layers(big, h, c0 * C, (0, L))
            share = (_now(runner) - t0) / sum(single[c0:c1])
            for i in range(c0, c1):
                best[i] = min(best[i], single[i] * share)
        del big
        self.chunks.append(best)
        self.own.measure(runner, cache, token_ids[grid:], grid, max_step)
        for times, ids, start in others:
            times.measure(runner, cache, ids, start, max_step)

    def cells(self, chunks: int | None = None) -> list[float]:
        """Median over probes of each chunk's cheapest cost, per cell (chunk cost / layers), chunk order."""
        n = len(self.chunks[0]) if chunks is None else chunks
        return [statistics.median(p[i] for p in self.chunks) / self.num_layers for i in range(n)]

    def bound(self, link_bytes_per_s: float, cell_bytes: int) -> float:
        """This context alone: a batch of one."""
        return batch_bound(self, [(len(self.chunks[0]), self.own)], link_bytes_per_s, cell_bytes)

    def summary(self) -> dict:
        return {"probes": len(self.chunks), "grid_recompute_s": sum(self.cells()) * self.num_layers,
                "query_s": statistics.median(self.own.query), "head_s": statistics.median(self.own.head)}


def batch_bound(probe: CellProbe, requests: list[tuple[int, QueryTimes]], link_bytes_per_s: float,
                cell_bytes: int) -> float:
    """The whole batch (``requests``: stored chunks and measured query of each): every request's cells compete for
    the one link, every query runs on the compute side, the cheapest query's last layer + head remain after the
    last load."""
    ordered = sorted((c for n, _ in requests for c in probe.cells(n) for _ in range(probe.num_layers)), reverse=True)
    # requests served together share one LM-head pass (executor): the batch pays at least one head, not one each
    head = max(statistics.median(q.head) for _, q in requests)
    queries = sum(statistics.median(q.query) for _, q in requests) + head
    return balance_point(ordered, cell_bytes / link_bytes_per_s, queries, min(q.io_after for _, q in requests))


def batch_mean_bound(probe: CellProbe, requests: list[tuple[int, QueryTimes]], link_bytes_per_s: float,
                     cell_bytes: int) -> float:
    """No schedule's mean TTFT is below this: when the k-th request finishes, k requests' cells are filled and their
    queries run, so it finishes no sooner than the bound of the k requests that are cheapest alone together (the
    cheapest k by their own bounds). The mean of those over k = 1..N."""
    alone = sorted(requests, key=lambda r: batch_bound(probe, [r], link_bytes_per_s, cell_bytes))
    return sum(batch_bound(probe, alone[:k], link_bytes_per_s, cell_bytes)
               for k in range(1, len(alone) + 1)) / len(alone)


def recompute_rate(runner: ModelRunner, chunk_tokens: int, repeats: int = 10, layers: int | None = None) -> float:
    """KV bytes per second that recompute produces at short context, measured warm now: one chunk at position 0
    through ``layers`` layers (default all), the fastest of ``repeats`` after one warm-up — a neighbour's burst
    during one repetition must not set every link of the run (a machine that is slow throughout is slow in
    every repetition, and the rate follows it). The denominator of rho (DESIGN.md §5), the same for restore,
    batch, pipeline and demo."""
    n = runner.num_layers if layers is None else layers
    ids = torch.randint(0, min(runner.config.vocab_size, 32000), (chunk_tokens,),
                        generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(repeats + 1):
        cache = runner.new_cache(chunk_tokens)
        h = runner.embed(ids)
        t0 = _now(runner)
        runner.run_layers(cache, h, 0, (0, n))
        times.append(_now(runner) - t0)
    return chunk_tokens * runner.kv_bytes_per_token() * n / runner.num_layers / min(times[1:])


def odirect_read_rate(path: str, nbytes: int, threads: int = 4, block: int = 1 << 20, offset: int = 0) -> float:
    """Bytes/s of raw O_DIRECT reads of ``nbytes`` of ``path`` from ``offset`` (``threads`` reads in flight): a
    device or the real disk measured by itself, without the pool's checksums or copies (the bound's link, a striped
    read's "sum of each alone")."""
    nbytes = max(block, nbytes // block * block)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:        # no O_DIRECT here (tmpfs): the page cache's rate, which is faster still
        fd = os.open(path, os.O_RDONLY)
    buffers = [mmap.mmap(-1, block) for _ in range(threads)]

    def read(k: int) -> None:
        buf = buffers[k % threads]
        for off in range(offset + k * block, offset + nbytes, threads * block):
            os.preadv(fd, [buf], off)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(threads)))
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
    return nbytes / elapsed
