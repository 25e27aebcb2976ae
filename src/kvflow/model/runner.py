"""ModelRunner: exact, range-wise execution of a transformers causal LM.

Everything restoration needs is one primitive, :meth:`ModelRunner.run_layers`: run decoder layers
``[l0, l1)`` for tokens ``[start, end)``, given the input hidden states of those tokens at layer ``l0``
and a :class:`KVCache` that already holds layers ``[l0, l1)`` for tokens ``[0, start)``. Full prefill,
token-range prefill, layer-range recompute from boundary activations and the query prefill are all
calls of it. The decoder layers are the model's own modules, so the numbers are the model's own.

Canonical KV layout (the only layout that leaves this module)::

    KVCache.keys[l], KVCache.values[l] : [1, kv_heads, capacity, head_dim]   (transformers layout)
    KV block (token range x layer range) : [n_layers, 2, kv_heads, n_tokens, head_dim]
                                             layer ----^  ^-- 0 = K, 1 = V
"""

from __future__ import annotations

import inspect
import json
import os
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import xxhash

from kvflow.config import env_int
from kvflow.errors import ModelError
from kvflow.model import attention, catalog, chunk_attention
from kvflow.model.attention import splits_at_the_chunk
from kvflow.model.device import default_dtype
from kvflow.model.device import resolve as resolve_device
from kvflow.model.dtypes import parse_dtype
from kvflow.model.host_memory import keep_freed_memory
from kvflow.model.layer import FusedLayer, fuse_layers
from kvflow.model.linear import pack_linears
from kvflow.model.presets import PRESETS, build_config, parse_name
from kvflow.model.shape import ModelShape
from kvflow.spin import govern
from kvflow.threads import compute_threads, set_compute_threads, set_own_threads

# Grouped-query attention with an explicit mask: let SDPA broadcast K/V heads (enable_gqa) instead of
# transformers materialising repeated K/V per call — same numbers, up to 4x faster attention at 8K+ on CPU.
os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")

# Config fields that change the computation (others, e.g. _name_or_path or transformers_version, do not).
_ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
              "rope_parameters", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
              "layer_types", "tie_word_embeddings")


class KVCache:
    """Preallocated K/V of one sequence for every layer; slices are written in place by compute and I/O."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def write_block(self, block: torch.Tensor, tokens: tuple[int, int], layers: tuple[int, int],
                    non_blocking: bool = False) -> None:
        """Copy a canonical block [n_layers, 2, H, T, D] into tokens x layers (from the host to a device: with
        ``non_blocking`` from pinned memory, queued on the current stream; the caller orders it with an event)."""
        (a, b), (l0, l1) = tokens, layers
        assert block.shape[0] == l1 - l0 and block.shape[3] == b - a, (block.shape, tokens, layers)
        for i, layer in enumerate(range(l0, l1)):
            self.keys[layer][0, :, a:b].copy_(block[i, 0], non_blocking=non_blocking)
            self.values[layer][0, :, a:b].copy_(block[i, 1], non_blocking=non_blocking)

    def read_block(self, tokens: tuple[int, int], layers: tuple[int, int]) -> torch.Tensor:
        """A contiguous canonical block [n_layers, 2, H, T, D] (a copy)."""
        (a, b), (l0, l1) = tokens, layers
        return torch.stack([torch.stack([self.keys[l][0, :, a:b], self.values[l][0, :, a:b]])
                            for l in range(l0, l1)])

    def layer_kv(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) views [1, H, length, D], the transformers layout."""
        return [(k[:, :, :length], v[:, :, :length]) for k, v in zip(self.keys, self.values)]


class _RangeSlot:
    """Duck-typed transformers ``Cache`` for one ``run_layers`` call: attention's ``cache.update`` writes
    the new tokens' K/V into the KVCache and gets back K/V of tokens [0, end) of that layer."""

    def __init__(self, cache: KVCache, start: int, end: int):
        self.cache, self.start, self.end = cache, start, end

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        k[:, :, self.start:self.end].copy_(key_states)
        v[:, :, self.start:self.end].copy_(value_states)
        return k[:, :, :self.end], v[:, :, :self.end]


@dataclass(slots=True)
class PrefillResult:
    cache: KVCache
    length: int
    logits: torch.Tensor  # next-token logits after the last token, [vocab]


class ModelRunner:
    """A transformers causal LM driven range by range. Build with :func:`load_model`."""

    def __init__(self, hf_model, name: str):
        self.hf_model = hf_model.eval()
        self.device = next(hf_model.parameters()).device
        self.name = name
        self.config = hf_model.config
        self.config._attn_implementation = attention.NAME     # sdpa unless a call asks for more (model/attention.py)
        base = getattr(hf_model, "model", None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not all(hasattr(base, a) for a in needed) or not hasattr(hf_model, "lm_head"):
            raise ModelError(f"{name}: architecture {type(hf_model).__name__} is not a decoder-only LM kvflow can "
                             "drive (needs model.embed_tokens/layers/norm/rotary_emb and lm_head)")
        self._base = base
        params = inspect.signature(base.layers[0].forward).parameters
        self._cache_kw = next((k for k in ("cache", "past_key_values", "past_key_value") if k in params), None)
        if self._cache_kw is None:
            raise ModelError(f"{name}: decoder layer takes no cache argument; unsupported transformers version")
        self.num_layers = len(base.layers)
        self.shape = ModelShape.from_config(name, self.config.to_dict())
        assert self.shape.layers == self.num_layers, (self.shape.layers, self.num_layers)
        self.kv_heads, self.head_dim = self.shape.kv_heads, self.shape.head_dim
        self.hidden_size = self.config.hidden_size
        self.dtype = next(hf_model.parameters()).dtype
        self._windows = [self._sliding_window(i) for i in range(self.num_layers)]
        # large fp32 linear layers on the host through oneDNN with packed weights (model/linear.py)
        self.packed_linear_bytes = pack_linears(hf_model, free_memory(self.device)) if self.device.type == "cpu" \
            else 0
        # the runner's own paths run each layer in fewer ops where that gives the layer's result (model/layer.py)
        self.layers = fuse_layers(base.layers, base.rotary_emb, self._cache_kw, free_memory(self.device)) \
            if self.device.type == "cpu" else list(base.layers)
        self.fused_layers = sum(1 for a, b in zip(self.layers, base.layers) if a is not b)

    def _sliding_window(self, layer: int) -> int | None:
        window = getattr(self.config, "sliding_window", None)
        if not window:
            return None
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer] == "sliding_attention" else None
        if self.config.model_type == "qwen2" and not getattr(self.config, "use_sliding_window", False):
            return None
        return window

    # ----------------------------------------------------------------------------------------- facts
    def kv_bytes_per_token(self, dtype: str | torch.dtype | None = None) -> int:
        """Bytes of K and V per token over all layers, in ``dtype`` (default: the dtype this model computes and
        caches in — fp32 on the CPU, bf16 on a GPU)."""
        return self.shape.kv_bytes_per_token(dtype or self.dtype)

    def block_shape(self, n_tokens: int, n_layers: int) -> tuple[int, ...]:
        return (n_layers, 2, self.kv_heads, n_tokens, self.head_dim)

    @cached_property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.hf_model.parameters())

    @cached_property
    def fingerprint(self) -> str:
        """Stable id of architecture + weights: xxh3-128 over the config and every parameter's bytes."""
        h = xxhash.xxh3_128()
        arch = {k: getattr(self.config, k, None) for k in _ARCH_KEYS}
        h.update(json.dumps(arch, sort_keys=True, default=str).encode())
        for name, p in sorted(self.hf_model.state_dict().items()):
            h.update(name.encode())
            h.update(str(p.dtype).encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().data)
        return h.hexdigest()

    @property
    def bit_for_bit(self) -> bool:
        """Whether every prefill path (any chunking, engine steps, restoration) gives this model the full prefill's
        bits here, not only agreement within the exactness bound (docs/DESIGN.md, "Exactness"): fp32 on the host,
        the native chunk op on for its head size, every decoder layer fused with its rows computed alike
        (``FusedLayer.row_alike``: packed oneDNN projections, native elementwise ops), and no sliding window."""
        return (self.device.type == "cpu" and self.dtype == torch.float32 and chunk_attention.available()
                and chunk_attention.fits(self.head_dim) and not any(self._windows)
                and all(isinstance(layer, FusedLayer) and layer.row_alike for layer in self.layers))

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    def check_context_len(self, n: int, copies: int = 4) -> None:
        """Refuse a context of ``n`` tokens that the model cannot address or this machine cannot hold: ``copies``
        fp32 KV caches of n tokens (restored cache, reference prefill, stored records, staging) plus the weights
        must fit the free memory of the device the model runs on. One ModelError line, before any allocation."""
        if n < 1:
            raise ModelError(f"context of {n} tokens: must be at least 1")
        if self.max_positions and n > self.max_positions:
            raise ModelError(f"context of {n:,} tokens exceeds {self.name}'s {self.max_positions:,} positions")
        need = copies * n * self.kv_bytes_per_token("float32") + self.num_parameters * self.dtype.itemsize
        free = free_memory(self.device)
        if free is not None and need > free:
            raise ModelError(f"context of {n:,} tokens needs about {need / 2**30:.1f} GiB for {self.name}'s KV "
                             f"caches; {free / 2**30:.1f} GiB is free")

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.num_layers, self.kv_heads, self.head_dim, capacity, self.dtype, self.device)

    # ------------------------------------------------------------------------------------ execution
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids (on any device) -> [1, T, hidden] input hidden states of layer 0, on the model's device."""
        with torch.inference_mode():
            return self._base.embed_tokens(token_ids.view(1, -1).to(self.device, non_blocking=True))

    def _mask(self, start: int, end: int, window: int | None) -> torch.Tensor | None:
        if (start == 0 or end - start == 1) and window is None:
            return None  # plain causal (or a single query row): SDPA's fast path
        q = torch.arange(start, end, device=self.device).view(-1, 1)
        k = torch.arange(0, end, device=self.device).view(1, -1)
        allowed = k <= q
        if window is not None:
            allowed &= (q - k) < window
        return allowed.view(1, 1, end - start, end)

    def run_layers(self, cache: KVCache, hidden: torch.Tensor, start: int, layers: tuple[int, int]) -> torch.Tensor:
        """Run decoder layers [l0, l1) on ``hidden`` ([1, T, hidden], the input of layer l0 for tokens
        [start, start+T)). Writes those tokens' K/V of each layer into ``cache`` and returns the output
        hidden states of layer l1-1. ``cache`` must hold layers [l0, l1) for tokens [0, start)."""
        l0, l1 = layers
        hidden = hidden.to(self.device, self.dtype)     # stage inputs: fp32 activations from the pool, the host
        end = start + hidden.shape[1]
        assert 0 <= l0 <= l1 <= self.num_layers and end <= cache.capacity, (layers, start, end, cache.capacity)
        # windowless layers: no mask — the native chunk op, else prefix + diagonal (attention.py)
        split = splits_at_the_chunk(hidden, start, end - start, None) or (
            chunk_attention.fits(self.head_dim, hidden) and chunk_attention.available())
        with torch.inference_mode():
            position_ids = torch.arange(start, end, device=self.device).view(1, -1)
            position_embeddings = self._base.rotary_emb(hidden, position_ids)
            slot = _RangeSlot(cache, start, end)
            masks: dict[int | None, torch.Tensor | None] = {}
            for layer in range(l0, l1):
                window = self._windows[layer]
                unmasked = split and window is None
                if window not in masks:
                    masks[window] = None if unmasked else self._mask(start, end, window)
                hidden = self.layers[layer](hidden, attention_mask=masks[window], position_ids=position_ids,
                                            position_embeddings=position_embeddings, use_cache=True,
                                            kvflow_start=start if unmasked else None, **{self._cache_kw: slot})
                if isinstance(hidden, tuple):  # transformers versions whose layers return (hidden, ...)
                    hidden = hidden[0]
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the last position of ``hidden`` [1, T, hidden] -> [vocab] (fp32, on the host:
        logits always leave the runner there, for the sampler and for comparisons)."""
        with torch.inference_mode():
            return self.hf_model.lm_head(self._base.norm(hidden[:, -1:])).view(-1).float().cpu()

    def logits_many(self, hiddens: list[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`logits` of several sequences in one pass over the LM head (for one token per sequence the head is
        memory-bound: reading its weights once instead of k times is most of the saving)."""
        with torch.inference_mode():
            last = torch.cat([h[:, -1:] for h in hiddens])                       # [k, 1, hidden]
            return list(self.hf_model.lm_head(self._base.norm(last)).view(len(hiddens), -1).float().cpu())

    def prefill_range(self, cache: KVCache, token_ids: torch.Tensor, start: int) -> torch.Tensor:
        """Prefill ``token_ids`` at positions [start, start+T) through every layer, given KV of [0, start).
        Returns the final hidden states [1, T, hidden]."""
        return self.run_layers(cache, self.embed(token_ids), start, (0, self.num_layers))

    def prefill(self, token_ids: torch.Tensor, capacity: int | None = None, chunk: int | None = None) -> PrefillResult:
        """Fresh prefill of ``token_ids`` (optionally ``chunk`` tokens at a time) into a new cache."""
        n = token_ids.numel()
        cache = self.new_cache(capacity or n)
        step = chunk or n
        for a in range(0, n, step):
            hidden = self.prefill_range(cache, token_ids[a:a + step], a)
        return PrefillResult(cache, n, self.logits(hidden))

    def reference_prefill(self, token_ids: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """One plain transformers forward over all tokens: the ground truth every restoration is checked against.
        Returns per-layer (k, v) [1, H, T, D] and next-token logits [vocab]."""
        with torch.inference_mode():
            out = self.hf_model(input_ids=token_ids.view(1, -1).to(self.device), use_cache=True, logits_to_keep=1)
        cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
        if hasattr(cache, "layers"):
            kv = [(layer.keys, layer.values) for layer in cache.layers]
        else:
            kv = list(zip(cache.key_cache, cache.value_cache))
        return kv, out.logits[0, -1].float().cpu()


def free_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device`` (host: MemAvailable), None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def max_threads() -> int:
    """Most torch threads kvflow will ask for: oversubscribing a few times is a choice, 99999 is a typo (and
    crashes the OpenMP runtime)."""
    return max(64, 4 * (os.cpu_count() or 1))


set_compute_threads(torch.get_num_threads())    # torch's own choice, read on import before a helper thread sets 1


def _resolve_threads() -> None:
    """$KVFLOW_TORCH_THREADS, else on the main thread its count (torch's default or the caller's own choice), on
    another (a set-up thread) the computing thread's: applied to this thread and recorded as the computing thread's
    count (kvflow/threads.py)."""
    threads = env_int("KVFLOW_TORCH_THREADS", 1, max_threads())    # checked before torch sees it
    if not threads:
        threads = torch.get_num_threads() if threading.current_thread() is threading.main_thread() else \
            compute_threads()
    set_own_threads(threads)
    set_compute_threads(threads)


def load_model(name_or_path: str, *, seed: int = 0, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None) -> ModelRunner:
    """A real model by name (``smollm2-135m``: model/catalog.py, converted once), a preset name (``tiny``,
    ``qwen2.5-0.5b``, ``llama-3.2-1b@layers=4`` ...) built with random weights from ``seed``, or a local
    transformers checkpoint directory, on ``device`` (model/device.py: default cpu, or
    ``kvflow --device`` / $KVFLOW_DEVICE) in ``dtype`` (default fp32 on the CPU, bf16 on CUDA). A preset's weights
    are drawn on the host whatever the device, so one seed gives the same model everywhere."""
    where = resolve_device(device)
    torch_dtype = parse_dtype(dtype) if dtype is not None else default_dtype(where)
    _resolve_threads()
    govern(compute_threads())     # OpenMP workers spin only while the cores are free: kvflow/spin.py
    keep_freed_memory()           # host intermediates reused, not faulted in again every step: model/host_memory.py
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    name = name_or_path
    path = catalog.resolve(name_or_path) if catalog.is_real(name_or_path) else Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{name_or_path}: not a transformers checkpoint (no config.json)")
        from safetensors import SafetensorError
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa",
                                                         local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as err:
            # truncated/garbled weights, a bad config.json, a shape that does not match its tensors
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ModelError(f"{name_or_path}: cannot load checkpoint: {first}") from None
        return ModelRunner(_place(model, where, name_or_path), name if catalog.is_real(name) else str(path))
    if name_or_path.partition("@")[0] not in PRESETS and ("/" in name_or_path or path.suffix):
        raise ModelError(f"{name_or_path}: no such checkpoint directory")
    preset, layers = parse_name(name_or_path)
    config = build_config(preset, layers)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return ModelRunner(_place(model, where, name_or_path), name_or_path)


def _place(model, device: torch.device, name: str):
    """The model's weights on ``device``; a device too small for them is one ModelError line."""
    if device.type == "cpu":
        return model
    try:
        return model.to(device)
    except torch.OutOfMemoryError:
        need = sum(p.numel() * p.element_size() for p in model.parameters())
        raise ModelError(f"{name}: its {need / 2**30:.1f} GiB of weights do not fit {device} "
                         f"({(free_memory(device) or 0) / 2**30:.1f} GiB free)") from None
