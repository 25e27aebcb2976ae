"""The prefill activation reserve (estimated or measured), the KV budget sized to the machine, and the memory budget
the engine reports at start-up.

    budget = MemoryBudget(weights, activation_reserve, kv_blocks, num_blocks, block_size)
    log.info(budget.line())   # memory: weights 11.5 MiB + activation reserve 9.8 MiB + KV blocks 256.0 MiB (...) = ...

The reserve is what one engine step of ``max_num_batched_tokens`` tokens allocates beyond the weights and the KV
blocks (hidden states, MLP intermediates, one sequence's gathered K/V of one layer, the chunk's attention mask and
workspace, logits). Which reserve an engine uses is decided in one place, ``engine_reserve``:

* ``engine.activation_reserve`` stated: that;
* the engine holds its memory budget (``engine.release_heap``, on with ``engine.elastic_reserve``): *measured* by
  the probe below — there the reserve is a bound the served steps are held to, and the elastic reserve lends it;
* otherwise (the default): *estimated* from the model's shape, no step run (``estimated_reserve``). Without the
  live-set regime glibc's heap makes served steps read 32-57 MiB apart from one process to the next (below), so no
  probe bounds them anyway; the reserve is then what the start-up line reports and what an ``auto`` KV budget leaves
  aside, and a probe at a real model's longest sequence cost minutes at start-up (smollm2-135m, 8K positions: ~4 min
  on this 2-core machine) for a figure no step is held to.

The estimate: 2 x the shape formula's one-layer peak for the step's tokens (model/shape.py; the probe reads about 2x
it from position 0 — per-thread buffers, fp32 norm temporaries) + 3 x one layer's K/V bytes per key of the longest
sequence (its gathered K/V and SDPA's copies: ~1.45 KB a key on tiny, 3x its 512 B) + the sampled sequences' fp32
logits. On tiny (512 tokens, ~20K-token sequences) that is 40 MiB against one-step probe readings of 39-46 MiB.

The probe: the steps such an engine runs — the budget's tokens as a prompt's first
chunk, as a chunk half-way to the longest sequence the engine holds and at its end, with decode steps between them,
back to back (one "window", see ``_window``) — through the engine's own ``BatchRunner`` over a throw-away paged
cache. A first window over a short context sets up the kernels and thread pools for the budget's shapes; what they
keep resident after it is counted once. Three windows are then run; the reserve is that kept memory plus the
highest peak plus the spread between the three (identical windows read apart by up to ~10% on CPU: glibc's heap
keeps freed pages in a history-dependent layout). The peak is

* on CPU: the process's peak resident memory during the window above its resident memory before it — glibc's free
  memory is handed back first (``malloc_trim``) and the kernel's high-water mark reset (``/proc/self/clear_refs``
  = 5), so ``VmHWM`` after the window minus ``VmRSS`` before it is what its steps really touched;
* on CUDA (written, not yet run on a GPU here): ``torch.cuda.max_memory_allocated`` minus the allocated bytes
  before the step, after ``reset_peak_memory_stats``.

An engine whose budget must hold (``engine.release_heap``, on with the elastic reserve) keeps its resident memory
to the live set of its tensors, so that what the probe reads is what a served step takes (the live-set regime of
model/host_memory.py, the one owner of the process's allocator policy):

* glibc's mmap threshold is pinned at 256 KiB for the process, before any reserve is measured: a
  tensor of that size or more is mapped for its own use and unmapped when freed. Left to itself, glibc raises the
  threshold to the largest block it has freed (up to 32 MiB), after which step-sized tensors come from the heap,
  whose freed pages stay resident in a layout that depends on the process's whole history. Measured on tiny
  (4,096-token prompts, 2,048-token budget, fresh processes): served steps then took 32-57 MiB above the KV,
  bimodal from one process to the next, against probe readings of 48-71 MiB that did not follow them. Pinned at
  1 MiB: 25-29 MiB in every run under a reserve of 38 MiB, but 1,024-token steps (whose sub-MiB tensors stayed on
  the heap) 25-28 MiB against a reserve of 26-29 MiB; at 256 KiB: 24.7 MiB under 32.4 MiB and 13.4 MiB under
  23.5 MiB, the same to 0.1 MiB from run to run. The reserves fell too (4,096 tokens: 54 MiB, was 97-117 MiB);
* freed heap pages (the smaller allocations) are handed back after every step of at least TRIM_TOKENS tokens
  (``malloc_trim``, ~1 ms on tiny), so each large step starts from the trimmed heap a window starts from.

Both cost prefill time: every large tensor's pages are faulted in (and zeroed) afresh by each step. Measured here
(a 2,048-token step at 2K and 8K positions, three fresh processes each, medians of 5): tiny +27-45%,
qwen2.5-0.5b@layers=4 +2-38% (1 MiB; 256 KiB the same within the noise); the long prompts' TTFT of the bench's
served runs +20%. Transparent huge pages for those maps (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``) did not help.
So it is off by default, and on where the budget is what is judged: this CPU's allocator gives a tight resident
bound or the heap's speed, not both (CUDA's caching allocator gives both; the CUDA probe reads its own peak). The
pin is process-wide and stays; pinned before the model loads (``kvflow serve``, ``kvflow bench elastic``), no heap
holes are left for steps to reuse.

The CPU reading is process-wide: taken at start-up, before other threads of the engine run. Where it cannot be
taken (no ``/proc/self/clear_refs``: not Linux, a locked-down container) the reserve is the model shape's formula
(model/shape.py, docs/ADVISOR.md) and a warning says so. Measurements are cached per (model fingerprint, token budget, longest
sequence, device, torch threads, heap regime) for the process, so every engine of one model and budget measures
once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from kvflow.stats import proc_status_bytes as _status_bytes
from kvflow.model import host_memory
from kvflow.model.host_memory import release_freed_memory

log = logging.getLogger("kvflow.engine")
_CACHE: dict[tuple, int] = {}


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """One engine's memory by use: weights + activation reserve + KV blocks = total. Elastic blocks are the reserve
    lent as KV blocks while only decodes run — carved out of the reserve, so they are shown, not added twice (only
    what they may exceed the reserve by, when ``engine.elastic_blocks`` asks for more, counts on top)."""
    weights: int
    activation_reserve: int
    kv_blocks: int                   # bytes of the base KV blocks
    num_blocks: int
    block_size: int
    elastic_blocks: int = 0          # blocks the elastic reserve can lend (0: not elastic)

    @property
    def block_bytes(self) -> int:
        return self.kv_blocks // max(1, self.num_blocks)

    @property
    def total(self) -> int:
        return self.weights + max(self.activation_reserve, self.elastic_blocks * self.block_bytes) + self.kv_blocks

    def line(self) -> str:
        elastic = (f" (lends {self.elastic_blocks} elastic blocks = {_mib(self.elastic_blocks * self.block_bytes)}"
                   " while only decodes run)") if self.elastic_blocks else ""
        return (f"memory: weights {_mib(self.weights)} + activation reserve {_mib(self.activation_reserve)}{elastic}"
                f" + KV blocks {_mib(self.kv_blocks)} ({self.num_blocks} x {self.block_size} tokens)"
                f" = {_mib(self.total)}")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def weight_bytes(runner) -> int:
    """Bytes of every parameter and buffer of the model (tied weights counted once)."""
    seen, total = set(), 0
    for t in [*runner.hf_model.parameters(), *runner.hf_model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


PROBE_CONTEXT = 32768    # longest context a probe step runs at; beyond it the reserve is extrapolated (linear in keys)
PROBE_WINDOWS = 3        # probe windows run (each from a trimmed heap); the reserve: their highest peak + their spread


def measure_activation_reserve(runner, max_num_batched_tokens: int, *, max_model_len: int | None = None,
                               max_num_seqs: int = 1) -> int:
    """Peak bytes one engine step of ``max_num_batched_tokens`` tokens allocates (see the module docstring).

    ``max_model_len`` is the longest sequence the engine holds (its context, bounded by its KV blocks). The worst
    step is a chunk at the end of such a sequence: its queries attend to all of it (packed attention gathers one
    sequence's K/V of one layer at a time, so the batch does not add to this). The probe runs that step: the
    budget's tokens as the last positions of a ``max_model_len`` context; a budget longer than the context as
    several sequences packed into the step. Beyond PROBE_CONTEXT keys the probe runs at two contexts and extends
    the line through them (what grows with the context — the gathered K/V, the chunk's mask, attention scores —
    is linear in it), never below the gathered K/V's own bytes per key. Default ``max_model_len``: the budget
    itself (a prefill from position 0: the step the advisor's shape formula describes). ``max_num_seqs``: the step
    also samples that many sequences (up to the budget) — their logits, ``[seqs, vocab]`` in fp32, are part of it."""
    assert max_num_batched_tokens >= 1
    tokens = max_num_batched_tokens
    device = next(runner.hf_model.parameters()).device
    limit = max(1, min(max_model_len or tokens, runner.max_positions or 2**62))
    seqs = max(1, min(max_num_seqs, tokens))
    key = (runner.fingerprint, tokens, limit, seqs, str(device), torch.get_num_threads(), host_memory.in_force())
    if key not in _CACHE:
        probe = _CUDAPeak(device) if device.type == "cuda" else _HostPeak()
        def peak(seq_len: int) -> int:      # identical windows read apart by the heap's state: add their spread
            reads = [_window(runner, tokens, seq_len, device, probe, seqs) for _ in range(PROBE_WINDOWS)]
            return max(reads) + (max(reads) - min(reads))

        try:
            # a first window of the budget's shapes over a short context: the memory the kernels and thread pools
            # keep once set up for those shapes is counted once, as what it holds after the window (``kept``), not
            # as a peak — inside a measured window it read as a peak and again in the windows' spread (after a
            # 16-token warm-up, the first window of tiny at 128 tokens read 3.96 MB against 2.47 for the next two,
            # and the reserve 5.5 MB); left out, served steps went up to 2.7 MiB over the budget (`bench elastic`)
            probe.start()
            _window(runner, tokens, min(limit, tokens), device, None, seqs)
            kept = probe.held()
            far = max(PROBE_CONTEXT, 2 * tokens)
            if tokens >= limit or limit <= far:
                step = peak(limit)
            else:
                near, at_far = peak(far // 2), peak(far)
                floor = runner.shape.kv_bytes_per_token_layer(runner.dtype)      # gathered K and V per key
                slope = max((at_far - near) / (far - far // 2), floor)
                step = int(at_far + slope * (limit - far))
            _CACHE[key] = max(1, step + kept)
        except OSError as err:
            _CACHE[key] = formula_reserve(runner, tokens)
            log.warning("activation reserve not measurable here (%s); using the shape formula: %d B", err, _CACHE[key])
    return _CACHE[key]


def estimated_reserve(runner, tokens: int, *, max_model_len: int | None = None, max_num_seqs: int = 1) -> int:
    """The reserve from the model's shape, no step run (the module docstring's estimate), for the same arguments as
    :func:`measure_activation_reserve`."""
    shape, keys = runner.shape, max(1, min(max_model_len or tokens, runner.max_positions or 2**62))
    seqs = max(1, min(max_num_seqs, tokens))
    return (2 * shape.activation_bytes(tokens, runner.dtype) + 3 * keys * shape.kv_bytes_per_token_layer(runner.dtype)
            + 4 * seqs * shape.vocab)


def engine_reserve(runner, cfg, longest: int) -> tuple[int, str]:
    """(bytes, how) of the activation reserve of an engine with config ``cfg`` whose longest sequence is ``longest``:
    stated, measured (the engine holds its budget) or estimated — the rule of the module docstring."""
    if cfg.activation_reserve:
        return cfg.activation_reserve, "stated"
    args = dict(max_model_len=longest, max_num_seqs=cfg.max_num_seqs)
    if cfg.holds_to_live_set:
        return measure_activation_reserve(runner, cfg.max_num_batched_tokens, **args), "measured"
    return estimated_reserve(runner, cfg.max_num_batched_tokens, **args), "estimated"


@dataclass(frozen=True, slots=True)
class KVSizing:
    """How ``engine.kv_budget: auto`` was sized: a share of the memory available once the weights are loaded and
    the activation reserve set aside, capped at what the engine could ever fill (``max_model_len x max_num_seqs``),
    raised to one ``max_model_len`` sequence where memory allows."""
    budget: int
    per_token: int           # KV bytes of one token (every layer)
    available: int           # bytes available (MemAvailable; a device's free memory) with the weights loaded
    reserve: int
    share: float
    cap: int                 # max_model_len x max_num_seqs tokens' KV
    why: str                 # "share", "cap" or "one sequence"

    def line(self) -> str:
        return (f"kv_budget auto: {_mib(self.budget)} = {self.budget // self.per_token:,} tokens x "
                f"{self.per_token:,} B/token ({self.why}: {self.share:.0%} of {_mib(self.available)} available less "
                f"the {_mib(self.reserve)} activation reserve; cap max_model_len x max_num_seqs = {_mib(self.cap)})")


def auto_kv_budget(runner, cfg, max_model_len: int, reserve: int, available: int | None = None) -> KVSizing:
    """``engine.kv_budget: auto`` for ``runner`` on this machine (see KVSizing); ConfigError when no block fits."""
    from kvflow.errors import ConfigError
    from kvflow.model.runner import free_memory

    per_token = runner.shape.kv_bytes_per_token(runner.dtype)
    if available is None:
        available = free_memory(runner.device) or 0          # host: MemAvailable; CUDA: the device's free bytes
    usable = max(0, available - reserve)
    cap = max_model_len * cfg.max_num_seqs * per_token
    one = max_model_len * per_token
    budget, why = (int(cfg.kv_memory_share * usable), "share")
    if budget >= cap:
        budget, why = cap, "cap"
    elif budget < one and one <= usable // 2:
        budget, why = one, "one sequence"
    if budget < cfg.block_size * per_token:
        raise ConfigError(f"engine.kv_budget auto: {_mib(available)} available holds no KV block of "
                          f"{cfg.block_size * per_token} B; give engine.kv_budget in bytes")
    return KVSizing(budget, per_token, available, reserve, cfg.kv_memory_share, cap, why)


def formula_reserve(runner, tokens: int) -> int:
    """The advisor's estimate (k = 1) for this model's shape and dtype: the fallback when nothing can be measured."""
    return runner.shape.activation_bytes(tokens, runner.dtype)


def _window(runner, tokens: int, seq_len: int, device, probe=None, seqs: int = 1, block_size: int = 16) -> int:
    """One probe window: the step shapes a run of this engine meets, back to back, and the peak over all of them
    from one start (0 without a probe). Shapes: the budget's tokens as a prompt's first chunk (from position 0), as
    a chunk ending half-way to ``seq_len`` and as the last chunk of a ``seq_len`` sequence, each followed by a step
    of one-token decodes. Nothing is handed back between the steps: glibc keeps the pages a step frees, and the
    next step's other sizes do not always fit into them, so one clean step alone reads low (tiny, 4,096 tokens
    at 20K keys: 61-85 MiB for one step; 86-95 MiB for a window; 85-101 MiB above the KV in `bench elastic`)."""
    first = min(tokens, seq_len)
    shapes = dict.fromkeys([_spans(tokens, first, seqs, fresh=True), _spans(tokens, (first + seq_len) // 2, seqs),
                            _spans(tokens, seq_len, seqs)])     # shapes that coincide (a short sequence) run once
    steps = [_prepare(runner, spans, device, block_size) for spans in shapes]
    decodes = _prepare(runner, _spans(seqs, seq_len, seqs), device, block_size)
    if probe is not None:
        probe.start()
    for batch, items in steps:
        batch.execute(items)
        decodes[0].execute(decodes[1])
    return probe.peak() if probe is not None else 0


def _spans(tokens: int, seq_len: int, seqs: int, fresh: bool = False) -> tuple[tuple[int, int], ...]:
    """Positions (start, end) of each sequence of one engine step of ``tokens`` new tokens in sequences of at most
    ``seq_len`` positions. ``seqs - 1`` of the tokens are one-token sequences (every sequence of the step is
    sampled); the rest: ``>= seq_len``, whole sequences from position 0 (and a shorter last one); else one chunk,
    the first positions of a prompt (``fresh``) or the last ones of a ``seq_len`` context."""
    singles = min(seqs, tokens) - 1
    rest = tokens - singles
    if rest >= seq_len:
        spans = [(0, seq_len)] * (rest // seq_len) + ([(0, rest % seq_len)] if rest % seq_len else [])
    else:
        spans = [(0, rest) if fresh else (seq_len - rest, seq_len)]
    return tuple(spans + [(0, 1)] * singles)


def _prepare(runner, spans: tuple[tuple[int, int], ...], device, block_size: int):
    """The step of ``spans`` (``_spans``), ready to run. Its KV is uninitialised memory nothing writes to but the
    step (untouched pages are not resident), and the slots the step writes are touched here, before a probe
    starts: KV is not reserve."""
    from kvflow.engine.model_runner import BatchRunner, StepItem
    from kvflow.engine.paged_cache import PagedKVCache

    per_seq = [math.ceil(end / block_size) for _, end in spans]
    shape = (runner.num_layers, 2, sum(per_seq) * block_size, runner.kv_heads, runner.head_dim)
    cache = PagedKVCache(runner.num_layers, sum(per_seq), block_size, runner.kv_heads, runner.head_dim,
                         runner.dtype, torch.empty(shape, dtype=runner.dtype, device=device))
    items, first = [], 0
    vocab = runner.config.vocab_size
    for (start, end), nb in zip(spans, per_seq):
        table = list(range(first, first + nb))
        cache.kv[:, :, cache.slots(table, start, end)] = 0
        items.append(StepItem(table, start, [(7 * i + 1) % vocab for i in range(start, end)], True))
        first += nb
    return BatchRunner(runner, cache), items


TRIM_TOKENS = 256         # a step computing at least this many tokens hands the heap pages it freed back afterwards
class _HostPeak:
    """Peak resident memory of this process above its level at ``start`` (Linux: VmHWM reset via clear_refs)."""

    def start(self) -> None:
        release_freed_memory()                            # freed heap pages back to the kernel: reuse shows as growth
        with open("/proc/self/clear_refs", "w") as f:    # "5": reset the peak RSS (VmHWM) to the current RSS
            f.write("5")
        self.base = _status_bytes("VmRSS:")

    def peak(self) -> int:
        return _status_bytes("VmHWM:") - self.base

    def held(self) -> int:
        """Resident memory still held above ``start``'s level once freed heap pages are handed back."""
        release_freed_memory()
        return max(0, _status_bytes("VmRSS:") - self.base)


class _CUDAPeak:
    """torch's CUDA allocator peak above its allocated bytes at ``start``. UNTESTED here: no GPU on this machine."""

    def __init__(self, device):
        self.device = device

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base

    def held(self) -> int:
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.memory_allocated(self.device) - self.base)
