"""The prefill activation reserve, measured, and the memory budget the engine reports at start-up.

    budget = MemoryBudget(weights, activation_reserve, kv_blocks, num_blocks, block_size)
    log.info(budget.line())   # memory: weights 11.5 MiB + activation reserve 9.8 MiB + KV blocks 256.0 MiB (...) = ...

The reserve is what one engine step of ``max_num_batched_tokens`` tokens allocates beyond the weights and the KV
blocks (hidden states, MLP intermediates, gathered K/V, attention workspace, logits). It is *measured*: one
prefill step of that many tokens through the engine's own ``BatchRunner`` over a throw-away paged cache, and

* on CPU: the process's peak resident memory during the step above its resident memory before it — glibc's free
  memory is handed back first (``malloc_trim``) and the kernel's high-water mark reset (``/proc/self/clear_refs``
  = 5), so ``VmHWM`` after the step minus ``VmRSS`` before it is what the step really touched;
* on CUDA (written, not yet run on a GPU here): ``torch.cuda.max_memory_allocated`` minus the allocated bytes
  before the step, after ``reset_peak_memory_stats``.

The CPU reading is process-wide: taken at start-up, before other threads of the engine run. Where it cannot be
taken (no ``/proc/self/clear_refs``: not Linux, a locked-down container) the reserve is the advisor's shape formula
(docs/ADVISOR.md) and a warning says so. Measurements are cached per (model fingerprint, token budget, longest sequence, device, torch threads) for the
process, so every engine of one model and budget measures once.
"""

from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger("kvflow.engine")
_CACHE: dict[tuple, int] = {}
_WARMUP_TOKENS = 16      # a first small step: lazy kernel/thread-pool set-up is not part of the reserve


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


def measure_activation_reserve(runner, max_num_batched_tokens: int, *, max_model_len: int | None = None) -> int:
    """Peak bytes one prefill step of ``max_num_batched_tokens`` tokens allocates (see the module docstring).
    A budget longer than the model's context is measured as several sequences packed into the one step."""
    assert max_num_batched_tokens >= 1
    device = next(runner.hf_model.parameters()).device
    limit = max(1, min(max_model_len or runner.max_positions or max_num_batched_tokens, max_num_batched_tokens))
    key = (runner.fingerprint, max_num_batched_tokens, limit, str(device), torch.get_num_threads())
    if key not in _CACHE:
        probe = _CUDAPeak(device) if device.type == "cuda" else _HostPeak()
        _step(runner, min(_WARMUP_TOKENS, max_num_batched_tokens), limit, device)
        try:
            _CACHE[key] = max(1, _step(runner, max_num_batched_tokens, limit, device, probe))
        except OSError as err:
            _CACHE[key] = formula_reserve(runner, max_num_batched_tokens)
            log.warning("activation reserve not measurable here (%s); using the shape formula: %d B", err, _CACHE[key])
    return _CACHE[key]


def formula_reserve(runner, tokens: int) -> int:
    """The advisor's estimate (k = 1) for this model's shape and dtype: the fallback when nothing can be measured."""
    from kvflow.advisor.memory import activation_reserve
    from kvflow.advisor.shapes import shape_from_config

    return activation_reserve(shape_from_config(runner.name, runner.config.to_dict()), tokens, 1, runner.dtype.itemsize)


def _step(runner, tokens: int, seq_len: int, device, probe=None, block_size: int = 16) -> int:
    """Run one engine step of ``tokens`` prompt tokens (sequences of at most ``seq_len``); the probe's peak."""
    from kvflow.engine.model_runner import BatchRunner, StepItem
    from kvflow.engine.paged_cache import PagedKVCache

    lengths = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    per_seq = [math.ceil(n / block_size) for n in lengths]
    cache = PagedKVCache(runner.num_layers, sum(per_seq), block_size, runner.kv_heads, runner.head_dim,
                         runner.dtype)
    cache.kv = cache.kv.to(device).fill_(0)              # resident before the probe starts: KV is not reserve
    items, first = [], 0
    vocab = runner.config.vocab_size
    for n, nb in zip(lengths, per_seq):
        items.append(StepItem(list(range(first, first + nb)), 0, [(7 * i + 1) % vocab for i in range(n)], True))
        first += nb
    batch = BatchRunner(runner, cache)
    if probe is None:
        batch.execute(items)
        return 0
    probe.start()
    batch.execute(items)
    return probe.peak()


class _HostPeak:
    """Peak resident memory of this process above its level at ``start`` (Linux: VmHWM reset via clear_refs)."""

    def start(self) -> None:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)      # freed heap pages back to the kernel: reuse shows as growth
        except (OSError, AttributeError):
            pass
        with open("/proc/self/clear_refs", "w") as f:    # "5": reset the peak RSS (VmHWM) to the current RSS
            f.write("5")
        self.base = _status_bytes("VmRSS:")

    def peak(self) -> int:
        return _status_bytes("VmHWM:") - self.base


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


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")
