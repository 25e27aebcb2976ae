"""A decoder layer in fewer ops: the runner's own forward of a Llama-shaped layer, on the host in fp32.

transformers' decoder layer is a tree of modules driven op by op: two RMSNorms of eight ops each, q, k and v as
three projections, rotary embedding applied to q and to k apart, views and transposes between, and the Python of
every module call, decorator and keyword pass-through. On a 30-layer model at one decode row that is ~1,500 ops and
~15 ms of a ~50 ms step outside the ops' own time (smollm2-135m, the 2-vCPU box). :class:`FusedLayer` computes the
same layer as

    x = rms_norm(h)                      one op, the layer's weight and epsilon
    q|k|v = x @ [Wq; Wk; Wv]             one packed oneDNN call (model/linear.py), the biases as one
    q|k = q|k * cos + rotate_half(q|k) * sin      q's and k's heads rotated together, in place
    cache.update(k, v); attention(q, k, v)        the model's attention function, with the caller's keywords
    h = h + o(attn);  x = rms_norm(h)    one op
    h + mlp(x)                           the MLP as it is (packed gate and up, and one silu_mul, where they fuse)

The norms, the rotation and the residual add are kvflow's native ops (native.py) where its library is built: torch's
CPU rms_norm is a composite of ~8 ops and the rotation ~8 more. Engine decode steps of smollm2-135m alternated
between the native ops and torch's (with the MLP's silu_mul, model/linear.py; p50 of 25): 40 against 46 ms at 1
sequence, 63 against 68 at 8, 134 against 141 at 32; a prefill of 8 x 256 tokens 3.36 against 3.64 s. Without the
library, torch's ops.

It is used only where it gives the module's own result: at load, a probe (random hidden states of a few tokens,
through a scratch cache) must match the module's output and written K/V within 1e-5 of their largest value, else the
layer keeps its own forward. A layer with anything the fused forward does not know (a q/k norm, a weight it does not
read) fails the structural check first. The fused forward serves the runner's paths (``ModelRunner.run_layers``, the
engine's steps); the model's own ``forward`` — ``generate``, the reference prefill every restoration is checked
against — still runs the module, so the exactness tests compare one against the other.

**One computation for every path.** Where a layer fuses, its module is made to compute each part as the fused
layer does (``compute_alike``): its two norms through the same rms_norm op, q, k and v through packed oneDNN (a
row's result is the same bit for bit whether the weights are stacked or apart), and the native rotation rounds as
transformers' formula does. The module and the fused layer then give the same output and K/V bit for bit on the
same attention; with the full prefill attending through the native chunk op too (model/attention.py), a chunked,
restored or served prefill gives the full one's KV bit for bit on the host. The module is aligned only after the
probe has compared the fused layer with its own forward as loaded, so a norm that only looks like Llama's (another
formula behind the same attributes) fails the probe and is never replaced. Before, each path rounded its norms,
rotation and k/v projections its own way, and over 30 layers the ulp-sized differences compounded: on smollm2-135m
at 8,192 tokens the engine's KV landed 5.5-9.4e-5 from the full prefill's over four random-word texts (the bound is
1e-4). docs/DESIGN.md ("Exactness") has the measurements and the fp32 full prefill's own distance from an fp64 one.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F

from kvflow import native
from kvflow.model import attention, linear

log = logging.getLogger(__name__)

_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _rms_eps(norm: torch.nn.Module) -> float | None:
    """An RMSNorm's epsilon when it is Llama's (a weight of the hidden size and ``variance_epsilon``), else None."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    w = getattr(norm, "weight", None)
    params = dict(norm.named_parameters())
    return eps if isinstance(eps, float) and isinstance(w, torch.nn.Parameter) and list(params) == ["weight"] \
        else None


class FusedLayer:
    """Callable as the decoder layer (``hidden_states, attention_mask=, position_ids=, position_embeddings=``, the
    cache under any of transformers' names, attention keywords passed through); module docstring."""

    def __init__(self, layer: torch.nn.Module):
        self.layer = layer
        attn = self.attn = layer.self_attn
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.eps1, self.eps2 = _rms_eps(self.norm1), _rms_eps(self.norm2)
        self.head_dim = attn.head_dim
        self.q_heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.qkv, self.qkv_bias = linear.PackedWeight(), linear.PackedWeight(reorder=False)
        self.mlp = layer.mlp
        # the elementwise parts as native ops (native.py) where the library is built, else torch's
        self.ops = torch.ops.kvflow if native.loaded() and self._contiguous_weights() else None

    @property
    def row_alike(self) -> bool:
        """Whether a row gets the same bits whatever shares its call: the elementwise parts native, q|k|v stacked
        and every other projection on packed oneDNN (a projection too small to pack keeps F.linear, whose rows of a
        short or odd-sized call can round differently)."""
        a = self.attn
        return self.ops is not None and linear.all_packed(self.layer, skip=(a.q_proj, a.k_proj, a.v_proj))

    def _contiguous_weights(self) -> bool:
        return self.norm1.weight.is_contiguous() and self.norm2.weight.is_contiguous()

    def _bias(self) -> torch.Tensor | None:
        a = self.attn
        return None if a.q_proj.bias is None else self.qkv_bias.of(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)

    def __call__(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                 position_embeddings=None, use_cache=None, cache=None, past_key_values=None, past_key_value=None,
                 **kwargs) -> torch.Tensor:
        if not linear.host_fp32(hidden_states):
            return self.layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                              position_embeddings=position_embeddings, use_cache=use_cache, cache=cache,
                              past_key_values=past_key_values, past_key_value=past_key_value, **kwargs)
        a = self.attn
        slot = cache if cache is not None else past_key_values if past_key_values is not None else past_key_value
        t = hidden_states.shape[1]
        hq, hkv, d = self.q_heads, self.kv_heads, self.head_dim
        ops = self.ops
        w2 = self.norm2.weight
        x = rms_norm(hidden_states, self.norm1.weight, self.eps1, ops)
        qkv = self.qkv.apply(x, (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), self._bias())
        qkv = qkv.view(t, hq + 2 * hkv, d)
        cos, sin = position_embeddings                               # [1, T, D]
        if ops:                                                      # q's and k's heads rotated in place
            ops.rotary_(qkv, cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous(), hq + hkv)
            qk = qkv
        else:
            cos, sin = cos.view(t, 1, d), sin.view(t, 1, d)
            qk = qkv[:, :hq + hkv]
            half = d // 2
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
        q = qk[:, :hq].transpose(0, 1).unsqueeze(0)                  # [1, Hq, T, D]
        k = qk[:, hq:hq + hkv].transpose(0, 1).unsqueeze(0)          # [1, Hkv, T, D]
        v = qkv[:, hq + hkv:].transpose(0, 1).unsqueeze(0)
        if slot is not None:
            k, v = slot.update(k, v, a.layer_idx)
        out, _ = attention.attention(a, q, k, v, attention_mask, scaling=a.scaling, **kwargs)
        o = a.o_proj(out.reshape(1, t, hq * d))
        if ops:                                                      # the sum, then rms_norm's own rows
            h, x = ops.add_rms_norm(hidden_states.contiguous(), o.contiguous(), w2, self.eps2)
        else:
            h = hidden_states + o
            x = rms_norm(h, w2, self.eps2, None)
        return h + self.mlp(x)

    def compute_alike(self) -> None:
        """Make the module compute each part as this layer does (module docstring, "One computation for every
        path"): its norms through ``rms_norm`` with this layer's ops, q, k and v through packed oneDNN. Only once
        this layer has matched the module's own forward on its probe (``fuse``): that is what says the parts are the
        same computation."""
        a = self.attn
        self.norm1.forward = SharedRMSNorm(self.norm1, self.eps1, self.ops)
        self.norm2.forward = SharedRMSNorm(self.norm2, self.eps2, self.ops)
        for p in (a.q_proj, a.k_proj, a.v_proj):
            if not isinstance(vars(p).get("forward"), linear.PackedLinear):
                p.forward = linear.PackedLinear(p)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, ops) -> torch.Tensor:
    """The fused layer's RMSNorm, and its module's norms' once aligned: the native op (``ops``) or torch's."""
    if ops is not None and linear.host_fp32(x, weight) and weight.is_contiguous():
        return ops.rms_norm(x.contiguous(), weight, eps)
    return F.rms_norm(x, (weight.numel(),), weight, eps)


class SharedRMSNorm:
    """``forward`` of a fused layer's RMSNorm module: ``rms_norm`` with the layer's ops (FusedLayer.compute_alike)."""

    def __init__(self, norm: torch.nn.Module, eps: float, ops) -> None:
        self.norm, self.eps, self.ops = norm, eps, ops

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        if not linear.host_fp32(hidden_states, norm.weight):      # where the fused layer runs the module too
            return type(norm).forward(norm, hidden_states)
        return rms_norm(hidden_states, norm.weight, self.eps, self.ops)

    def __deepcopy__(self, memo):
        return SharedRMSNorm(copy.deepcopy(self.norm, memo), self.eps, self.ops)


def _shaped_like_llama(layer: torch.nn.Module) -> bool:
    """Exactly the parts FusedLayer reads: two RMSNorms, q/k/v/o projections (q, k, v with biases all or none) and
    nothing else in the attention module that holds weights (a q/k norm would be skipped), an MLP."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not all(isinstance(getattr(attn, p, None), torch.nn.Linear) for p in _ATTENTION_PARTS):
        return False
    if {n for n, _ in attn.named_children()} != set(_ATTENTION_PARTS):
        return False
    if {n for n, _ in layer.named_children()} != {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}:
        return False
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    if len({p.bias is None for p in (q, k, v)}) != 1 or not isinstance(getattr(attn, "head_dim", None), int):
        return False
    if q.out_features % attn.head_dim or k.out_features != v.out_features or k.out_features % attn.head_dim:
        return False
    if not all(linear.host_fp32(p.weight) for p in (q, k, v)):
        return False
    return _rms_eps(layer.input_layernorm) is not None and _rms_eps(layer.post_attention_layernorm) is not None


class _ProbeSlot:
    """A scratch cache for the probe: keeps the K/V written, returns them for attention."""

    def __init__(self) -> None:
        self.kv = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.kv = (key_states.clone(), value_states.clone())
        return key_states, value_states


def fuse_layers(layers, rotary: torch.nn.Module, cache_kw: str, free_bytes: int | None) -> list:
    """The runner's layers: each one's FusedLayer where it fuses (``fuse``), else the module. None fuse with
    ``$KVFLOW_LINEAR=torch`` or without oneDNN, or when the packed q|k|v copies (stacked for the fused layer, and
    apart for its module) would take more than a quarter of ``free_bytes`` (the rule packing the other linear
    layers follows, model/linear.py)."""
    layers = list(layers)
    if not (linear.available() and linear.mode() == "onednn"):
        return layers
    shaped = [layer for layer in layers if _shaped_like_llama(layer)]
    need = sum(2 * sum(getattr(layer.self_attn, p).weight.numel() * 4 for p in ("q_proj", "k_proj", "v_proj"))
               for layer in shaped)
    if free_bytes is not None and need > free_bytes // 4:
        log.info("decoder layers keep their own forward: packing q|k|v would take %d MiB of %d MiB free",
                 need >> 20, free_bytes >> 20)
        return layers
    return [fuse(layer, rotary, cache_kw) if layer in shaped else layer for layer in layers]


def fuse(layer: torch.nn.Module, rotary: torch.nn.Module, cache_kw: str):
    """``layer``'s FusedLayer when the probe matches its own forward (its module then made to compute alike); else
    ``layer``, untouched."""
    fused = FusedLayer(layer)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 5, layer.input_layernorm.weight.numel(), generator=gen)
    positions = torch.arange(3, 8).view(1, -1)
    try:
        with torch.inference_mode():
            emb = rotary(hidden, positions)
            want_slot, got_slot = _ProbeSlot(), _ProbeSlot()
            want = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=emb,
                         use_cache=True, **{cache_kw: want_slot})
            want = want[0] if isinstance(want, tuple) else want
            got = fused(hidden, attention_mask=None, position_ids=positions, position_embeddings=emb,
                        use_cache=True, **{cache_kw: got_slot})
    except (RuntimeError, TypeError, ValueError, AttributeError) as err:      # a shape or call it does not take
        log.info("layer %s keeps its own forward: the fused one failed its probe (%s)", type(layer).__name__, err)
        return layer
    if not (linear.agrees(want, got) and all(linear.agrees(w, g) for w, g in zip(want_slot.kv, got_slot.kv))):
        log.info("layer %s keeps its own forward: the fused one differs on its probe", type(layer).__name__)
        return layer
    fused.compute_alike()
    return fused
